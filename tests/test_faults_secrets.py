"""Two promises under faults: a server that echoes the key it was sent (whole, base64-encoded or cut) never gets that
key into an artifact, a message or a log, nor does a password or token inside a URL (base URL, S3 endpoint, store URL);
an S3 endpoint that accepts connections and never answers fails a command with one line, through the probe
client's short timeouts, while transfers keep their long ones.

Nothing here reads a clock: the stall is bounded by the probe client's configured timeouts and attempts, which are
asserted; the end-to-end runs against a loopback socket that accepts and never answers only check the outcome."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import botocore.exceptions as bex
import pytest
import zstandard
from helpers.artifacts import commit_files
from helpers.chat_server import ChatServer

from blockdraft.config import StoreConfig
from blockdraft.data.chat import Completion, Prompt
from blockdraft.errors import REDACTED, redact, redact_setting, remember_secret, safe_url
from blockdraft.stages.export import serving_settings
from blockdraft.stages.generate import FAILURES_NAME
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.lease import Lease
from blockdraft.store.preflight import PROBE_PREFIX, preflight, probing
from blockdraft.store.s3 import S3Store
from blockdraft.store.s3_client import (
    PROBE_ATTEMPTS,
    PROBE_CONNECT_TIMEOUT_S,
    PROBE_READ_TIMEOUT_S,
    TRANSFER_ATTEMPTS,
    TRANSFER_READ_TIMEOUT_S,
    describe_error,
)

CLI = str(Path(sys.executable).parent / "blockdraft")
KEY_ENV = "BD_TEST_ENDPOINT_KEY"  # not a variable `redact` knows by name: the engine must hand its key over


class NeverServes:
    """The chat behind an endpoint that refuses every key it is sent: no request ever reaches it."""

    name = "echo-model"

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float) -> Completion:
        raise AssertionError("a refused request reached the model")


def fresh_key() -> str:
    """A key shaped like no known pattern (no `sk-`, no bearer), so only the configured-key redaction can catch it."""
    return f"bd{uuid.uuid4().hex}{uuid.uuid4().hex[:8]}"


def write_prompts(path: Path, n: int) -> None:
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i}."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def texts_of_folder(root: Path) -> dict[str, bytes]:
    """Every file under `root` as bytes, each zstd shard also decompressed."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found[str(path.relative_to(root))] = data
        if path.name.endswith(".zst"):
            found[f"{path.relative_to(root)} (decompressed)"] = (
                zstandard.ZstdDecompressor().decompressobj().decompress(data)
            )
    return found


def leaks(texts: dict[str, bytes], key: str) -> list[str]:
    """The names of the texts holding the key: whole, by its first 8 characters, or base64-encoded (by its first 8)."""
    forms = [key[:8].encode(), base64.b64encode(key.encode())[:8]]
    return [name for name, data in texts.items() if any(form in data for form in forms)]


def s3_store(url: str, settings: StoreConfig | None = None) -> S3Store:
    store = open_store(url, settings)
    assert isinstance(store, S3Store)
    return store


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=300)


# ---- secrets from servers ----


