"""The embedded default store: a local folder, with the same keys, manifests and verification as S3."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from blockdraft.errors import OutsideArtifactError, StoreError
from blockdraft.store.base import ROOT_MARKERS, TMP_PREFIX, ObjectInfo, Store
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.checksum_cache import cached_checksum, file_checksum, remember_checksum

_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # what `Path.is_file` reads as "not a file"


class LocalStore(Store):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self._root = str(self.root)  # the hot paths (list, head, reads) join strings: `status` asks per file
        self._real = os.path.realpath(self._root)
        self.url = "file://" + self._root

    def child(self, key_prefix: str) -> LocalStore:
        return LocalStore(os.path.join(self._root, key_prefix))

    def local_path(self) -> Path:
        return self.root

    def parent(self) -> LocalStore | None:
        return None if self.root.parent == self.root else LocalStore(self.root.parent)

    def _path(self, key: str) -> Path:
        return Path(self._inside(key))

    def _inside(self, key: str) -> str:
        """The file of `key`, refused (OutsideArtifactError) when it resolves outside this folder: a key with '..' or an
        absolute path, or a symlink (of the file or of a folder on the way) pointing elsewhere. Nothing outside the
        folder is read or written for an artifact that lives in it."""
        path = os.path.join(self._root, key)
        real = os.path.realpath(path)
        if real != self._real and not real.startswith(self._real.rstrip(os.sep) + os.sep):
            raise OutsideArtifactError(f"{self.url}/{key} resolves outside {self._root} (to {real}); remove that link or entry")
        return path

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if self.root.is_dir():
            yield from _walk(self._root, "", prefix)

    def head(self, key: str) -> ObjectInfo | None:
        path = self._inside(key)
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise
        except ValueError:  # a key no file can have (a NUL byte)
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        # A folder has no checksum metadata: the read-back is the check (docs/STORE.md), once per byte: a file unchanged
        # since it was last read (size, mtime, inode) keeps the checksum computed then (`checksum_cache`).
        size, checksum = file_checksum(path, st)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def read_head(self, key: str) -> ObjectInfo | None:
        """`head` with the checksum computed from every byte read now, whatever the checksum cache holds (and the cache
        updated with it): what a consumer of the file, and a writer checking its own output, rely on."""
        path = self._inside(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise
        if not stat.S_ISREG(st.st_mode):
            return None
        size, checksum = crc64nvme_file(path)
        remember_checksum(path, st, size, checksum)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def cached_head(self, key: str) -> ObjectInfo | None:
        """`head` when it needs no read: the file is there, unchanged since its checksum was last computed; else None."""
        try:
            path = self._inside(key)
        except OutsideArtifactError:
            return None  # `head` says why
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        checksum = cached_checksum(path, st) if stat.S_ISREG(st.st_mode) else None
        return None if checksum is None else ObjectInfo(key=key, size=st.st_size, checksum=checksum)

    def checksum_by_reading(self, key: str) -> tuple[int, str]:
        """Every byte read (no cache): what `--deep` asks for."""
        return crc64nvme_file(self._inside(key))

    def open_read(self, key: str) -> BinaryIO:
        return open(self._inside(key), "rb")

    def _atomic_target(self, key: str) -> tuple[Path, Path]:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{dest.name}.", dir=dest.parent)
        os.close(fd)
        return dest, Path(tmp)

    def put_file(self, key: str, local_path: Path, checksum: str | None = None) -> None:
        dest, tmp = self._atomic_target(key)
        try:
            shutil.copyfile(local_path, tmp)
            if checksum is not None and (got := crc64nvme_file(tmp)[1]) != checksum:
                raise StoreError(
                    f"the bytes copied from {local_path.name} to {key} do not match its expected checksum (crc64nvme {got} != {checksum}); "
                    "the source changed or the copy is bad"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _synced_tmp(self, key: str, data: bytes) -> tuple[Path, Path]:
        """`data` written and synced under a temp name beside `key`'s path: (destination, temp file)."""
        dest, tmp = self._atomic_target(key)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return dest, tmp

    def put_bytes(self, key: str, data: bytes) -> None:
        dest, tmp = self._synced_tmp(key, data)
        try:
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        dest, tmp = self._synced_tmp(key, data)
        try:
            try:
                os.link(tmp, dest)  # whole, and only if `dest` does not exist (atomic on POSIX filesystems)
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def abort_partial_uploads(self, keys: Collection[str] | None = None) -> int:
        """Remove temp files left by a killed writer (a rename never happened, so they are nobody's data): those of `keys`,
        or when None every one under this root except in the folders of other artifacts below it. Only blockdraft's
        temp names (`TMP_PREFIX`) are ever removed."""
        if not self.root.is_dir():
            return 0
        leftovers = _own_temp_files(self.root) if keys is None else [p for key in keys for p in _temp_files_of(self.root / key)]
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def _temp_files_of(path: Path) -> list[Path]:
    """The temp files that writes of `path` leave beside it: `TMP_PREFIX + name` and `TMP_PREFIX + name + ".*"`."""
    folder, stem = path.parent, TMP_PREFIX + path.name
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if (p.name == stem or p.name.startswith(stem + ".")) and p.is_file()]


def _own_temp_files(root: Path) -> list[Path]:
    """Every temp file under `root`, not descending into folders (or symlinks) that are the roots of other artifacts."""
    found = []
    for folder, subdirs, names in os.walk(root):
        here = Path(folder)
        subdirs[:] = [d for d in subdirs if not any((here / d / marker).exists() for marker in ROOT_MARKERS)]
        found += [here / name for name in names if name.startswith(TMP_PREFIX)]
    return found


def _walk(path: str, folder: str, prefix: str) -> Iterator[ObjectInfo]:
    """The files under `path` whose key (`folder` + their path below it) starts with `prefix`: sorted, a folder's files before
    its subfolders, symlinked folders not followed (as `os.walk` goes), and one directory scan plus one stat per file."""
    try:
        with os.scandir(path) as scan:
            entries = sorted(scan, key=lambda e: e.name)
    except OSError:
        return  # gone or unreadable meanwhile: nothing listed from it
    below = []
    for entry in entries:
        key = folder + entry.name
        if _is_dir(entry):
            if not _is_link(entry) and (key.startswith(prefix) or prefix.startswith(key + "/")):
                below.append(entry)
        elif not entry.name.startswith(TMP_PREFIX) and key.startswith(prefix):  # a temp name is an unfinished write
            yield ObjectInfo(key=key, size=entry.stat().st_size)
    for entry in below:
        yield from _walk(entry.path, f"{folder}{entry.name}/", prefix)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_link(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False
