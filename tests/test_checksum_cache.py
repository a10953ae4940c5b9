"""Checksums computed once per byte on a local store: an unchanged file (size, mtime, inode) is not read again; a changed
one is; `--deep` always reads."""

from __future__ import annotations

import os
import time

from helpers.artifacts import commit_files

from blockdraft.store import checksum_cache, open_store
from blockdraft.store.artifact import BYTES_READ_BACK, LOCAL_CACHED, State, verify_artifact
from blockdraft.store.status import find_artifact_roots


def _age(path, seconds: float = 10.0) -> None:
    """Make `path` look written `seconds` ago (a fresh file is never cached: its mtime could still move within a tick)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_unchanged_file_is_read_once_and_a_changed_one_again(tmp_path, monkeypatch):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 4096, "b.bin": b"b" * 4096})
    for name in ("a.bin", "b.bin"):
        _age(art / name)
    reads: list[str] = []
    real = checksum_cache.crc64nvme_file
    monkeypatch.setattr(checksum_cache, "crc64nvme_file", lambda p: reads.append(os.path.basename(p)) or real(p))

    first = verify_artifact(open_store(art))
    assert first.state is State.VERIFIED and first.method == LOCAL_CACHED and sorted(reads) == ["a.bin", "b.bin"]
    reads.clear()
    assert verify_artifact(open_store(art)).state is State.VERIFIED and reads == []  # nothing read twice

    data = bytearray((art / "a.bin").read_bytes())
    data[100] ^= 1
    (art / "a.bin").write_bytes(bytes(data))  # same size, new mtime
    changed = verify_artifact(open_store(art))
    assert changed.state is State.CORRUPT and reads == ["a.bin"]

    # A change that keeps size and mtime (only a deliberate utime does that) is what --deep is for.
    data[100] ^= 1
    (art / "a.bin").write_bytes(bytes(data))
    _age(art / "a.bin", 20)
    assert verify_artifact(open_store(art)).state is State.VERIFIED
    stat = (art / "a.bin").stat()
    data[200] ^= 1
    (art / "a.bin").write_bytes(bytes(data))
    os.utime(art / "a.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert verify_artifact(open_store(art)).state is State.VERIFIED  # trusted: same size, mtime and inode
    deep = verify_artifact(open_store(art), deep=True)
    assert deep.state is State.CORRUPT and deep.method == BYTES_READ_BACK


def test_a_fresh_file_is_not_cached(tmp_path, monkeypatch):
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 100})
    reads: list[str] = []
    real = checksum_cache.crc64nvme_file
    monkeypatch.setattr(checksum_cache, "crc64nvme_file", lambda p: reads.append(os.path.basename(p)) or real(p))
    verify_artifact(open_store(art))
    verify_artifact(open_store(art))
    assert reads == ["a.bin", "a.bin"]  # modified within the last RACY_S seconds: read each time


def test_an_unusable_cache_only_means_reading_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE_DIR", str(tmp_path / "not-a-dir"))
    (tmp_path / "not-a-dir").write_text("a file where the cache folder should be")
    art = commit_files(tmp_path / "art", {"a.bin": b"a" * 100})
    assert verify_artifact(open_store(art)).state is State.VERIFIED


def test_artifact_roots_are_found_in_one_pass_over_many_keys():
    keys = [f"run/step-{i:05d}/{name}" for i in range(3000) for name in ("model.safetensors", "blockdraft-manifest.json")]
    keys += ["run/step-03000/model.safetensors", "raw/in.jsonl", "tok/.blockdraft-pieces/shard-0.json", "tok/train/d.arrow"]
    committed, incomplete = find_artifact_roots(keys)
    assert len(committed) == 3000 and incomplete == ["raw", "run/step-03000", "tok"]
