"""The S3 store: `s3://bucket/prefix` on AWS or any S3-compatible server, through boto3's classic client.

Data path: our own part scheduler over the plain boto3 client (not the CRT transfer client, which fails on IP
endpoints). Each part is read once; its CRC64NVME is computed on the bytes in memory, sent with the part so the
server rejects corruption, and folded (crc combine) into the full-object checksum, which goes with the upload too
(single PUT or CompleteMultipartUpload, ChecksumType FULL_OBJECT). Downloads stream ranged GETs into a
preallocated temp file and fold the part checksums the same way, so no file is read twice.
Memory: at most `concurrency` parts of `part_size` bytes in flight, shared by every file of the store.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from awscrt import checksums

from blockdraft.errors import StoreError
from blockdraft.store.base import ObjectInfo, Store

MIB = 1024 * 1024
STREAM_CHUNK = 1 * MIB
TMP_PREFIX = ".tmp-"
T = TypeVar("T")


def _b64(crc: int) -> str:
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
class _Connection:
    """What every store under one URL shares: the client, the endpoint, and the bounded part pool."""

    client: Any
    endpoint: str | None
    part_size: int
    concurrency: int
    _pool: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-part")
            return self._pool


@functools.cache
def _shared_loader() -> Any:
    """One botocore data loader per process: the S3 service model is parsed once, not per store (~150 ms each)."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def _make_connection(settings: object | None) -> _Connection:
    import boto3
    import botocore.exceptions
    import botocore.session
    from botocore.config import Config

    endpoint = resolve_endpoint(getattr(settings, "endpoint_url", None))
    profile = getattr(settings, "profile", None)
    part_size = int(getattr(settings, "part_size_mib", 64)) * MIB
    concurrency = int(getattr(settings, "concurrency", 8))
    core = botocore.session.get_session()
    core.register_component("data_loader", _shared_loader())
    try:
        session = boto3.session.Session(botocore_session=core, profile_name=profile)
    except botocore.exceptions.ProfileNotFound:
        raise StoreError(f"AWS profile '{profile}' not found; fix store.profile / AWS_PROFILE or add it to ~/.aws/config") from None
    region = getattr(settings, "region", None) or session.region_name or "us-east-1"
    config = Config(
        region_name=region,
        signature_version="s3v4",
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=5,
        read_timeout=120,
        max_pool_connections=2 * concurrency + 4,
        # We always send our own CRC64NVME; botocore must not add a second checksum or validate ranged parts.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # The body is covered by the signed x-amz-checksum header, which the server checks: hashing it again
        # with SHA-256 for the signature would only cost a core over plain-HTTP endpoints.
        s3={"addressing_style": "path" if endpoint else "auto", "payload_signing_enabled": False},
    )
    client = session.client("s3", endpoint_url=endpoint, config=config)
    return _Connection(client=client, endpoint=endpoint, part_size=part_size, concurrency=concurrency)


_PERMISSIONS = (
    (("writing", "uploading", "starting an upload", "completing", "deleting", "aborting"), "write"),
    (("reading", "downloading"), "read"),
    (("listing",), "list"),
)


def describe_error(exc: BaseException, url: str, endpoint: str | None, action: str) -> StoreError | None:
    """One line naming the cause and the fix for a boto3/botocore failure, or None for a non-S3 error.

    Messages carry the URL, the endpoint and the server's error code, never a credential value.
    """
    import botocore.exceptions as bex

    where = endpoint or "the AWS default endpoint"
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return StoreError(
            f"no AWS credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / store.profile "
            "naming a profile in ~/.aws/credentials"
        )
    if isinstance(exc, bex.ReadTimeoutError):
        return StoreError(f"S3 endpoint {where} stopped answering while {action} (read timeout); retry, or check the server")
    if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ConnectionClosedError, bex.HTTPClientError)):
        return StoreError(
            f"S3 endpoint {where} unreachable or connection lost while {action} ({type(exc).__name__}); "
            "check store.endpoint_url / AWS_ENDPOINT_URL and that the server runs, then rerun (verified files are kept)"
        )
    if isinstance(exc, bex.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "")) or "?"
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        bucket = parse_s3_url(url)[0]
        if code == "SignatureDoesNotMatch":
            return StoreError(f"wrong secret key: {where} rejected the request signature for {url}; fix AWS_SECRET_ACCESS_KEY or the profile's secret")
        if code in ("InvalidAccessKeyId", "InvalidClientTokenId", "ExpiredToken", "InvalidToken"):
            return StoreError(f"{where} does not accept this access key ({code}) for {url}; fix AWS_ACCESS_KEY_ID / the profile, or refresh the session token")
        if code == "NoSuchBucket":
            return StoreError(f"no such bucket '{bucket}' at {where}; create it or fix the URL {url}")
        if code == "AccessDenied" or (status == 403 and code in ("403", "Forbidden")):
            perm = next((p for verbs, p in _PERMISSIONS if action.startswith(verbs)), "the needed")
            return StoreError(f"access denied: no {perm} permission on {url} for these credentials (while {action}); use an identity allowed to {perm} there")
        if code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"):
            return StoreError(f"{where} rejected the bytes of {url} while {action}: checksum mismatch in transit ({code}); retry")
        message = str(err.get("Message", ""))[:200]
        return StoreError(f"S3 error while {action} {url}: {code} {message}".rstrip())
    if isinstance(exc, bex.BotoCoreError):
        return StoreError(f"S3 client error while {action} {url}: {type(exc).__name__}: {exc}")
    return None


