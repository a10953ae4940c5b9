"""What a shard checks around its rows: that the bytes read of a whole file are the input as listed, what an unreadable input leaves in
the quarantine and the counts, and a full disk told as one line."""

from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path
from typing import Any

from blockdraft.data.streams import InputUnreadable
from blockdraft.errors import ArtifactError, StoreError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# What writing a folder that is read-only, not ours or not a folder raises (a missing one under /proc: ENOENT).
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT)


class DiskFull(StoreError):
    """The output's filesystem ran out of space (or quota) while tokenize wrote to it; the message names where and how much."""


def check_listed(key: str, size: int, checksum: str | None, window: tuple[int, int] | None, crc: str | None) -> None:
    """ArtifactError when the bytes a task read of a whole file (`window`, their `crc`) are not the file as listed (`size`,
    and `checksum` when the listing names one): the input changed while it was tokenized."""
    if window is None:
        return  # not checksummed: Parquet whose listed checksum is trusted, as its store verified it
    read = window[1] - window[0]
    if read != size or checksum not in (None, crc):
        raise ArtifactError(
            f"input {key} changed while it was tokenized (read {read} bytes, crc64nvme {crc}; listed {size}, {checksum}); "
            "rerun when the input is complete"
        )


def failed_input(key: str, exc: InputUnreadable, rows_read: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(its one quarantine line, its entry in the manifest's `counts.failed_inputs`) for an input file dropped whole."""
    record = {"reason": exc.reason, "detail": exc.detail, "rows_read_before_failure": rows_read}
    line = {"source_id": None, "turn": None, "reason": exc.reason, "detail": exc.detail, "input": key, "position": rows_read + 1,
            "row": None, "rows_read_before_failure": rows_read}
    return line, record


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return None


def disk_full_error(exc: OSError, path: Path, written: int = 0, fraction_done: float = 0.0) -> DiskFull | None:
    """One line for `exc` when it says the disk (or quota) is full, else None; call it after removing what the failed
    write left, so that the free space it names is what a rerun starts with.

    `path` is where it was writing (used when the error names no file); `written` bytes of output for `fraction_done` of
    the input give the estimate of what the whole input needs (a lower bound when the fraction is unknown).
    """
    if exc.errno not in DISK_FULL:
        return None
    where = Path(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else path
    free = _free_bytes(where)
    free_text = f"{free:,} bytes are free there now" if free is not None else "the free space there is unknown"
    need = ""
    if written and 0 < fraction_done < 1:
        need = f"; this input's rows need about {int(written / fraction_done):,} bytes ({written:,} were written for {100 * fraction_done:.0f}% of it)"
    elif written:
        need = f"; this input's rows need more than the {written:,} bytes written when the disk filled"
    return DiskFull(
        f"disk full writing {where} ({os.strerror(exc.errno or errno.ENOSPC)}): {free_text}{need}; free space or point OUTPUT "
        "at a larger disk, then rerun (finished shards are kept; this run's temporary files were removed)"
    )


def unwritable_error(exc: OSError, out_dir: Path) -> StoreError | None:
    """One line for `exc` when it says the output folder `out_dir` (or a file in it, or a folder above it) cannot be
    written: read-only, not permitted, a file where a folder must be; else None."""
    if exc.errno not in UNWRITABLE or not isinstance(exc.filename, (str, os.PathLike)):
        return None
    where, out = Path(os.path.abspath(exc.filename)), Path(os.path.abspath(out_dir))
    if not (where == out or out in where.parents or where in out.parents):
        return None
    return StoreError(f"cannot write the output {out_dir}: {os.strerror(exc.errno or errno.EACCES)} ({where}); "
                      "point OUTPUT at a folder this user can write")


def peak_rss_mib() -> float:
    """This process's own high-water resident memory (VmHWM; ru_maxrss would count a spawning parent's after exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
