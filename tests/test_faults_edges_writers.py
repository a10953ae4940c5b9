"""Trust at the edges, the writers' side (issue 21, cases 3, 4, 5 and the lease parts of 9 and 10): an output only ever
touches what it owns, `--force` never takes a live writer's lease on this host, nested outputs leave each other alone,
a malformed lease is a clear state, and lease takeovers are told through the reporter.

Another writer is stood in for by the lease record it would leave (a host, a pid, an expiry), which is all a writer
ever sees of another; the S3 cases run against SeaweedFS.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from helpers.artifacts import commit_files
from helpers.tokenize_data import TOKENIZER_DIR, make_corpus
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import StoreConfig
from blockdraft.errors import LeaseError
from blockdraft.reporter import Reporter
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, read_manifest, verify_artifact
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.lease import LeaseRecord
from blockdraft.store.local import TMP_PREFIX
from blockdraft.store.status import status
from blockdraft.store.transfer import push

FOREIGN_HOST = "train-node-7"


@pytest.fixture(autouse=True)
def _leases(leases_given_back):
    """Every test here: no --force left behind, every lease given back (`leases_given_back`)."""


def _lease(root: Path, host: str = FOREIGN_HOST, pid: int = 4242, expires_in: float = 600.0) -> LeaseRecord:
    now = time.time()
    record = LeaseRecord(f"{host}:{pid}:abc", host, pid, "blockdraft push", now, now + expires_in)
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_NAME).write_bytes(record.to_bytes())
    return record


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return " ".join(result.output.split())  # rich may wrap the one line on a narrow terminal


def _export_like(root: Path) -> Path:
    return commit_files(root, {"config.json": b'{"drafter": 1}', "model.safetensors": b"\0" * 64},
                        kind="drafter-export")


# ------------------------------------------------------------------------------------------- case 3: what a writer owns


def test_pull_into_a_folder_of_the_users_own_files_refuses_and_changes_nothing(tmp_path):
    export = _export_like(tmp_path / "store" / "export")
    folder = tmp_path / "serving"
    folder.mkdir()
    (folder / "config.json").write_text("the user's own config")
    (folder / ".tmp-notes.txt").write_text("the user's notes")
    before = _snapshot(folder)

    out = _one_line_error(CliRunner().invoke(app, ["pull", str(export), str(folder)]))
    assert "not a file of a blockdraft 'drafter-export' artifact" in out and (
        "config.json" in out or ".tmp-notes.txt" in out
    )
    assert _snapshot(folder) == before


def test_push_to_a_folder_of_the_users_own_files_refuses_and_changes_nothing(tmp_path):
    export = _export_like(tmp_path / "export")
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "config.json").write_text("the user's own config")
    (folder / ".tmp-notes.txt").write_text("the user's notes")
    before = _snapshot(folder)

    out = _one_line_error(CliRunner().invoke(app, ["push", str(export), f"file://{folder}"]))
    assert "blockdraft never overwrites or deletes files it does not own" in out
    assert _snapshot(folder) == before


def test_a_destination_holding_another_kind_or_unlisted_files_is_refused(tmp_path):
    export = _export_like(tmp_path / "export")
    other = commit_files(tmp_path / "dest", {"rows.arrow": b"rows"}, kind="tokenized")
    before = _snapshot(other)
    out = _one_line_error(CliRunner().invoke(app, ["push", str(export), str(other)]))
    assert "holds a 'tokenized' artifact, not 'drafter-export'" in out
    assert _snapshot(other) == before

    # The same kind, with a file its manifest does not list: that file is not the artifact's to replace.
    same = commit_files(tmp_path / "dest2", {"config.json": b'{"drafter": 0}'}, kind="drafter-export")
    (same / "README.md").write_text("mine")
    before = _snapshot(same)
    out = _one_line_error(CliRunner().invoke(app, ["push", str(export), str(same)]))
    assert "README.md is not a file of a blockdraft 'drafter-export' artifact" in out
    assert _snapshot(same) == before

    # Its own older version, and nothing else, a copy replaces; the mark of it being written is gone, never an artifact.
    (same / "README.md").unlink()
    push(export, str(same))
    assert (same / "config.json").read_bytes() == b'{"drafter": 1}'
    assert [a.state for a in status(open_store(same))] == [State.VERIFIED]


def test_tokenize_into_a_folder_holding_the_users_dataset_refuses_and_deletes_nothing(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=1, per_file=4)
    out_dir = tmp_path / "mydata"
    (out_dir / "train").mkdir(parents=True)
    (out_dir / "train" / "data-00000-of-00001.arrow").write_bytes(b"the user's rows")
    (out_dir / "train" / "state.json").write_text("{}")
    (out_dir / "dataset_dict.json").write_text('{"splits": ["train"]}')
    before = _snapshot(out_dir)

    out = _one_line_error(CliRunner().invoke(app, ["tokenize", str(corpus), str(out_dir), "--tokenizer",
                                                   str(TOKENIZER_DIR)]))
    assert "not a file of a blockdraft 'tokenized' artifact" in out
    assert _snapshot(out_dir) == before  # not even the run's lease is left behind


def test_input_equal_to_inside_or_containing_the_output_is_refused_by_every_stage(tmp_path):
    completions = commit_files(tmp_path / "store" / "completions", {"part-0.jsonl": b'{"messages": []}\n'},
                               kind="completions")
    manifest = (completions / MANIFEST_NAME).read_bytes()
    tok = ["--tokenizer", str(TOKENIZER_DIR)]
    cases = [
        (["tokenize", str(completions), str(completions), *tok], "is the output itself"),
        (["tokenize", str(completions), str(completions / "tokenized"), *tok], "contains the output"),
        (["tokenize", str(completions / "part-0.jsonl"), str(completions), *tok], "lies inside the output"),
        (["generate", str(completions), str(completions)], "is the output itself"),
        (["export", str(completions), str(completions / "export")], "contains the output"),
        (["push", str(completions), f"file://{completions}/copy"], "contains the output"),
        (["pull", str(completions), str(completions.parent)], "lies inside the output"),
    ]
    for argv, relation in cases:
        out = _one_line_error(CliRunner().invoke(app, argv))
        assert relation in out and "a stage never reads what it writes" in out, (argv, out)
    assert (completions / MANIFEST_NAME).read_bytes() == manifest
    assert sorted(p.name for p in completions.iterdir()) == [MANIFEST_NAME, "part-0.jsonl"]


def test_train_data_inside_its_output_is_refused(tmp_path):
    from helpers.train_data import config_file, make_rows, write_tokenized

    from blockdraft.config import load_config
    from blockdraft.errors import ConfigError
    from blockdraft.stages import train

    rows = make_rows(3, prompt_len=4, new_tokens=12, seed=0)
    data = write_tokenized(tmp_path / "run" / "data", rows[:2], rows[2:])
    with pytest.raises(ConfigError,
                       match="train.data .* lies inside the output .*; a stage never reads what it writes"):
        train.run(load_config(config_file(tmp_path, str(data), output=str(tmp_path / "run"), max_steps=2)))
    assert not any((tmp_path / "run").glob("step-*"))


# ------------------------------------------------------------------------------------- case 4: --force and live writers


def test_force_never_takes_the_lease_of_a_writer_alive_on_this_host(tmp_path):
    art = _export_like(tmp_path / "art")
    dest = tmp_path / "dest"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lease(dest, host=socket.gethostname(), pid=alive.pid)
        out = _one_line_error(CliRunner().invoke(app, ["push", str(art), str(dest), "--force"]))
        assert (
            f"pid {alive.pid} is alive on this host" in out and "--force takes over only a writer that is dead" in out
        )
        assert not (dest / MANIFEST_NAME).exists() and json.loads((dest / LEASE_NAME).read_bytes())["pid"] == alive.pid
    finally:
        alive.kill()
        alive.wait()


def test_force_takes_over_another_hosts_lease_and_says_so_through_the_reporter(tmp_path, recwarn):
    art = _export_like(tmp_path / "art")
    dest = tmp_path / "dest"
    _lease(dest)
    result = CliRunner().invoke(app, ["push", str(art), str(dest), "--force"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"WARNING: taking over the lease on file://{dest} from pid 4242 on {FOREIGN_HOST}" in text
    assert not [w for w in recwarn.list if "lease" in str(w.message)]  # no Python warning with a source line
    assert verify_artifact(open_store(dest)).state is State.VERIFIED


@pytest.mark.parametrize("expires_at", ['"tomorrow"', "1e400", "-5", "true"])
@pytest.mark.parametrize("force", [False, True])
def test_a_malformed_lease_is_unreadable_and_taken_over_with_one_warning(tmp_path, expires_at, force):
    """A lease blockdraft never writes (a time that is no date, a string) is treated as expired, as a torn one is: it
    names no writer that could still be alive, and refusing it would block the output until someone deletes it by
    hand."""
    art = _export_like(tmp_path / "art")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / LEASE_NAME).write_text(
        f'{{"owner": "x:1:y", "host": "{FOREIGN_HOST}", "pid": 1, "command": "c", "acquired_at": 0, "expires_at": '
        f'{expires_at}}}'
    )
    result = CliRunner().invoke(app, ["push", str(art), str(dest), *(["--force"] if force else [])])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "taking over the lease" in result.output and "an unreadable lease record" in " ".join(result.output.split())
    assert verify_artifact(open_store(dest)).state is State.VERIFIED and not (dest / LEASE_NAME).exists()


def test_lease_takeovers_warn_through_the_reporter_not_python_warnings(tmp_path):
    art = _export_like(tmp_path / "art")
    dest = tmp_path / "dest"
    _lease(dest, expires_in=-1.0)
    reporter = Reporter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning fails the test
        push(art, str(dest), reporter=reporter)
    assert len(reporter.warnings) == 1 and reporter.warnings[0].startswith(f"taking over the lease on file://{dest}")


# ---------------------------------------------------------------------------------------------- case 5: nested outputs


def test_a_push_above_another_artifact_leaves_its_files_and_temp_files_alone(tmp_path):
    nest = tmp_path / "store" / "nest"
    child = commit_files(nest / "child", {"a.bin": b"child"}, kind="tokenized")
    writing = child / f"{TMP_PREFIX}b.bin.1234abcd"  # the child's writer is uploading b.bin right now
    writing.write_bytes(b"half")
    push(_export_like(tmp_path / "art"), str(nest))
    assert writing.read_bytes() == b"half"
    assert verify_artifact(open_store(child)).state is State.VERIFIED
    assert verify_artifact(open_store(nest)).state is State.VERIFIED


def test_a_live_lease_below_or_above_a_destination_is_respected(tmp_path):
    art = _export_like(tmp_path / "art")
    nest = tmp_path / "store" / "nest"
    _lease(nest / "child")
    out = _one_line_error(CliRunner().invoke(app, ["push", str(art), str(nest)]))
    assert f"file://{nest}/child, inside file://{nest}, is being written by pid 4242 on {FOREIGN_HOST}" in out
    assert not (nest / MANIFEST_NAME).exists() and not (nest / LEASE_NAME).exists()

    (nest / "child" / LEASE_NAME).unlink()
    _lease(nest)
    out = _one_line_error(CliRunner().invoke(app, ["push", str(art), str(nest / "child")]))
    assert f"file://{nest}, which contains file://{nest}/child, is being written by pid 4242" in out
    assert not (nest / "child" / MANIFEST_NAME).exists()


def _start_upload(client, bucket: str, key: str) -> str:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 * 1024 * 1024))
    return upload


def _uploads(client, bucket: str) -> set[str]:
    return {up["UploadId"] for up in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}


def test_s3_a_push_above_another_artifact_never_aborts_its_upload_and_a_live_one_below_is_refused(tmp_path, s3_env):
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    art = _export_like(tmp_path / "art")
    child_art = commit_files(tmp_path / "child", {"a.bin": b"child"}, kind="tokenized")
    push(child_art, f"s3://{bucket}/nest/child")
    # a writer of the child, between its lease and its commit
    upload = _start_upload(client, bucket, "nest/child/b.bin")

    # The child's writer holds its lease: the push above it is refused, naming it.
    client.put_object(Bucket=bucket, Key=f"nest/child/{LEASE_NAME}",
                      Body=LeaseRecord(f"{FOREIGN_HOST}:7:t", FOREIGN_HOST, 7, "blockdraft push", time.time(),
                                       time.time() + 600).to_bytes())
    out = _one_line_error(CliRunner().invoke(app, ["push", str(art), f"s3://{bucket}/nest"]))
    assert f"s3://{bucket}/nest/child, inside s3://{bucket}/nest, is being written by pid 7 on {FOREIGN_HOST}" in out
    assert upload in _uploads(client, bucket)

    # Without a live writer below, the push goes on and touches only its own keys: the child's upload stays.
    client.delete_object(Bucket=bucket, Key=f"nest/child/{LEASE_NAME}")
    _start_upload(client, bucket, "nest/config.json")  # an unfinished upload of the push's own file: its own to abort
    report = push(art, f"s3://{bucket}/nest")
    assert report.verify is not None and report.verify.state is State.VERIFIED and report.aborted_uploads == 1
    assert _uploads(client, bucket) == {upload}
    assert verify_artifact(open_store(f"s3://{bucket}/nest/child")).state is State.VERIFIED


def test_s3_a_writer_whose_lease_another_host_took_ends_with_one_line_naming_it(tmp_path, s3_env):
    """The new owner's push aborts the unfinished uploads of its keys (the old owner's, too): the old owner, still
    uploading, ends with the lease line naming the new owner, not the server's NoSuchUpload."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    # 40 MiB
    big = commit_files(tmp_path / "big", {"model.safetensors": bytes(range(256)) * (160 * 1024)}, kind="drafter-export")
    url = f"s3://{bucket}/export"
    settings = StoreConfig(part_size_mib=5, concurrency=1)
    failure: list[BaseException] = []

    def old_owner() -> None:
        try:
            push(big, url, settings)
        except BaseException as exc:  # noqa: BLE001 - the test inspects what ended the push
            failure.append(exc)

    thread = threading.Thread(target=old_owner)
    thread.start()
    deadline = time.monotonic() + 60
    while not _uploads(client, bucket) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    # Another host takes the lease with --force and aborts the unfinished uploads of its keys, as its push does.
    client.put_object(Bucket=bucket, Key=f"export/{LEASE_NAME}",
                      Body=LeaseRecord(f"{FOREIGN_HOST}:9:t", FOREIGN_HOST, 9, "blockdraft push", time.time(),
                                       time.time() + 600).to_bytes())
    for up in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    thread.join(timeout=120)
    assert len(failure) == 1 and isinstance(failure[0], LeaseError), failure
    assert f"lost the lease on s3://{bucket}/export/ to pid 9 on {FOREIGN_HOST}" in str(failure[0])
    assert "NoSuchUpload" not in str(failure[0])
    assert read_manifest(open_store(url)) is None
    client.delete_object(Bucket=bucket, Key=f"export/{LEASE_NAME}")
