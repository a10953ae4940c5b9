"""The S3 store against a real SeaweedFS server: checksums on the wire, endpoint precedence, credentials,
preflight, a server SIGKILLed mid-push, and a scan for the secret key in everything blockdraft writes or says."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.s3server import RO_SECRET_KEY, SECRET_KEY, free_ports
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import StoreConfig, load_config
from blockdraft.errors import StoreError
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, check_file, read_manifest, verify_artifact
from blockdraft.store.base import WRITING_NAME
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.local import LocalStore
from blockdraft.store.preflight import PROBE_PREFIX, preflight
from blockdraft.store.s3_client import resolve_endpoint
from blockdraft.store.status import render_progress, status
from blockdraft.store.transfer import push

pytestmark = pytest.mark.s3

MIB = 1024 * 1024
WRONG_SECRET = "wrong-sEcReT-that-must-never-appear-0000"
SMALL_PARTS = StoreConfig(part_size_mib=5, concurrency=2)
PROBE_ROUND_TRIP = ["ListObjectsV2", "PutObject", "GetObject", "DeleteObject"]


class RequestLog:
    """The S3 requests one store's client makes, seen through boto3's public event hooks: `calls` (operation names, in
    order) and `sent` (HTTP attempts, retries included). It asserts on requests where a clock would only race."""

    def __init__(self, store) -> None:
        self.calls: list[str] = []
        self.sent = 0
        events = store.at.conn.probe_client.meta.events
        events.register("before-call.s3", self.on_call)
        events.register("before-send.s3", self.on_send)

    def on_call(self, model, **kwargs) -> None:
        self.calls.append(model.name)

    def on_send(self, **kwargs) -> None:
        self.sent += 1


def test_endpoint_precedence_flag_config_env_default(monkeypatch, tmp_path):
    env = {"AWS_ENDPOINT_URL": "http://generic:1", "AWS_ENDPOINT_URL_S3": "http://s3-specific:2"}
    assert resolve_endpoint("http://configured:3", env) == "http://configured:3"
    assert resolve_endpoint(None, env) == "http://s3-specific:2"
    assert resolve_endpoint(None, {"AWS_ENDPOINT_URL": "http://generic:1"}) == "http://generic:1"
    assert resolve_endpoint(None, {}) is None

    # The flag beats the config file, which beats the environment (a flag reaches the store as a config override).
    config = tmp_path / "c.toml"
    config.write_text('[store]\nendpoint_url = "http://from-config:4"\n')
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://from-env:5")

    def store_config(path: Path | None, flag: str | None) -> StoreConfig:
        return load_config(path, {"store": {"endpoint_url": flag}}).store

    assert open_store("s3://b/p", store_config(config, None)).endpoint == "http://from-config:4"
    assert open_store("s3://b/p", store_config(config, "http://from-flag:6")).endpoint == "http://from-flag:6"
    assert open_store("s3://b/p", store_config(None, None)).endpoint == "http://from-env:5"
    assert open_store("s3://b/p").endpoint == "http://from-env:5"  # no config: the defaults, then the environment


def test_cli_endpoint_precedence_flag_config_env(s3_env, monkeypatch, tmp_path):
    """The same precedence through the CLI: each unreachable endpoint is named in the error, so the chosen one shows."""
    flag, configured, env = (f"http://127.0.0.1:{port}" for port in free_ports(3))
    config = tmp_path / "c.toml"
    config.write_text(f'[store]\nendpoint_url = "{configured}"\n')
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    cases = [(["--config", str(config), "--endpoint-url", flag], flag), (["--config", str(config)], configured),
             ([], env)]
    for options, chosen in cases:
        result = CliRunner().invoke(app, ["preflight", "s3://b/p", *options])
        assert result.exit_code == 2 and f"S3 endpoint {chosen} unreachable" in result.stderr, result.stderr


def test_uploads_carry_a_full_object_crc64nvme_the_server_reports(s3_bucket, s3_env, tmp_path):
    store = open_store(f"s3://{s3_bucket}/x", SMALL_PARTS)
    for name, size in [("single.bin", 4 * MIB), ("multi.bin", 12 * MIB + 3)]:
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        local_size, local_crc = crc64nvme_file(path)
        store.put_file(name, path, local_crc)
        head = s3_env.client().head_object(Bucket=s3_bucket, Key=f"x/{name}", ChecksumMode="ENABLED")
        assert head["ChecksumCRC64NVME"] == local_crc and head["ContentLength"] == local_size
        assert store.head(name).checksum == local_crc
        assert store.get_file(name, LocalStore(tmp_path), f"back-{name}") == (local_size, local_crc)


@pytest.mark.fault
def test_a_file_that_differs_from_its_checksum_is_never_completed(s3_bucket, s3_env, tmp_path):
    store = open_store(f"s3://{s3_bucket}/x", SMALL_PARTS)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(11 * MIB))
    with pytest.raises(StoreError, match="not match its expected checksum"):
        store.put_file("f.bin", path, "AAAAAAAAAAA=")
    assert store.head("f.bin") is None
    assert s3_env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.fault
def test_stale_multipart_uploads_are_aborted(s3_bucket, s3_env):
    raw = s3_env.client()
    raw.create_multipart_upload(Bucket=s3_bucket, Key="x/leftover", ChecksumAlgorithm="CRC64NVME",
                                ChecksumType="FULL_OBJECT")
    raw.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/keep", ChecksumAlgorithm="CRC64NVME",
                                ChecksumType="FULL_OBJECT")
    assert open_store(f"s3://{s3_bucket}/x").abort_partial_uploads() == 1
    left = [u["Key"] for u in raw.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]
    assert left == ["elsewhere/keep"]


def test_preflight_ok_leaves_nothing_behind(s3_bucket, s3_env):
    store = open_store(f"s3://{s3_bucket}/runs")
    requests = RequestLog(store)
    report = preflight(store)
    # One round trip of one probe object, each request answered at its first attempt.
    assert requests.calls == PROBE_ROUND_TRIP and requests.sent == len(PROBE_ROUND_TRIP)
    assert (
        report.url == store.url
        and report.seconds >= 0
        and report.summary().startswith(f"{store.url}: write, read back and delete")
    )
    assert s3_env.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def _bad_settings(case: str, server, monkeypatch) -> str:
    """Point the environment at one broken setup; return the URL to try."""
    bucket = "exists-bucket"
    try:
        server.client().create_bucket(Bucket=bucket)
    except server.client().exceptions.BucketAlreadyOwnedByYou:
        pass
    if case == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    elif case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    elif case == "read-only":
        for key, value in server.readonly.env(server.endpoint).items():
            monkeypatch.setenv(key, value)
    elif case == "no such bucket":
        bucket = "no-such-bucket-here"
    elif case == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    return f"s3://{bucket}/runs"


BAD_CASES = {
    "wrong secret": "wrong secret key",
    "no credentials": "no AWS credentials",
    "read-only": "no write permission",
    "no such bucket": "no such bucket 'no-such-bucket-here'",
    "unreachable": "unreachable",
}


@pytest.mark.fault
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_preflight_names_what_is_wrong_in_one_line(case, s3_env, monkeypatch):
    url = _bad_settings(case, s3_env, monkeypatch)
    result = CliRunner().invoke(app, ["preflight", url])
    assert result.exit_code == 2
    assert BAD_CASES[case] in result.stderr
    assert result.stderr.startswith("error:") and "Traceback" not in result.stderr


@pytest.mark.fault
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_preflight_stops_at_the_first_failed_request_and_never_retries_a_refusal(case, s3_env, monkeypatch):
    """What keeps preflight to seconds, asserted on its requests instead of a clock: it stops at the first request that
    fails, a refusal (403, 404, no credentials) is not retried, an unreachable endpoint is tried a bounded few times."""
    store = open_store(_bad_settings(case, s3_env, monkeypatch))
    requests = RequestLog(store)
    with pytest.raises(StoreError, match=BAD_CASES[case]):
        preflight(store)
    reached = {"read-only": 2}.get(case, 1)  # the read-only identity may list; its write is the refused request
    assert requests.calls == PROBE_ROUND_TRIP[:reached]
    if case == "unreachable":
        # the first attempt and at most 3 retries (the client's bound), each refused at once
        assert 1 <= requests.sent <= 4
    else:
        assert requests.sent == (0 if case == "no credentials" else reached)  # no credentials: nothing is even sent


@pytest.mark.fault
@pytest.mark.parametrize("case", ["wrong secret", "no credentials", "read-only"])
def test_push_with_bad_credentials_fails_before_moving_data(case, s3_env, monkeypatch, make_artifact, tmp_path):
    local = make_artifact(tmp_path / "a", {"big.bin": os.urandom(6 * MIB)})
    url = _bad_settings(case, s3_env, monkeypatch)
    with pytest.raises(StoreError, match=BAD_CASES[case]):
        push(local, url, SMALL_PARTS)
    listed = s3_env.client().list_objects_v2(Bucket="exists-bucket", Prefix="runs/")
    assert listed.get("KeyCount", 0) == 0


def objects_listed(raw, bucket: str, at_least: int, proc: subprocess.Popen) -> list[str]:
    """Poll the bucket until it lists `at_least` objects or `proc` exits; the deadline only bounds a hang."""
    deadline = time.monotonic() + 300
    while True:
        keys = [o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", [])]
        if len(keys) >= at_least or proc.poll() is not None:
            return keys
        assert time.monotonic() < deadline, f"{len(keys)} objects uploaded in 300 s"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.fault
def test_server_killed_mid_push_then_rerun_completes_without_reuploading(own_s3_server, make_artifact, tmp_path,
                                                                         monkeypatch):
    server = own_s3_server
    for key, value in server.admin.env(server.endpoint).items():
        monkeypatch.setenv(key, value)
    bucket = "killtest"
    server.client().create_bucket(Bucket=bucket)
    files = {f"shard-{i:02d}.arrow": os.urandom(6 * MIB) for i in range(12)}
    local = make_artifact(tmp_path / "tok", files, kind="tokenized")
    url = f"s3://{bucket}/tok"
    env = {**os.environ, "COLUMNS": "400"}
    push_cmd = [str(Path(sys.executable).parent / "blockdraft"), "push", str(local), url, "--concurrency", "1",
                "--part-size-mib", "5"]
    proc = subprocess.Popen(push_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    raw = server.client()
    objects_listed(raw, bucket, 3, proc)  # its lease, its writing mark and a first file
    # Frozen with files still to upload, the push cannot finish before the server dies under it, however fast it is.
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "the push finished before it could be stopped"
    server.kill()
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "unreachable" in err and "Traceback" not in err

    server.start()
    store = open_store(url)
    manifest = read_manifest(open_store(str(local)))[0]
    assert not store.exists(MANIFEST_NAME)
    assert status(open_store(f"s3://{bucket}/"))[0].state is State.INCOMPLETE
    verified_before = {e.path for e in manifest.files if check_file(store, e) is None}
    assert verified_before, "no file had completed before the kill"

    rerun = push(local, url, SMALL_PARTS)
    assert set(rerun.skipped) == verified_before
    assert set(rerun.moved) == set(files) - verified_before
    assert rerun.verify.state is State.VERIFIED
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert verify_artifact(store).state is State.VERIFIED


def test_no_secret_in_any_output_manifest_page_or_error(s3_env, monkeypatch, make_artifact, tmp_path, caplog):
    """Run the commands that touch credentials, good and bad; the secret keys appear nowhere."""
    caplog.set_level(logging.DEBUG)
    runner = CliRunner()
    texts: list[str] = []
    bucket = "secret-scan"
    s3_env.client().create_bucket(Bucket=bucket)
    local = make_artifact(tmp_path / "a", {"x.bin": os.urandom(6 * MIB)})
    url = f"s3://{bucket}/a"
    page = tmp_path / "PROGRESS.md"
    for args in (["preflight", url], ["push", str(local), url], ["verify", url], ["pull", url, str(tmp_path / "p")],
                 ["status", f"s3://{bucket}/", "--progress", str(page)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.stderr
        texts += [result.stdout, result.stderr]
    texts.append(page.read_text())
    texts.append(open_store(url).read_bytes(MANIFEST_NAME).decode())
    texts.append((tmp_path / "p" / MANIFEST_NAME).read_text())
    texts.append(render_progress(url, status(open_store(f"s3://{bucket}/"))))
    for case in ("wrong secret", "read-only", "no credentials"):
        with monkeypatch.context() as m:
            bad_url = _bad_settings(case, s3_env, m)
            for args in (["preflight", bad_url], ["push", str(local), bad_url], ["pull", url, str(tmp_path / "q")],
                         ["status", bad_url]):
                result = runner.invoke(app, args)
                texts += [result.stdout, result.stderr]
            with pytest.raises(StoreError) as caught:
                push(local, bad_url, SMALL_PARTS)
            texts += [str(caught.value), repr(caught.value)]
    texts += [r.getMessage() for r in caplog.records]
    blob = "\n".join(texts)
    assert "wrong secret key" in blob and "no write permission" in blob  # the failures were really exercised
    for secret in (SECRET_KEY, RO_SECRET_KEY, WRONG_SECRET):
        assert secret not in blob
    assert not [
        k
        for k in s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", [])
        if k["Key"].startswith(PROBE_PREFIX)
    ]


@pytest.mark.fault
def test_pull_from_s3_is_refused_without_manifest(s3_bucket, s3_env, tmp_path):
    s3_env.client().put_object(Bucket=s3_bucket, Key="half/a.bin", Body=b"x")
    result = CliRunner().invoke(app, ["pull", f"s3://{s3_bucket}/half", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no manifest" in result.stderr
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


@pytest.mark.fault
def test_objects_without_checksum_metadata_are_read_back_never_trusted(s3_bucket, s3_env, make_artifact, tmp_path):
    """Another client uploaded a file without CRC64NVME into an interrupted push of this artifact (its writing mark is
    there): push reads it back, and skips it only because the bytes match."""
    local = make_artifact(tmp_path / "a", {"same.bin": os.urandom(2 * MIB), "differs.bin": os.urandom(2 * MIB)})
    raw = s3_env.client()
    raw.put_object(Bucket=s3_bucket, Key=f"a/{WRITING_NAME}", Body=b'{"kind": "test"}\n')
    raw.put_object(Bucket=s3_bucket, Key="a/same.bin", Body=(local / "same.bin").read_bytes())
    raw.put_object(Bucket=s3_bucket, Key="a/differs.bin", Body=os.urandom(2 * MIB))
    assert open_store(f"s3://{s3_bucket}/a").head("same.bin").checksum is None
    report = push(local, f"s3://{s3_bucket}/a", SMALL_PARTS)
    assert report.skipped == ["same.bin"] and report.moved == ["differs.bin"]
    assert report.verify.state is State.VERIFIED


CHILD_PUSH = """
import sys
from blockdraft.config import StoreConfig
from blockdraft.store import open_store
from blockdraft.store.transfer import push

def hwm_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))

settings = StoreConfig(part_size_mib=5, concurrency=2)
open_store(sys.argv[2], settings).list()  # client and models loaded before the baseline
before = hwm_mib()
report = push(sys.argv[1], sys.argv[2], settings)
print(before, hwm_mib(), report.verify.state.value)
"""


@pytest.mark.slow
def test_push_memory_is_bounded_by_part_size_times_concurrency(s3_bucket, s3_env, make_artifact, tmp_path):
    """Two 48 MiB files through 5 MiB x 2 parts: peak memory grows by about 10 MiB, never by a whole file."""
    local = make_artifact(tmp_path / "a", {f"f{i}.bin": os.urandom(48 * MIB) for i in range(2)})
    out = subprocess.run(
        [sys.executable, "-c", CHILD_PUSH, str(local), f"s3://{s3_bucket}/mem"], capture_output=True, text=True,
        timeout=300, check=True
    ).stdout.split()
    before, after, state = int(out[0]), int(out[1]), out[2]
    assert state == "verified"
    assert after - before < 30, f"peak RSS grew {after - before} MiB for 5 MiB x 2 parts"
