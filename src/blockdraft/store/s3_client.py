"""The S3 connection and its failures: endpoint and URL parsing, the boto3 client and part pool that every store
under one URL shares, and the translation of any boto3/botocore failure into one `StoreError` line (docs/STORE.md).

Two clients, two promises: transfers wait long (a part may take a while), the probe fails fast. The first request of a
connection is preceded by one probe request, and preflight sends all of its requests through the probe client, so an
endpoint that accepts connections and never answers fails a command in seconds (docs/STORE.md, preflight).
botocore has no per-request timeout, so one client must choose: measured 2026-12-05 (`python -m bench.s3_probe`, load
average 1.4 -> 0.6 on 2 cores), against a 127.0.0.1 port that accepts and never answers, a store fails in 10.1 s, one
client with the transfer settings was still waiting after 30 s (its settings allow about 480 s), and one client with the
probe's settings fails in 10.1 s too but would give every 64 MiB part 5 s and 2 tries; a refused port fails in 0.01-0.22
s any way. The probe costs 5 ms once per connection (a fresh store's first request: 18.8 ms against 13.6 ms).

Imported only for `s3://` URLs (`open_store` imports the S3 backend lazily), so boto3's import cost is paid only there.
"""

from __future__ import annotations

import base64
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import botocore.exceptions as bex
import botocore.loaders
import botocore.session
from boto3.session import Session
from botocore.config import Config

from blockdraft.config import StoreConfig
from blockdraft.errors import StoreError, redact, remember_secret, remember_url, safe_url

MIB = 1024 * 1024
T = TypeVar("T")

# Transfers: a part of store.part_size_mib may take a while to be answered; the first try and three retries.
TRANSFER_CONNECT_TIMEOUT_S = 5
TRANSFER_READ_TIMEOUT_S = 120
TRANSFER_ATTEMPTS = 4
# The probe (the first request of a connection, every request of preflight): small requests that a working endpoint
# answers in well under a second; the first try and one retry, so a stalled endpoint fails within
# PROBE_ATTEMPTS x (connect or read timeout) plus a jittered backoff under a second: about 11 s.
PROBE_CONNECT_TIMEOUT_S = 3
PROBE_READ_TIMEOUT_S = 5
PROBE_ATTEMPTS = 2


def b64(crc: int) -> str:
    """The S3 spelling of a CRC64NVME: base64 of its 8 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(8, "big")).decode()


def resolve_endpoint(configured: str | None, environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Endpoint precedence (docs/STORE.md): flag or config (already merged into `configured`),
    then AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then the AWS default (None)."""
    return configured or environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None


def parse_s3_url(url: str) -> tuple[str, str]:
    """('bucket', 'prefix/') from 's3://bucket/prefix'; the prefix is '' or ends with '/'."""
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"no bucket in {url}; write s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


@dataclass
class _Contact:
    """Whether the endpoint has answered this connection yet, or the failure its probe met; shared by a connection
    and its probing view."""

    answered: bool = False
    failed: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Connection:
    """What every store under one URL shares: the client, the endpoint, and the bounded part pool.

    `part_size` in bytes; `concurrency` parts (of every file of the store together) are in flight at most.
    `make_probe` builds the probe client (short timeouts, one retry) on first use; `probe_client` is `client` itself for
    the view that `probing` returns.
    """

    client: Any
    endpoint: str | None
    part_size: int
    concurrency: int
    make_probe: Callable[[], Any] | None = None
    _pool: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _probe: Any = None
    _contact: _Contact = field(default_factory=_Contact)

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-part")
            return self._pool

    @property
    def is_probe(self) -> bool:
        return self.make_probe is None

    @property
    def probe_client(self) -> Any:
        with self._lock:
            if self._probe is None:
                self._probe = self.client if self.make_probe is None else self.make_probe()
            return self._probe

    def probing(self) -> Connection:
        """This connection with every request sent through the probe client (preflight's small requests)."""
        return Connection(self.probe_client, self.endpoint, self.part_size, 1, _contact=self._contact)

    def answered(self) -> None:
        self._contact.answered = True

    def reach(self, bucket: str, url: str, action: str) -> None:
        """Before the first request of this connection, one HEAD of the bucket through the probe client: an endpoint
        that accepts connections and never answers fails here in seconds, not after the transfer client's minutes.

        Any answer (403 and 404 included) and any local failure (no credentials) count: the real request names those.
        A failed probe is not repeated: every later request of the connection fails at once with its line, naming that
        request's own URL (a command that checks many files must not wait for each).
        """
        contact = self._contact
        if contact.answered or self.is_probe:
            return
        with contact.lock:
            if contact.failed is not None:
                raise probe_failed(contact.failed, url, self.endpoint, action)
            if contact.answered:
                return
            try:
                self.probe_client.head_bucket(Bucket=bucket)
            except (bex.ConnectionError, bex.HTTPClientError) as exc:
                contact.failed = exc
                raise probe_failed(exc, url, self.endpoint, action) from None
            except Exception:
                pass
            contact.answered = True


