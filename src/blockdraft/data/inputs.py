"""The completions files a tokenize run reads, listed without reading them: what pins each file's content comes from
its store's metadata (S3: its CRC64NVME or ETag; an artifact: its manifest; a local file: its size, mtime, inode and
device), and the checksum of a local file is computed by the tasks that read its bytes (docs/TOKENIZATION.md, "Tasks").
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.data.completions import not_a_regular_file, resolve_completions
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.store import Store
from blockdraft.store.artifact import InputRef
from blockdraft.store.checksum_cache import RACY_S

STAT_PIN = "stat:"


@dataclass(frozen=True)
class InputFile:
    """One completions file: `checksum` is its CRC64NVME as listed (None: a local file, checksummed by the tasks that
    read it); `pin` identifies its content for resuming without reading it (a `STAT_PIN` one only while `stat_pin` of
    the file is unchanged)."""

    key: str
    size: int
    checksum: str | None
    etag: str | None
    pin: str


def stat_pin(st: os.stat_result) -> str:
    return f"{STAT_PIN}{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}"


def pin_is_trusted(st: os.stat_result, now: float | None = None) -> bool:
    """Whether a local file's stat pin may stand for its content later: not when it was modified within `RACY_S` of now
    (a filesystem with coarse timestamps could change it again without changing its mtime; as `checksum_cache`
    rules)."""
    return (now if now is not None else time.time()) - st.st_mtime_ns / 1e9 > RACY_S


def list_inputs(input_url: str, store_config: StoreConfig | None) -> tuple[Store, list[InputFile],
                                                                           list[InputRef] | None]:
    """(store, files sorted by key, lineage) of the completions at `input_url`: a file, a folder or an artifact. The
    lineage is the artifact's, or None for raw files: their entries name checksums that only reading them gives."""
    store, keys, artifact = resolve_completions(input_url, store_config)
    if artifact is not None:
        listed = set(keys)
        files = [
            InputFile(f.path, f.size, f.checksum, None, f"crc64nvme:{f.checksum}")
            for f in artifact.manifest.files
            if f.path in listed
        ]
        return store, files, [artifact.ref]
    root = store.local_path()
    if root is not None:
        return store, [_local_file(root / key, key) for key in keys], None
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # one round trip per object
        infos = list(pool.map(store.head, keys))
    files = []
    for key, info in zip(keys, infos, strict=True):
        if info is None:
            raise ConfigError(f"input {input_url}/{key} disappeared while listing; retry when the input is complete")
        checksum = info.checksum
        if checksum is None and info.etag is None:
            checksum = store.checksum_by_reading(key)[1]
        # An object uploaded without CRC64NVME is pinned by its ETag (recorded as lineage), not re-read whole.
        files.append(InputFile(key, info.size, checksum, info.etag,
                               f"crc64nvme:{checksum}" if checksum else f"etag:{info.etag}"))
    return store, files, None


def _local_file(path: Path, key: str) -> InputFile:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"input {path} disappeared while listing; retry when the input is complete") from None
    if not stat.S_ISREG(st.st_mode):
        raise not_a_regular_file(path, st)
    return InputFile(key, st.st_size, None, None, stat_pin(st))


def check_unchanged(key: str, listed: InputFile, st: os.stat_result) -> None:
    """ArtifactError when a local file's stat no longer matches the pin it was listed with."""
    if listed.pin.startswith(STAT_PIN) and stat_pin(st) != listed.pin:
        raise ArtifactError(
            f"input {key} changed while it was tokenized (now {st.st_size} bytes, modified at {st.st_mtime_ns} ns; "
            f"listed as {listed.pin.removeprefix(STAT_PIN)}); rerun when the input is complete"
        )


__all__ = ["InputFile", "STAT_PIN", "check_unchanged", "list_inputs", "pin_is_trusted", "stat_pin"]