def _is_not_found(exc: BaseException) -> bool:
    import botocore.exceptions as bex

    if not isinstance(exc, bex.ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3Store(Store):
    def __init__(self, bucket: str, prefix: str, conn: _Connection) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.conn = conn
        self.url = f"s3://{bucket}/{prefix}"

    @classmethod
    def from_url(cls, url: str, settings: object | None = None) -> S3Store:
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, _make_connection(settings))

    @property
    def endpoint(self) -> str | None:
        return self.conn.endpoint

    def child(self, key_prefix: str) -> S3Store:
        prefix = (self.prefix + key_prefix.strip("/") + "/") if key_prefix.strip("/") else self.prefix
        return S3Store(self.bucket, prefix, self.conn)

    def _key(self, key: str) -> str:
        return self.prefix + key

    @contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        """Turn S3 failures into FileNotFoundError (absent) or one StoreError line; others pass through."""
        try:
            yield
        except Exception as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(f"{self.url}{key} absent") from None
            err = describe_error(exc, self.url + key, self.endpoint, action)
            if err is None:
                raise
            raise err from None

    def _call(self, action: str, key: str, fn: Callable[..., T], **kwargs: Any) -> T:
        with self._errors(action, key):
            return fn(Bucket=self.bucket, **kwargs)

    # ---- metadata ----

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        pages = self.conn.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        with self._errors("listing", prefix):
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self.prefix) :]
                    yield ObjectInfo(key=rel, size=obj["Size"], etag=obj.get("ETag"))

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._call("reading metadata of", key, self.conn.client.head_object, Key=self._key(key), ChecksumMode="ENABLED")
        except FileNotFoundError:
            return None
        # Only a FULL_OBJECT CRC64NVME is comparable with a manifest; any other checksum proves nothing here.
        return ObjectInfo(key=key, size=resp["ContentLength"], checksum=resp.get("ChecksumCRC64NVME"), etag=resp.get("ETag"))

    def open_read(self, key: str) -> BinaryIO:
        """A buffered, seekable stream of the object (Parquet needs seeks); sequential reads are one streaming GET."""
        info = self._call("reading metadata of", key, self.conn.client.head_object, Key=self._key(key))
        return io.BufferedReader(_ObjectReader(self, key, info["ContentLength"], info.get("ETag")), buffer_size=STREAM_CHUNK)

    def read_bytes(self, key: str) -> bytes:
        resp = self._call("reading", key, self.conn.client.get_object, Key=self._key(key))
        with self._errors("reading", key), resp["Body"] as body:
            return body.read()

    def delete(self, key: str) -> None:
        self._call("deleting", key, self.conn.client.delete_object, Key=self._key(key))

    def abort_partial_uploads(self) -> int:
        """Abort every unfinished multipart upload under this prefix (their parts cost storage and prove nothing)."""
        client = self.conn.client
        aborted = 0
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix)
        with self._errors("aborting unfinished uploads under", ""):
            for page in pages:
                for up in page.get("Uploads", []):
                    client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted += 1
        return aborted

    # ---- writes ----

    def put_bytes(self, key: str, data: bytes) -> None:
        crc = _b64(checksums.crc64nvme(data))
        self._call("writing", key, self.conn.client.put_object, Key=self._key(key), Body=data, ChecksumCRC64NVME=crc)

    def put_file(self, key: str, local_path: Path, checksum: str | None = None) -> None:
        """Upload in parts on the shared pool; the object appears only when whole and server-checked.

        Raises StoreError when the bytes read differ from `checksum` (the local file changed or rotted):
        the upload is then not completed.
        """
        size = os.path.getsize(local_path)
        if size <= self.conn.part_size:
            self.conn.pool.submit(self._put_single, key, Path(local_path), size, checksum).result()
        else:
            self._put_multipart(key, Path(local_path), size, checksum)

    def _put_single(self, key: str, path: Path, size: int, expected: str | None) -> None:
        with open(path, "rb") as f:
            data = f.read()
        crc = _b64(checksums.crc64nvme(data))
        if len(data) != size or (expected is not None and crc != expected):
            raise StoreError(f"local file {path.name} does not match its expected checksum (crc64nvme {crc} != {expected}); the local artifact is corrupt")
        self._call("uploading", key, self.conn.client.put_object, Key=self._key(key), Body=data, ChecksumCRC64NVME=crc)

    def _put_part(self, key: str, upload_id: str, number: int, fd: int, offset: int, length: int) -> tuple[int, dict]:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise StoreError(f"local file for {key} shrank while uploading; rerun the push")
        crc = checksums.crc64nvme(data)
        resp = self._call(
            "uploading a part of",
            key,
            self.conn.client.upload_part,
            Key=self._key(key),
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ChecksumCRC64NVME=_b64(crc),
        )
        return crc, {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC64NVME": _b64(crc)}

    def _put_multipart(self, key: str, path: Path, size: int, expected: str | None) -> None:
        client = self.conn.client
        created = self._call(
            "starting an upload of", key, client.create_multipart_upload, Key=self._key(key), ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
        )
        upload_id = created["UploadId"]
        part_size = self.conn.part_size
        fd = os.open(path, os.O_RDONLY)
        futures: list[Future] = []
        try:
            for number, offset in enumerate(range(0, size, part_size), start=1):
                futures.append(self.conn.pool.submit(self._put_part, key, upload_id, number, fd, offset, min(part_size, size - offset)))
            results = [f.result() for f in futures]
            full = 0
            for (crc, _), offset in zip(results, range(0, size, part_size)):
                full = crc if offset == 0 else checksums.combine_crc64nvme(full, crc, min(part_size, size - offset))
            if expected is not None and _b64(full) != expected:
                raise StoreError(f"local file {path.name} does not match its expected checksum (crc64nvme {_b64(full)} != {expected}); the local artifact is corrupt")
            self._call(
                "completing the upload of",
                key,
                client.complete_multipart_upload,
                Key=self._key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": [part for _, part in results]},
                ChecksumCRC64NVME=_b64(full),
                ChecksumType="FULL_OBJECT",
            )
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
            except Exception:  # the server may be gone; a later push aborts leftovers (abort_partial_uploads)
                pass
            raise
        finally:
            os.close(fd)

    # ---- downloads ----

    def get_file(self, key: str, local_path: Path) -> tuple[int, str]:
        """Ranged GETs on the shared pool, written at their offsets into a temp file renamed when whole.

        Returns (size, base64 CRC64NVME) of the bytes received. If-Match pins every range to the same object
        version. No preallocation: writing into fallocated (unwritten) ext4 extents measured 2-3x slower here;
        `pull` checks free space before it starts instead.
        """
        info = self._call("reading metadata of", key, self.conn.client.head_object, Key=self._key(key))
        size, etag = info["ContentLength"], info.get("ETag")
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.parent / f"{TMP_PREFIX}{local_path.name}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        part_size = self.conn.part_size
        try:
            ranges = [(off, min(part_size, size - off)) for off in range(0, size, part_size)]
            futures = [self.conn.pool.submit(self._get_range, key, etag, fd, off, length) for off, length in ranges]
            try:
                crcs = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
            full = 0
            for crc, (off, length) in zip(crcs, ranges):
                full = crc if off == 0 else checksums.combine_crc64nvme(full, crc, length)
            os.close(fd)
            fd = -1
            # No fsync: a crash can leave the page cache unwritten, but every reader verifies checksums, so
            # such a file shows as corrupt, never as verified.
            os.replace(tmp, local_path)
            return size, _b64(full)
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)

    def _get_range(self, key: str, etag: str | None, fd: int, offset: int, length: int) -> int:
        extra = {"IfMatch": etag} if etag else {}
        resp = self._call(
            "downloading", key, self.conn.client.get_object, Key=self._key(key), Range=f"bytes={offset}-{offset + length - 1}", **extra
        )
        crc = 0
        pos = offset
        with self._errors("downloading", key), resp["Body"] as body:
            while chunk := body.read(STREAM_CHUNK):
                crc = checksums.crc64nvme(chunk, crc)
                os.pwrite(fd, chunk, pos)
                pos += len(chunk)
        if pos - offset != length:
            raise StoreError(f"short read downloading {self.url}{key}: {pos - offset} of {length} bytes at offset {offset}; retry the pull")
        return crc


class _ObjectReader(io.RawIOBase):
    """Reads one S3 object from a position: a streaming GET of `bytes=pos-`, reopened only after a seek.

    If-Match pins every GET to the version first seen, so a concurrent overwrite fails loudly instead of mixing.
    """

    def __init__(self, store: S3Store, key: str, size: int, etag: str | None) -> None:
        self._store, self._key, self._size, self._etag = store, key, size, etag
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self._size + offset}[whence]
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target != self._pos:
            self._drop()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size or len(buffer) == 0:
            return 0
        if self._body is None:
            extra = {"IfMatch": self._etag} if self._etag else {}
            store = self._store
            resp = store._call("reading", self._key, store.conn.client.get_object, Key=store._key(self._key), Range=f"bytes={self._pos}-", **extra)
            self._body = resp["Body"]
        with self._store._errors("reading", self._key):
            data = self._body.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self._pos += n
        return n

    def _drop(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop()
        super().close()