@functools.cache
def _shared_loader() -> Any:
    """One botocore data loader per process: the S3 service model is parsed once, not per store (~150 ms each)."""
    return botocore.loaders.create_loader()


def _client_config(region: str, endpoint: str | None, concurrency: int, probe: bool = False) -> Config:
    """The transfer client's config, or with `probe` the probe client's: short timeouts, one retry, few connections."""
    return Config(
        region_name=region,
        signature_version="s3v4",
        # total_max_attempts counts the first try (botocore's max_attempts would count retries only).
        retries={"mode": "standard", "total_max_attempts": PROBE_ATTEMPTS if probe else TRANSFER_ATTEMPTS},
        connect_timeout=PROBE_CONNECT_TIMEOUT_S if probe else TRANSFER_CONNECT_TIMEOUT_S,
        read_timeout=PROBE_READ_TIMEOUT_S if probe else TRANSFER_READ_TIMEOUT_S,
        max_pool_connections=2 if probe else 2 * concurrency + 4,
        # We always send our own CRC64NVME; botocore must not add a second checksum or validate ranged parts.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # The body is covered by the signed x-amz-checksum header, which the server checks: hashing it again
        # with SHA-256 for the signature would only cost a core over plain-HTTP endpoints.
        s3={"addressing_style": "path" if endpoint else "auto", "payload_signing_enabled": False},
    )


def make_connection(store_config: StoreConfig | None) -> Connection:
    """A client for `store_config` (None: the defaults), the AWS chain filling in what it leaves unset."""
    cfg = store_config or StoreConfig()
    endpoint = resolve_endpoint(cfg.endpoint_url)
    remember_url(endpoint)  # a password or token in the endpoint is redacted wherever a library echoes the URL
    core = botocore.session.get_session()
    core.register_component("data_loader", _shared_loader())
    try:
        session = Session(botocore_session=core, profile_name=cfg.profile)
    except bex.ProfileNotFound:
        raise StoreError(f"AWS profile '{cfg.profile}' not found; fix store.profile / AWS_PROFILE or add it to "
                         "~/.aws/config") from None
    region = cfg.region or session.region_name or "us-east-1"
    client = session.client("s3", endpoint_url=endpoint, config=_client_config(region, endpoint, cfg.concurrency))
    _remember_credentials(session)

    def make_probe() -> Any:
        return session.client("s3", endpoint_url=endpoint,
                              config=_client_config(region, endpoint, cfg.concurrency, probe=True))

    return Connection(client=client, endpoint=endpoint, part_size=cfg.part_size_mib * MIB, concurrency=cfg.concurrency,
                      make_probe=make_probe)


def _remember_credentials(session: Session) -> None:
    """Make the secret key and session token this client signs with known to `redact`, wherever they came from (a
    profile, a credentials file). The client resolved them already; a failure here is the real request's to report."""
    try:
        credentials = session.get_credentials()
        frozen = credentials.get_frozen_credentials() if credentials is not None else None
    except Exception:
        return
    if frozen is not None:
        remember_secret(frozen.secret_key)
        remember_secret(frozen.token)


_PERMISSIONS = (
    (("writing", "uploading", "starting an upload", "completing", "deleting", "aborting"), "write"),
    (("reading", "downloading"), "read"),
    (("listing",), "list"),
)


def _describe_client_error(exc: bex.ClientError, url: str, where: str, action: str) -> StoreError:
    err = exc.response.get("Error", {})
    code = str(err.get("Code", "")) or "?"
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    bucket = parse_s3_url(url)[0]
    if code == "SignatureDoesNotMatch":
        return StoreError(f"wrong secret key: {where} rejected the request signature for {url}; fix "
                          "AWS_SECRET_ACCESS_KEY or the profile's secret")
    if code in ("InvalidAccessKeyId", "InvalidClientTokenId", "ExpiredToken", "InvalidToken"):
        return StoreError(f"{where} does not accept this access key ({code}) for {url}; fix AWS_ACCESS_KEY_ID / the "
                          "profile, or refresh the session token")
    if code == "NoSuchBucket":
        return StoreError(f"no such bucket '{bucket}' at {where}; create it or fix the URL {url}")
    if code == "AccessDenied" or (status == 403 and code in ("403", "Forbidden")):
        perm = next((p for verbs, p in _PERMISSIONS if action.startswith(verbs)), "the needed")
        return StoreError(f"access denied: no {perm} permission on {url} for these credentials (while {action}); use "
                          f"an identity allowed to {perm} there")
    if code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"):
        return StoreError(f"{where} rejected the bytes of {url} while {action}: checksum mismatch in transit ({code}); "
                          "retry")
    if code == "InternalError" and action in ("downloading", "reading"):
        return StoreError(f"{where} could not read its stored copy of {url} (InternalError) while {action}: "
                          f"{SERVER_COPY_DAMAGED}")
    message = redact(str(err.get("Message", "")))[:200]  # the server's words: redacted before they are cut and kept
    return StoreError(f"S3 error while {action} {url}: {code} {message}".rstrip())


