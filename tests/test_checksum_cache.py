"""The checksum cache serves the `status`/`verify` listings only: an unchanged file (size, mtime, ctime, inode) is not
read again there, a changed one is, `--deep` always reads; everything that consumes a file reads its bytes whatever the
cache says."""

from __future__ import annotations

import os
import time

import pytest
from helpers.artifacts import commit_files, rot_under_cache

from blockdraft.errors import ArtifactError
from blockdraft.store import checksum_cache, open_store
from blockdraft.store.artifact import BYTES_READ_BACK, LOCAL_CACHED, State, verify_artifact
from blockdraft.store.inputs import open_input
from blockdraft.store.output import StageOutput
from blockdraft.store.status import find_artifact_roots


def _age(path, seconds: float = 10.0) -> None:
    """Make `path` look written `seconds` ago (a fresh file is never cached: its mtime could still move within a
    tick)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_unchanged_file_is_read_once_and_a_changed_one_again(tmp_path, monkeypatch):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 4096, "b.bin": b"b" * 4096})
    for name in ("a.bin", "b.bin"):
        _age(art / name)
    reads: list[str] = []
    real = checksum_cache.crc64nvme_file
    monkeypatch.setattr(checksum_cache, "crc64nvme_file", lambda p: reads.append(os.path.basename(p)) or real(p))

    first = verify_artifact(open_store(art), cached=True)
    assert first.state is State.VERIFIED and first.method == LOCAL_CACHED and sorted(reads) == ["a.bin", "b.bin"]
    reads.clear()
    assert verify_artifact(open_store(art), cached=True).state is State.VERIFIED and reads == []  # nothing read twice

    data = bytearray((art / "a.bin").read_bytes())
    data[100] ^= 1
    (art / "a.bin").write_bytes(bytes(data))  # same size, new mtime
    changed = verify_artifact(open_store(art), cached=True)
    assert changed.state is State.CORRUPT and reads == ["a.bin"]

    # An edit whose mtime is set back still moves the ctime, which only the kernel sets: read again, found corrupt.
    data[100] ^= 1
    (art / "a.bin").write_bytes(bytes(data))
    _age(art / "a.bin", 20)
    assert verify_artifact(open_store(art), cached=True).state is State.VERIFIED
    stat = (art / "a.bin").stat()
    data[200] ^= 1
    (art / "a.bin").write_bytes(bytes(data))
    os.utime(art / "a.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    reads.clear()
    assert verify_artifact(open_store(art), cached=True).state is State.CORRUPT and reads == ["a.bin"]
    deep = verify_artifact(open_store(art), deep=True, cached=True)
    assert deep.state is State.CORRUPT and deep.method == BYTES_READ_BACK


def test_bit_rot_under_a_lying_cache_is_found_by_everything_that_reads_the_file(tmp_path):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 4096, "b.bin": b"b" * 4096})
    for name in ("a.bin", "b.bin"):
        _age(art / name)
    rot_under_cache(art / "a.bin")

    listing = verify_artifact(open_store(art), cached=True)
    assert listing.state is State.VERIFIED and listing.method == LOCAL_CACHED  # a listing says it trusted the cache
    read = verify_artifact(open_store(art))
    assert read.state is State.CORRUPT and read.method == BYTES_READ_BACK and read.problems[0].path == "a.bin"
    assert verify_artifact(open_store(art), deep=True, cached=True).state is State.CORRUPT
    with pytest.raises(ArtifactError, match=r"art is corrupt: a\.bin: crc64nvme"):
        open_input(str(art))
    copy = StageOutput(str(art), "test", "k")
    assert copy.done() is None  # an output is never "already done" on the cache's word


def test_a_file_rotting_after_its_input_opened_is_refused_when_fetched(tmp_path):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 4096, "b.bin": b"b" * 4096})
    for name in ("a.bin", "b.bin"):
        _age(art / name)
    opened = open_input(str(art))
    rot_under_cache(art / "b.bin")
    assert opened.fetch(["a.bin"], tmp_path / "unused") == art
    with pytest.raises(ArtifactError, match=r"art/b\.bin does not match its manifest as read now \(crc64nvme"):
        opened.fetch(["b.bin"], tmp_path / "unused")


def test_a_fresh_file_is_not_cached(tmp_path, monkeypatch):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 100})
    reads: list[str] = []
    real = checksum_cache.crc64nvme_file
    monkeypatch.setattr(checksum_cache, "crc64nvme_file", lambda p: reads.append(os.path.basename(p)) or real(p))
    verify_artifact(open_store(art), cached=True)
    verify_artifact(open_store(art), cached=True)
    assert reads == ["a.bin", "a.bin"]  # modified within the last RACY_S seconds: read each time


def test_an_unusable_cache_only_means_reading_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE_DIR", str(tmp_path / "not-a-dir"))
    (tmp_path / "not-a-dir").write_text("a file where the cache folder should be")
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 100})
    assert verify_artifact(open_store(art)).state is State.VERIFIED


def test_artifact_roots_are_found_in_one_pass_over_many_keys():
    keys = [f"run/step-{i:05d}/{name}" for i in range(3000)
            for name in ("model.safetensors", "blockdraft-manifest.json")]
    keys += ["run/step-03000/model.safetensors", "raw/in.jsonl", "tok/.blockdraft-pieces/shard-0.json",
             "tok/train/d.arrow"]
    committed, incomplete = find_artifact_roots(keys)
    assert len(committed) == 3000 and incomplete == ["raw", "run/step-03000", "tok"]