@pytest.mark.fault
@pytest.mark.parametrize("where", ["folder", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_server_echoing_the_key_leaves_it_in_no_artifact_message_or_log(where, tmp_path, request):
    key = fresh_key()
    write_prompts(tmp_path / "prompts.jsonl", 3)
    config = tmp_path / "c.toml"
    config.write_text(f'[generate]\napi_key_env = "{KEY_ENV}"\nmax_retries = 0\n')
    if where == "s3":
        server = request.getfixturevalue("s3_env")
        bucket = server.new_bucket()
        outputs = [f"s3://{bucket}/out", f"s3://{bucket}/out2"]
    else:
        outputs = [str(tmp_path / "out"), str(tmp_path / "out2")]

    with ChatServer(NeverServes(), api_key="the-key-the-server-wants") as endpoint:
        # The endpoint does echo what it was sent: without redaction the key would be kept.
        sent = urllib.request.Request(endpoint.url + "/models", headers={"Authorization": f"Bearer {key}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(sent, timeout=30)
        assert key in refused.value.read().decode()

        common = ["--config", str(config), "--engine", "openai", "--base-url", endpoint.url]
        failed = run_cli(
            ["generate", str(tmp_path / "prompts.jsonl"), outputs[0], *common, "--model", NeverServes.name],
            {KEY_ENV: key},
        )
        # No model configured: the served name is asked first, and that refusal is the command's one-line error.
        unasked = run_cli(["generate", str(tmp_path / "prompts.jsonl"), outputs[1], *common], {KEY_ENV: key})

    # The leak check first, and messages of the later checks redacted: a failing test must not print the key either.
    logs = {f"{name} {stream}": getattr(proc, stream).encode()
            for name, proc in (("failed", failed), ("unasked", unasked)) for stream in ("stdout", "stderr")}
    stored = texts_of_folder(tmp_path)  # the outputs, any staging left behind, the config and the prompts
    if where == "s3":
        raw = server.client()
        keys = [o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", [])]
        stored |= {k: raw.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
        assert any(k.endswith(FAILURES_NAME) for k in keys)
    assert leaks(stored, key) == [] and leaks(logs, key) == []

    assert failed.returncode == 1, redact(failed.stderr, key)
    assert (unasked.returncode == 2 and "cannot ask" in unasked.stderr
            and REDACTED in unasked.stderr), redact(unasked.stderr, key)
    out = open_store(outputs[0])
    assert verify_artifact(out).state is State.VERIFIED
    failures = [json.loads(x) for x in out.read_bytes(FAILURES_NAME).decode().splitlines()]
    assert [f["reason"] for f in failures] == ["http_401"] * 3
    assert all(f"Incorrect API key provided: {REDACTED}" in f["detail"] for f in failures)


@pytest.mark.fault
@pytest.mark.parametrize("echo", ["base64", "first10"])
def test_a_server_echoing_the_key_base64_encoded_or_cut_leaves_it_nowhere(echo, tmp_path):
    """Words that match no credential shape ("Credential Ymd... is not on file"): only the client's own key, in every
    form a server may give it back, can be caught."""
    key = fresh_key()
    write_prompts(tmp_path / "prompts.jsonl", 2)
    config = tmp_path / "c.toml"
    config.write_text(f'[generate]\napi_key_env = "{KEY_ENV}"\nmax_retries = 0\n')
    with ChatServer(NeverServes(), api_key="the-key-the-server-wants", echo=echo) as endpoint:
        common = ["--config", str(config), "--engine", "openai", "--base-url", endpoint.url]
        failed = run_cli(
            ["generate", str(tmp_path / "prompts.jsonl"), str(tmp_path / "out"), *common, "--model", NeverServes.name],
            {KEY_ENV: key},
        )
        unasked = run_cli(["generate", str(tmp_path / "prompts.jsonl"), str(tmp_path / "out2"), *common],
                          {KEY_ENV: key})

    logs = {f"{name} {stream}": getattr(proc, stream).encode()
            for name, proc in (("failed", failed), ("unasked", unasked)) for stream in ("stdout", "stderr")}
    assert leaks(texts_of_folder(tmp_path), key) == [] and leaks(logs, key) == []
    said = {"base64": f"Credential {REDACTED} is not on file",
            "first10": f"Credential starting {REDACTED} is not on file"}[echo]
    assert failed.returncode == 1, redact(failed.stderr, key)
    assert unasked.returncode == 2 and said in unasked.stderr, redact(unasked.stderr, key)
    failures = [json.loads(x) for x in (tmp_path / "out" / FAILURES_NAME).read_text().splitlines()]
    assert [f["reason"] for f in failures] == ["http_401"] * 2
    assert all(said in f["detail"] for f in failures)


def test_redact_removes_known_secrets_in_any_form_and_credential_shapes(monkeypatch):
    key = fresh_key()
    remember_secret(key)
    # Known secrets: remembered, passed, or in the environment, whole, escaped, or cut by the server.
    assert redact(f"bad key {key}!") == f"bad key {REDACTED}!"
    assert key[:20] not in redact(f"bad key {key[:20]}")
    other = fresh_key() + "/+x"
    assert redact(f"a={other}", other) == f"a={REDACTED}"
    assert redact(f"a={other.replace('/', '%2F').replace('+', '%2B')}", other) == f"a={REDACTED}"
    aws_secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzzzzzzzzz"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_secret)
    assert aws_secret not in redact(json.dumps({"message": f"wrong {aws_secret}"}))
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # Shapes, whatever the value.
    shaped = [
        ("Incorrect API key provided: sk-proj-abcDEF123456789", "sk-proj-abcDEF123456789"),
        ("rejected: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc", "eyJhbGciOiJIUzI1NiJ9"),
        ("header Authorization: Basic dXNlcjpwYXNzd29yZA== was refused", "dXNlcjpwYXNzd29yZA"),
        ('{"authorization": "Token 0123456789abcdef"}', "0123456789abcdef"),
        ("aws_secret_access_key=AbCdEfGhIjKlMnOpQrStUvWxYz0123456789/+Ab is wrong",
         "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789/+Ab"),
        ("the api_key = 'abc123xyz789' is unknown", "abc123xyz789"),
    ]
    for text, secret in shaped:
        assert secret not in redact(text) and REDACTED in redact(text), text
    # Ordinary server messages stay readable; short values ("EMPTY") are no secret.
    plain = "HTTP 503: the server is overloaded, retry later (model echo-model, 12 requests queued)"
    assert redact(plain) == plain and redact("EMPTY key", "EMPTY") == "EMPTY key"


def test_redact_removes_a_known_key_base64_encoded_or_cut_after_8_characters():
    key = fresh_key() + "+/x"
    remember_secret(key)
    encoded = base64.b64encode(key.encode()).decode()
    for text in (f"credential {encoded} unknown", f"credential {encoded.rstrip('=')} unknown",
                 f"credential {encoded.replace('+', '-').replace('/', '_')} unknown",
                 f"credential {encoded[:10]}... unknown",
                 f"credential {key[:10]}... unknown", f"credential {key[:8]} unknown"):
        assert redact(text) == f"credential {REDACTED} unknown", text
    assert redact(f"credential {key[:7]} unknown") == f"credential {key[:7]} unknown"  # 7 characters name no key


def test_urls_lose_userinfo_and_query_when_stored_or_printed():
    assert safe_url("http://alice:PASSWORD@host:8000/v1?token=X#top") == "http://host:8000/v1"
    assert safe_url("https://alice:p?ss#w@host/v1") == "https://host/v1"  # a password may hold "?" or "#"
    for kept in ("s3://bucket/runs/tokenized", "file:///data/store", "/data/a?b", "http://127.0.0.1:8000/v1",
                 "hub/model@rev"):
        assert safe_url(kept) == kept
    text = "cannot reach http://alice:PASSWORD@host/v1: refused; see https://h/x?token=TOKEN123 and s3://b/p"
    assert redact(text) == "cannot reach http://host/v1: refused; see https://h/x and s3://b/p"
    # What an export stores for serving names its S3 endpoint without the password.
    settings = serving_settings("s3://b/export", 4, endpoint_url="http://alice:PASSWORD@127.0.0.1:8333")
    assert "PASSWORD" not in json.dumps(settings) and "--endpoint-url http://127.0.0.1:8333" in settings["pull_command"]


@pytest.mark.fault
@pytest.mark.parametrize(("where", "shape"),
                         [("folder", "userinfo"), ("folder", "query"),
                          pytest.param("s3", "userinfo", marks=pytest.mark.s3)])
def test_credentials_inside_urls_reach_no_artifact_message_or_log(where, shape, tmp_path, request):
    """`--base-url http://alice:PASSWORD@host/v1` (urllib cannot connect with it: every prompt fails, and says where) or
    `...?token=X` (sent as given; the server names its unknown path, token and all), and on S3 a `store.endpoint_url`
    with userinfo (boto3 connects with it): none of these secrets is stored or printed."""
    secret = fresh_key()
    write_prompts(tmp_path / "prompts.jsonl", 2)
    config = tmp_path / "c.toml"
    config.write_text('[generate]\nmax_retries = 0\nservers_down_timeout_s = 1\ntimeout_s = 5\n')
    env = {}
    if where == "s3":
        server = request.getfixturevalue("s3_env")
        bucket = server.new_bucket()
        output = f"s3://{bucket}/out"
        endpoint = server.endpoint.replace("http://", f"http://alice:{secret}@")
        config.write_text(f'[generate]\nmax_retries = 0\nservers_down_timeout_s = 1\ntimeout_s = 5\n[store]\n'
                          f'endpoint_url = "{endpoint}"\n')
        config_text = config.read_text()
    else:
        output = str(tmp_path / "out")
    with ChatServer(NeverServes()) as endpoint:
        host = endpoint.url.removeprefix("http://")
        base_url = f"http://alice:{secret}@{host}" if shape == "userinfo" else f"{endpoint.url}?token={secret}"
        proc = run_cli(["generate", str(tmp_path / "prompts.jsonl"), output, "--config", str(config), "--engine",
                        "openai", "--base-url", base_url, "--model", NeverServes.name], env)

    stored = texts_of_folder(tmp_path)
    stored.pop("c.toml")  # the user's own config names the secret
    if where == "s3":
        raw = server.client()
        stored |= {k: raw.get_object(Bucket=bucket, Key=k)["Body"].read()
                   for k in [o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", [])]}
        assert secret in config_text
    logs = {"stdout": proc.stdout.encode(), "stderr": proc.stderr.encode()}
    assert leaks(stored, secret) == [] and leaks(logs, secret) == []
    assert proc.returncode == 1, redact(proc.stderr, secret)
    out = open_store(output)
    assert verify_artifact(out).state is State.VERIFIED
    manifest = json.loads(out.read_bytes(MANIFEST_NAME))
    # Pinned with the credential's fingerprint in its place (`redact_settings`), scheme, host and path kept.
    [pinned] = manifest["config"]["generate"]["base_url"]
    assert pinned == redact_setting(base_url) and "[redacted:" in pinned and safe_url(pinned) == endpoint.url
    if where == "s3":
        pinned = manifest["config"]["store"]["endpoint_url"]
        assert "[redacted:" in pinned and safe_url(pinned) == server.endpoint
    details = [json.loads(x)["detail"] for x in out.read_bytes(FAILURES_NAME).decode().splitlines()]
    expected = (f"cannot reach {endpoint.url}" if shape == "userinfo"
                else f"no route /v1/chat/completions?token={REDACTED}")
    assert len(details) == 2 and all(expected in d for d in details), details


@pytest.mark.fault
def test_an_s3_store_url_with_a_token_is_refused_in_one_line_naming_no_token(tmp_path):
    """An s3:// URL takes no query string or userinfo (S3 credentials come from the AWS chain): a token there would be
    recorded in leases, lineage and messages, and would name another prefix. Refused before any request."""
    token = fresh_key()
    refused = run_cli(["pull", f"s3://bucket/runs?token={token}", str(tmp_path / "dl")], aws_env(tmp_path))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and token[:8] not in refused.stderr, refused.stderr
    assert "store URL 's3://bucket/runs' carries a query string or user info" in lines[0]
    assert not (tmp_path / "dl").exists()


@pytest.mark.fault
def test_a_lease_records_its_command_line_without_the_token_of_a_url(tmp_path, monkeypatch):
    """A writer's lease names its command line; a token in a URL there is left out, both in the lease file and in the
    line another process gets ("being written by ...")."""
    token = fresh_key()
    commit_files(tmp_path / "src", {"data.arrow": b"rows"}, kind="tokenized")
    dest = tmp_path / "dest"
    dest.mkdir()
    monkeypatch.setattr(sys, "argv", ["blockdraft", "pull", f"file://{tmp_path}/src?token={token}", str(dest)])
    with Lease(open_store(dest)):
        recorded = (dest / LEASE_NAME).read_text()
        assert f"blockdraft pull file://{tmp_path}/src" in json.loads(recorded)["command"]
        other = run_cli(["pull", f"file://{tmp_path}/src", str(dest)], {})
    assert token[:8] not in recorded and token[:8] not in other.stderr + other.stdout, (recorded, other.stderr)
    assert other.returncode == 2 and "is being written by pid" in other.stderr, other.stderr


def test_s3_server_messages_are_redacted_including_the_secret_of_a_profile(tmp_path, monkeypatch):
    """The generic S3 error line keeps the server's message: a secret in it, from the environment or from the profile
    the client was built with, is redacted."""
    env_secret, profile_secret = (f"{uuid.uuid4().hex}{uuid.uuid4().hex[:8]}" for _ in range(2))
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[echo]\naws_access_key_id = AKIDECHO\naws_secret_access_key = {profile_secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    open_store("s3://b/p", StoreConfig(profile="echo", endpoint_url="http://127.0.0.1:9"))  # builds the client only
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_secret)
    for secret in (env_secret, profile_secret):
        echoed = bex.ClientError({"Error": {"Code": "InternalError", "Message": f"cannot verify {secret} now"}},
                                 "PutObject")
        line = str(describe_error(echoed, "s3://b/p/k", "http://127.0.0.1:9", "writing"))
        assert secret not in line and line == ("S3 error while writing s3://b/p/k: InternalError cannot verify "
                                               f"{REDACTED} now")


# ---- stalled endpoints ----


class StalledEndpoint:
    """A loopback TCP server that accepts every connection and never answers; closed (with its connections) on exit."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            self.held.append(conn)

    def __enter__(self) -> StalledEndpoint:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # close() alone does not wake an accept() blocked in another thread (the join would wait out its timeout);
        # shutdown() does, so the accepting thread ends at once.
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=30)
        for conn in self.held:
            conn.close()


def aws_env(tmp_path: Path) -> dict[str, str]:
    """Credentials that sign requests (the stalled endpoint never checks them), and nothing of the machine's AWS
    setup."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_ACCESS_KEY_ID": "AKIDSTALL", "AWS_SECRET_ACCESS_KEY": "stall-secret-never-checked",
            "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"), "AWS_EC2_METADATA_DISABLED": "true"}


def test_probe_timeouts_bound_a_stall_and_transfers_keep_theirs():
    store = s3_store("s3://b/x", StoreConfig(endpoint_url="http://127.0.0.1:9"))
    conn = store.at.conn
    probe, transfer = conn.probe_client.meta.config, conn.client.meta.config
    assert (probe.connect_timeout, probe.read_timeout, probe.retries["total_max_attempts"]) == (
        PROBE_CONNECT_TIMEOUT_S,
        PROBE_READ_TIMEOUT_S,
        2,
    )
    assert PROBE_ATTEMPTS == 2  # the first try and one retry
    # Worst case of a stall: every attempt waits its full timeout; botocore's first retry backs off under 1 s.
    assert PROBE_ATTEMPTS * max(PROBE_CONNECT_TIMEOUT_S, PROBE_READ_TIMEOUT_S) + 1 < 15
    assert (transfer.read_timeout, transfer.retries["total_max_attempts"]) == (TRANSFER_READ_TIMEOUT_S,
                                                                               TRANSFER_ATTEMPTS)
    assert transfer.read_timeout > 10 * probe.read_timeout
    # Preflight sends everything through the probe client; a command's other requests go through the transfer client.
    view = probing(store)
    assert (
        isinstance(view, S3Store) and view.at.conn.client is conn.probe_client and conn.client is not conn.probe_client
    )


def test_the_first_request_of_a_connection_is_probed_once_and_preflight_counts_as_the_probe(s3_bucket):
    """Which client sends what, seen through boto3's event hooks: one HeadBucket through the probe client before a
    connection's first request, none after; preflight's requests all go through the probe client."""
    store = s3_store(f"s3://{s3_bucket}/runs")
    seen: dict[str, list[str]] = {"probe": [], "transfer": []}
    for name, client in (("probe", store.at.conn.probe_client), ("transfer", store.at.conn.client)):
        client.meta.events.register("before-call.s3", lambda model, name=name, **kw: seen[name].append(model.name))
    store.put_bytes("a", b"1")
    assert store.read_bytes("a") == b"1" and store.head("missing") is None
    assert seen == {"probe": ["HeadBucket"], "transfer": ["PutObject", "GetObject", "HeadObject"]}

    fresh = s3_store(f"s3://{s3_bucket}/runs")
    seen = {"probe": [], "transfer": []}
    for name, client in (("probe", fresh.at.conn.probe_client), ("transfer", fresh.at.conn.client)):
        client.meta.events.register("before-call.s3", lambda model, name=name, **kw: seen[name].append(model.name))
    preflight(fresh)
    assert fresh.read_bytes("a") == b"1"
    assert seen == {"probe": ["ListObjectsV2", "PutObject", "GetObject", "DeleteObject"], "transfer": ["GetObject"]}
    assert [i.key for i in fresh.list(PROBE_PREFIX)] == []


@pytest.mark.fault
def test_commands_against_an_endpoint_that_never_answers_fail_with_one_line(tmp_path):
    """preflight, and the first request of commands that run none (status, pull, verify), through the probe client."""
    with StalledEndpoint() as stalled:
        env = aws_env(tmp_path)
        commands = {
            "preflight": ["preflight", "s3://bucket/x"],
            "status": ["status", "s3://bucket/x"],
            "pull": ["pull", "s3://bucket/x", str(tmp_path / "local")],
            "verify": ["verify", "s3://bucket/x"],
        }
        # Separate processes, each with its own connections, that only wait out their probe timeouts: run side by side.
        with ThreadPoolExecutor(len(commands)) as pool:
            futures = {
                name: pool.submit(run_cli, [*args, "--endpoint-url", stalled.url], env)
                for name, args in commands.items()
            }
            runs = {name: future.result() for name, future in futures.items()}
        assert stalled.held  # the connections were accepted, then never answered
    stall = (f"S3 endpoint {stalled.url} accepts connections but did not answer within {PROBE_READ_TIMEOUT_S} s "
             f"({PROBE_ATTEMPTS} tries)")
    for command in ("preflight", "status", "pull"):
        proc = runs[command]
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", (command, proc.stderr)
        assert lines[0].startswith(f"error: {stall}") and "store.endpoint_url" in lines[0], (command, lines)
    # verify reports the manifest it could not read as a problem of the artifact: never verified, the same cause named.
    verify = runs["verify"]
    assert verify.returncode != 0 and not verify.stdout.startswith("verified"), verify.stdout
    assert stall in " ".join(verify.stderr.split()), verify.stderr