SERVER_COPY_DAMAGED = (
    "when a rerun fails at the same object, the server's copy is damaged (bit rot on its disk, which it found by its "
    "own checksum): check the server's volumes and logs, then push the artifact again from a verified copy"
)


def probe_failed(exc: BaseException, url: str, endpoint: str | None, action: str) -> StoreError:
    """The line for a probe request that got no answer: the endpoint, how long it was given, and the fix."""
    where = safe_url(endpoint) if endpoint else "the AWS default endpoint"
    if isinstance(exc, bex.ReadTimeoutError):
        return StoreError(
            f"S3 endpoint {where} accepts connections but did not answer within {PROBE_READ_TIMEOUT_S} s "
            f"({PROBE_ATTEMPTS} tries) while {action} {url}; check that store.endpoint_url / AWS_ENDPOINT_URL names a "
            "running S3 server, then rerun"
        )
    return describe_error(exc, url, endpoint, action) or StoreError(f"S3 endpoint {where} failed while {action} {url}: "
                                                                    f"{type(exc).__name__}")


def describe_error(exc: BaseException, url: str, endpoint: str | None, action: str) -> StoreError | None:
    """One line naming the cause and the fix for a boto3/botocore failure, or None for a non-S3 error.

    Every line names the full s3:// URL of the object or prefix the request was about, the endpoint and the server's
    error code, never a credential value: the server's own words are redacted.
    """
    where = safe_url(endpoint) if endpoint else "the AWS default endpoint"
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return StoreError(
            f"no AWS credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / "
            "store.profile naming a profile in ~/.aws/credentials"
        )
    if isinstance(exc, bex.ReadTimeoutError):
        return StoreError(f"S3 endpoint {where} stopped answering while {action} {url} (read timeout); retry, or check "
                          "the server")
    if isinstance(exc,
                  (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ConnectionClosedError,
                   bex.HTTPClientError)):
        return StoreError(
            f"S3 endpoint {where} unreachable or connection lost while {action} {url} ({type(exc).__name__}); "
            "check store.endpoint_url / AWS_ENDPOINT_URL and that the server runs, then rerun (verified files are kept)"
        )
    if isinstance(exc, bex.ClientError):
        return _describe_client_error(exc, url, where, action)
    if isinstance(exc, bex.BotoCoreError):
        return StoreError(redact(f"S3 client error while {action} {url}: {type(exc).__name__}: {exc}"))
    return None


def is_not_found(exc: BaseException) -> bool:
    return _code(exc) in ("404", "NoSuchKey", "NotFound")


def is_precondition_failed(exc: BaseException) -> bool:
    """A conditional write (If-Match / If-None-Match) the server refused: the key no longer holds what the writer
    saw."""
    return _code(exc) in ("PreconditionFailed", "412")


def _code(exc: BaseException) -> str:
    """The S3 error code of a client error ('' for any other failure)."""
    return str(exc.response.get("Error", {}).get("Code", "")) if isinstance(exc, bex.ClientError) else ""


@dataclass(frozen=True)
class S3Location:
    """One `bucket` and key `prefix` ('' or ending in '/') on a connection: maps store keys to object keys and runs
    client calls there, each failure turned into FileNotFoundError (absent) or one StoreError line."""

    bucket: str
    prefix: str
    conn: Connection

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, key: str) -> str:
        return self.prefix + key

    @contextmanager
    def errors(self, action: str, key: str) -> Iterator[None]:
        """Turn S3 failures into FileNotFoundError (absent) or one StoreError line; others pass through.

        The first use of a connection probes the endpoint first (`Connection.reach`)."""
        self.conn.reach(self.bucket, self.url + key, action)
        try:
            yield
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(f"{self.url}{key} absent") from None
            if is_precondition_failed(exc):  # a conditional write (`Store.put_file(over=...)`) refused
                raise StoreError(f"{self.url}{key} changed at the destination while this run was writing it (another "
                                 "writer); nothing was replaced") from None
            if self.conn.is_probe and isinstance(exc, (bex.ConnectionError, bex.HTTPClientError)):
                raise probe_failed(exc, self.url + key, self.conn.endpoint, action) from None
            err = describe_error(exc, self.url + key, self.conn.endpoint, action)
            if err is None:
                raise
            raise err from None
        self.conn.answered()

    def call(self, action: str, key: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """`fn(Bucket=bucket, **kwargs)` (a client method), its failures described as `action` on `key`."""
        with self.errors(action, key):
            return fn(Bucket=self.bucket, **kwargs)
