"""push / pull / verify / status on both stores (a real SeaweedFS S3 server and a local folder): the same
fault suite, each case with nothing lost and no false "verified"."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.errors import ArtifactError
from blockdraft.store import open_store
from blockdraft.store.artifact import BYTES_AS_WRITTEN, MANIFEST_NAME, State, verify_artifact
from blockdraft.store.base import TMP_PREFIX, WRITING_NAME
from blockdraft.store.inputs import open_input
from blockdraft.store.local import LocalStore
from blockdraft.store.status import render_progress, status
from blockdraft.store.transfer import INCOMING_DIR, pull, push

MIB = 1024 * 1024


def payload(seed: int, size: int) -> bytes:
    """Deterministic incompressible-looking bytes."""
    return random.Random(seed).randbytes(size)


@pytest.fixture
def artifact(tmp_path, make_artifact):
    # One multipart file (3 parts of 5 MiB), one single-part file, an empty one, one in a subfolder.
    files = {"shard-0.arrow": payload(0, 11 * MIB + 7), "shard-1.arrow": payload(1, 300_000), "empty.txt": b"",
             "meta/info.json": b'{"rows": 3}'}
    return make_artifact(tmp_path / "local", files, kind="tokenized")


def state_of(url: str, settings) -> State:
    return verify_artifact(open_store(url, settings), check_inputs=True).state


def test_push_pull_roundtrip_and_rerun_skips(dest, artifact, tmp_path):
    url = dest.sub("tok")
    first = push(artifact, url, dest.settings)
    assert first.verify.state is State.VERIFIED
    assert sorted(first.moved) == ["empty.txt", "meta/info.json", "shard-0.arrow", "shard-1.arrow"]
    assert state_of(url, dest.settings) is State.VERIFIED
    # The manifest at the destination is the local one byte for byte: lineage digests stay valid everywhere.
    assert open_store(url, dest.settings).read_bytes(MANIFEST_NAME) == (artifact / MANIFEST_NAME).read_bytes()

    again = push(artifact, url, dest.settings)
    assert again.moved == [] and len(again.skipped) == 4

    out = tmp_path / "pulled"
    got = pull(url, out, dest.settings)
    assert got.verify.state is State.VERIFIED and len(got.moved) == 4
    for rel in first.moved:
        assert (out / rel).read_bytes() == (artifact / rel).read_bytes()
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    assert not [p for p in out.rglob(TMP_PREFIX + "*")]
    assert pull(url, out, dest.settings).moved == []


@pytest.mark.fault
def test_pull_resumes_keeping_files_that_verify(dest, artifact, tmp_path):
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    out = tmp_path / "pulled"
    out.mkdir()
    # What a killed pull of this artifact leaves: its mark of the folder being written, files in place, a temp file.
    (out / WRITING_NAME).write_text('{"kind": "tokenized"}\n')
    (out / "shard-0.arrow").write_bytes((artifact / "shard-0.arrow").read_bytes())
    (out / "shard-1.arrow").write_bytes(b"partial leftover")
    (out / INCOMING_DIR).mkdir()
    (out / INCOMING_DIR / f"{TMP_PREFIX}shard-0.arrow.dead1234").write_bytes(b"left by a killed pull")
    got = pull(url, out, dest.settings)
    assert not list(out.rglob(TMP_PREFIX + "*")) and not (out / WRITING_NAME).exists()
    assert got.skipped == ["shard-0.arrow"]
    assert sorted(got.moved) == ["empty.txt", "meta/info.json", "shard-1.arrow"]
    assert (out / "shard-1.arrow").read_bytes() == (artifact / "shard-1.arrow").read_bytes()


@pytest.mark.fault
def test_destination_corruption_is_reported_and_pull_refuses(dest, artifact, tmp_path):
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    original = (artifact / "shard-1.arrow").read_bytes()
    tampered = bytes([original[0] ^ 0xFF]) + original[1:]  # same size, different bytes
    dest.overwrite("tok/shard-1.arrow", tampered)

    report = verify_artifact(open_store(url, dest.settings))
    assert report.state is State.CORRUPT and [p.path for p in report.problems] == ["shard-1.arrow"]
    [entry] = status(open_store(dest.url, dest.settings))
    assert entry.state is State.CORRUPT

    out = tmp_path / "pulled"
    with pytest.raises(ArtifactError, match=r"shard-1\.arrow") as caught:
        pull(url, out, dest.settings)
    assert "do not verify" in str(caught.value)
    assert not (out / MANIFEST_NAME).exists()

    # A rerun of push repairs the destination: only the bad file moves.
    fixed = push(artifact, url, dest.settings)
    assert fixed.moved == ["shard-1.arrow"] and fixed.verify.state is State.VERIFIED


@pytest.mark.fault
def test_corruption_without_metadata_checksum_is_caught_by_reading_back(dest, artifact, tmp_path):
    """A raw client writes a same-size object without CRC64NVME: HEAD proves nothing, the read-back does."""
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    data = bytearray((artifact / "shard-0.arrow").read_bytes())
    data[-1] ^= 0x01
    dest.overwrite("tok/shard-0.arrow", bytes(data))
    assert state_of(url, dest.settings) is State.CORRUPT
    with pytest.raises(ArtifactError, match=r"shard-0\.arrow"):
        pull(url, tmp_path / "pulled", dest.settings)
    assert not (tmp_path / "pulled" / MANIFEST_NAME).exists()


@pytest.mark.fault
def test_missing_file(dest, artifact, tmp_path):
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    dest.remove("tok/meta/info.json")
    assert state_of(url, dest.settings) is State.MISSING
    [entry] = status(open_store(dest.url, dest.settings))
    assert entry.state is State.MISSING
    with pytest.raises(ArtifactError, match=r"meta/info\.json \(missing"):
        pull(url, tmp_path / "pulled", dest.settings)


@pytest.mark.fault
def test_interrupted_push_is_incomplete_never_verified(dest, artifact):
    """A push that stops before its manifest (here: a local file rotted after commit) leaves `incomplete`."""
    url = dest.sub("tok")
    good = (artifact / "shard-0.arrow").read_bytes()
    (artifact / "shard-0.arrow").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(Exception, match="not match its expected checksum"):
        push(artifact, url, dest.settings)
    assert not dest.exists(f"tok/{MANIFEST_NAME}")
    [entry] = status(open_store(dest.url, dest.settings))
    assert entry.state is State.INCOMPLETE and entry.root == "tok"


@pytest.mark.fault
def test_repush_with_different_content_uncommits_first(dest, artifact, make_artifact, tmp_path):
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    newer = make_artifact(tmp_path / "newer", {"shard-0.arrow": payload(9, 6 * MIB), "other.bin": b"new"},
                          kind="tokenized")
    # The new push dies after uploading part of its files: the old manifest must already be gone.
    (newer / "other.bin").write_bytes(b"NEW")
    with pytest.raises(Exception, match="not match its expected checksum"):
        push(newer, url, dest.settings)
    assert not dest.exists(f"tok/{MANIFEST_NAME}")
    assert state_of(url, dest.settings) is State.INCOMPLETE
    (newer / "other.bin").write_bytes(b"new")
    assert push(newer, url, dest.settings).verify.state is State.VERIFIED


@pytest.mark.fault
def test_status_lineage_stale_and_progress_page(dest, artifact, make_artifact, tmp_path):
    comp_local = make_artifact(tmp_path / "comp", {"part-0.jsonl": b'{"messages": []}\n'}, kind="completions")
    comp_url = dest.sub("completions")
    push(comp_local, comp_url, dest.settings)
    tok_local = make_artifact(tmp_path / "tok", {"s.arrow": b"rows"}, kind="tokenized",
                              lineage=[open_input(open_store(comp_url, dest.settings)).ref])
    push(tok_local, dest.sub("tokenized"), dest.settings)
    by_root = {a.root: a for a in status(open_store(dest.url, dest.settings))}
    assert by_root["tokenized"].state is State.VERIFIED
    assert [ref.url for ref in by_root["tokenized"].lineage] == [open_store(comp_url, dest.settings).url]

    # The input is regenerated with different content: everything made from it is now stale.
    newer = make_artifact(tmp_path / "comp2", {"part-0.jsonl": b'{"messages": [1]}\n'}, kind="completions")
    push(newer, comp_url, dest.settings)
    by_root = {a.root: a for a in status(open_store(dest.url, dest.settings))}
    assert by_root["completions"].state is State.VERIFIED
    assert by_root["tokenized"].state is State.STALE

    page_path = tmp_path / "PROGRESS.md"
    result = CliRunner().invoke(app, ["status", dest.url, "--progress", str(page_path)])
    assert result.exit_code == 1  # not everything is verified
    page = page_path.read_text()
    assert "| `tokenized` | tokenized | **stale** |" in page
    assert "| `completions` | completions | **verified** | 1/1 |" in page
    assert "changed since" in page
    assert render_progress("x", []).count("no artifacts found") == 1


@pytest.mark.fault
def test_full_disk_during_pull_is_one_clear_error_and_no_manifest(dest, artifact, tmp_path):
    """RLIMIT_FSIZE in a child process: writes past 1 MiB fail with EFBIG, as a full disk fails with ENOSPC."""
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    out = tmp_path / "pulled"

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (MIB, MIB))

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "blockdraft"), "pull", url, str(out), "--part-size-mib", "5"],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=300,  # bounds a hang only
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "local disk full" in proc.stderr and "the local copy is as it was" in proc.stderr
    assert f"stay in {out / INCOMING_DIR}" in proc.stderr and "rerun the pull, which resumes from them" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.rglob(TMP_PREFIX + "*"))


def test_push_refuses_a_folder_without_manifest(dest, tmp_path):
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "a.bin").write_bytes(b"x")
    result = CliRunner().invoke(app, ["push", str(tmp_path / "loose"), dest.sub("x")])
    assert result.exit_code == 2
    assert "only committed artifacts are pushed" in result.stderr


def test_cli_push_pull_verify(dest, artifact, tmp_path):
    runner = CliRunner()
    url = dest.sub("tok")
    pushed = runner.invoke(app, ["push", str(artifact), url, "--part-size-mib", "5"])
    assert pushed.exit_code == 0, pushed.stderr
    assert pushed.stdout.startswith("verified\ttokenized\t")
    checked = runner.invoke(app, ["verify", url])
    assert checked.exit_code == 0 and checked.stdout.startswith("verified")
    pulled = runner.invoke(app, ["pull", url, str(tmp_path / "p")])
    assert pulled.exit_code == 0, pulled.stderr
    assert (tmp_path / "p" / MANIFEST_NAME).read_bytes() == (artifact / MANIFEST_NAME).read_bytes()
    listing = runner.invoke(app, ["status", dest.url])
    assert listing.exit_code == 0 and listing.stdout.startswith("verified\ttokenized\t")


@pytest.mark.fault
def test_a_short_write_during_pull_is_one_clear_error_not_a_hole(dest, make_artifact, tmp_path):
    """A write limit inside a 1 MiB chunk makes the kernel write part of it and return the count: the rest is written
    again and fails (EFBIG, as ENOSPC on a full disk), so the pull stops with the one disk-full line. Unchecked, the
    checksum of the whole chunk would have passed over a file missing its end."""
    artifact = make_artifact(tmp_path / "local", {"shard-0.arrow": payload(5, 2 * MIB)}, kind="tokenized")
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    out = tmp_path / "pulled"

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * MIB // 2, 3 * MIB // 2))

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "blockdraft"), "pull", url, str(out), "--part-size-mib", "5"],
        capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300, env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "local disk full" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (out / MANIFEST_NAME).exists()


def test_pull_reads_no_pulled_file_back(dest, make_artifact, tmp_path):
    """The checksum is computed on the bytes as they arrive: the kernel sees no read of a pulled file, in the incoming
    folder or in place (the manifest alone is read back). A read of our own shows that the watch sees reads."""
    from helpers.inotify import ReadWatch

    files = {f"shard-{i}.arrow": payload(10 + i, 6 * MIB + i) for i in range(3)}
    artifact = make_artifact(tmp_path / "local", files, kind="tokenized")
    url = dest.sub("tok")
    push(artifact, url, dest.settings)
    out = tmp_path / "pulled"
    (out / INCOMING_DIR).mkdir(parents=True)
    watch = ReadWatch(out, out / INCOMING_DIR)
    try:
        got = pull(url, out, dest.settings)
        assert got.verify.state is State.VERIFIED and sorted(got.moved) == sorted(files)
        assert watch.names_read() & set(files) == set()
        assert got.verify.method == BYTES_AS_WRITTEN  # and it says so: checksummed as written, not read back
        assert (out / "shard-0.arrow").read_bytes() == files["shard-0.arrow"]
        assert "shard-0.arrow" in watch.names_read()
    finally:
        watch.close()


def test_direct_writes_keep_every_byte_with_an_unaligned_tail_or_a_refused_direct_write(tmp_path):
    """Pull writes whole aligned blocks through an O_DIRECT descriptor and the rest through the buffered one; a direct
    write the file system refuses (here: memory not page-aligned, EINVAL) is written buffered instead. Either way the
    file holds exactly the bytes given (where O_DIRECT is unavailable both cases take the buffered path)."""
    import mmap

    from blockdraft.store.s3_multipart import DIRECT_ALIGN, _open_direct, _write_at

    data = random.Random(7).randbytes(3 * DIRECT_ALIGN + 100)
    aligned = memoryview(mmap.mmap(-1, 4 * DIRECT_ALIGN))
    aligned[: len(data)] = data
    for name, view in [("aligned", aligned[: len(data)]), ("unaligned", memoryview(bytearray(b"x" + data))[1:])]:
        path = tmp_path / name
        with LocalStore(tmp_path).writing(name) as new:
            direct = _open_direct(new)
            try:
                _write_at(new.fd, view, DIRECT_ALIGN, direct)
            finally:
                if direct >= 0:
                    os.close(direct)
        assert path.read_bytes() == bytes(DIRECT_ALIGN) + data, name
