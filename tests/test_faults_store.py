"""Store faults that metadata alone cannot see, on the real S3 server (SeaweedFS): bytes that no longer read back.

The default check compares the checksum the server stored at upload (HEAD) and says so; `--deep` reads every byte back.
"""

from __future__ import annotations

import os

import pytest
from helpers.artifacts import commit_files
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.store import open_store, s3_client
from blockdraft.store.artifact import BYTES_READ_BACK, SERVER_CHECKSUMS, State, verify_artifact
from blockdraft.store.status import render_progress, status
from blockdraft.store.transfer import push

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def _flip_in_volume(data_dir, needle: bytes) -> None:
    """Flip one byte of `needle` where the server keeps it on disk (its volume files), bypassing S3 entirely."""
    hits = []
    for path in sorted(data_dir.rglob("*.dat")):
        blob = path.read_bytes()
        at = blob.find(needle)
        if at >= 0:
            hits.append((path, at))
    assert len(hits) == 1, hits
    path, at = hits[0]
    with open(path, "r+b") as f:
        f.seek(at + len(needle) // 2)
        byte = f.read(1)
        f.seek(at + len(needle) // 2)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_in_the_servers_volume_is_corrupt_under_deep(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    needle = os.urandom(64)
    local = commit_files(tmp_path / "art", {"shard.arrow": b"head" + needle * 50 + b"tail", "other.bin": b"x" * 100},
                         kind="tokenized")
    url = f"s3://{bucket}/run/tokenized"
    push(local, url)
    assert verify_artifact(open_store(url), deep=True).state is State.VERIFIED

    _flip_in_volume(s3_env.data, needle * 50)

    # The server's stored checksum is unchanged: the default check passes and says that is what it compared.
    shallow = verify_artifact(open_store(url))
    assert shallow.state is State.VERIFIED and shallow.method == SERVER_CHECKSUMS
    assert "checksum its server stored at upload" in render_progress(url, status(open_store(f"s3://{bucket}/run")))

    # Reading the bytes back fails at the server: SeaweedFS answers 500 only after its own read retries (about 13 s per
    # GET, hence only two reads here). The transfer client would send each such GET TRANSFER_ATTEMPTS times for the same
    # 500; one attempt gives the same answer, so the commands below (run in this process) send it once.
    monkeypatch.setattr(s3_client, "TRANSFER_ATTEMPTS", 1)
    runner = CliRunner()
    out = runner.invoke(app, ["verify", url, "--deep"])
    assert out.exit_code == 1 and out.stdout.startswith("corrupt\t"), out.output
    assert "shard.arrow" in out.output and ("unreadable" in out.output or "crc64nvme" in out.output), out.output
    page = tmp_path / "PROGRESS.md"
    out = runner.invoke(app, ["status", f"s3://{bucket}/run", "--deep", "--progress", str(page)])
    assert out.exit_code == 1 and out.stdout.startswith("corrupt\t"), out.output
    assert BYTES_READ_BACK in page.read_text() and "**corrupt**" in page.read_text()
