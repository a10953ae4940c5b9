"""Local folders a command reads or writes as an artifact: one line, not a traceback, when the path cannot be one.

A path the user names may be a file, lie under a file, sit in a folder this process may not write (read-only even for
root, as under /sys), or reach a full disk (or a file-size limit) partway. Each is a `StoreError` naming the path, the
cause and the fix. A remote store has none of these: its writes fail with the server's own one-line errors.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from blockdraft.errors import StoreError
from blockdraft.store.base import Store
from blockdraft.store.local import TMP_PREFIX

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# What a folder that cannot hold the output answers: no permission, a read-only filesystem, a path through a file.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)
# What writing into an output folder that is read-only, not ours or not a folder raises (a missing one under /proc:
# ENOENT).
UNWRITABLE_OUTPUT = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT)
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust writer names the OS error it met


def file_in_the_way(store: Store) -> Path | None:
    """The file that keeps a local store's root from being a folder: the root itself or the nearest existing path above
    it; None when that is a folder (or the store is remote)."""
    root = store.local_path()
    if root is None:
        return None
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return None if probe.is_dir() else probe


def require_folder(store: Store, role: str, fix: str) -> None:
    """Refuse a local `store` whose root is a file or lies under one: StoreError naming that file, `role` (what the path
    is for, e.g. "pull destination") and `fix`."""
    blocking = file_in_the_way(store)
    if blocking is not None:
        root = store.local_path()
        where = "is a file" if blocking == root else f"lies under {blocking}, a file"
        raise StoreError(f"{role} {root} {where}, not a folder; {fix}")


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: `exc` itself, or the one a safetensors error names; else None."""
    if isinstance(exc, OSError):
        return exc
    found = _OS_ERROR.search(str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def write_failed(
    exc: BaseException, folder: Path | str, again: str, name: str | None = None, disk_only: bool = False
) -> StoreError | None:
    """The one line for a write under `folder` that failed with `exc` because of where it wrote: a full disk (or a
    file-size limit), or, unless `disk_only`, a folder it may not write. None when `exc` is something else: a bug keeps
    its traceback, and so does an error that names only paths outside a `folder` given as a Path. `name` is the file
    being written (default: the one the error names); `again` is how to retry."""
    error = os_error_of(exc)
    if error is None:
        return None
    named = [Path(str(p)).absolute() for p in (error.filename, error.filename2) if p is not None]
    if named and isinstance(folder, Path) and not any(p.is_relative_to(folder.absolute()) for p in named):
        return None  # about another path (a source being read), not where this writes
    name = name or (Path(error.filename).name if error.filename else "")
    name = "" if name.startswith(TMP_PREFIX) else name  # a temp name of ours says nothing to the user
    if error.errno in DISK_FULL:
        writing = f" writing {name}" if name else ""
        return StoreError(f"disk full{writing} in {folder} ({error.strerror}); free space, then {again}")
    if error.errno in NOT_WRITABLE and not disk_only:
        return StoreError(f"cannot write {name or 'files'} in {folder} ({error.strerror}); make it writable or choose "
                          f"another folder, then {again}")
    return None


class DiskFull(StoreError):
    """The output's filesystem ran out of space (or quota) while a stage wrote to it; the message names where and how
    much."""


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path`, or would hold it: that of its nearest existing folder."""
    folder = next((f for f in (path, *path.parents) if f.exists()), Path(path.anchor or "."))
    return shutil.disk_usage(folder).free


def disk_full_error(exc: OSError, path: Path, written: int = 0, fraction_done: float = 0.0) -> DiskFull | None:
    """One line for `exc` when it says the disk (or quota) is full, else None; call it after removing what the failed
    write left, so that the free space it names is what a rerun starts with.

    `path` is where it was writing (used when the error names no file); `written` bytes of output for `fraction_done` of
    the input give the estimate of what the whole input needs (a lower bound when the fraction is unknown).
    """
    if exc.errno not in DISK_FULL:
        return None
    where = Path(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else path
    free_text = f"{free_bytes(where):,} bytes are free there now"
    need = ""
    if written and 0 < fraction_done < 1:
        need = (f"; this input's rows need about {int(written / fraction_done):,} bytes ({written:,} were written for "
                f"{100 * fraction_done:.0f}% of it)")
    elif written:
        need = f"; this input's rows need more than the {written:,} bytes written when the disk filled"
    return DiskFull(
        f"disk full writing {where} ({os.strerror(exc.errno or errno.ENOSPC)}): {free_text}{need}; free space or point "
        "OUTPUT at a larger disk, then rerun (finished shards are kept; this run's temporary files were removed)"
    )


def unwritable_error(exc: OSError, out_dir: Path) -> StoreError | None:
    """One line for `exc` when it says the output folder `out_dir` (or a file in it, or a folder above it) cannot be
    written: read-only, not permitted, a file where a folder must be; else None."""
    if exc.errno not in UNWRITABLE_OUTPUT or not isinstance(exc.filename, (str, os.PathLike)):
        return None
    where, out = Path(os.path.abspath(exc.filename)), Path(os.path.abspath(out_dir))
    if not (where == out or out in where.parents or where in out.parents):
        return None
    return StoreError(f"cannot write the output {out_dir}: {os.strerror(exc.errno or errno.EACCES)} ({where}); "
                      "point OUTPUT at a folder this user can write")


__all__ = [
    "DISK_FULL", "NOT_WRITABLE", "UNWRITABLE_OUTPUT", "DiskFull", "disk_full_error", "file_in_the_way", "free_bytes",
    "os_error_of", "require_folder", "unwritable_error", "write_failed",
]
