"""The embedded default store: a local folder, with the same keys, manifests and verification as S3."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from blockdraft.errors import OutsideArtifactError, StoreError
from blockdraft.store.base import ROOT_MARKERS, TMP_PREFIX, NewFile, ObjectInfo, Store
from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme, crc64nvme_file
from blockdraft.store.checksum_cache import cached_checksum, file_checksum, remember_checksum

_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # what `Path.is_file` reads as "not a file"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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

    def _inside(self, key: str) -> str:
        """The file of `key`, refused (OutsideArtifactError) when it resolves outside this folder: a key with '..' or an
        absolute path, or a symlink (of the file or of a folder on the way) pointing elsewhere. Nothing outside the
        folder is read or written for an artifact that lives in it."""
        path = os.path.join(self._root, key)
        real = os.path.realpath(path)
        if real != self._real and not real.startswith(self._real.rstrip(os.sep) + os.sep):
            raise OutsideArtifactError(f"{self.url}/{key} resolves outside {self._root} (to {real}); remove that link "
                                       "or entry")
        return path

    def _new_file(self, fd: int, key: str) -> NewFile:
        """`NewFile` for `key` in its held folder `fd`; an OSError names the temp file by its full path (the open names
        it relative to `fd`), so the one line for an unwritable folder or a full disk says which folder."""
        try:
            return NewFile(fd, os.path.basename(key))
        except OSError as exc:
            where = self.root / os.path.dirname(key) / str(exc.filename or "")
            raise type(exc)(exc.errno, exc.strerror, str(where)) from None

    def _folder_fd(self, key: str, create: bool) -> int | None:
        """A descriptor of the folder that holds `key`, reached from the root one name at a time without following a
        link (openat with O_NOFOLLOW): what every write opens, so nothing is created, replaced or removed outside the
        root through a link planted (or swapped in) anywhere below it, with no window between a check and the use.
        Missing folders are created when `create`, else None; a link (or a file) on the way is OutsideArtifactError."""
        if key.startswith("/") or ".." in key.split("/"):
            self._inside(key)  # names the escape
        parts = [p for p in key.split("/")[:-1] if p]
        if create:
            os.makedirs(self._root, exist_ok=True)
        try:
            fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        for i, part in enumerate(parts):
            try:
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._not_a_folder("/".join(parts[: i + 1]), key) from None
                raise
            os.close(fd)
            fd = below
        return fd

    def _not_a_folder(self, folder: str, key: str) -> OutsideArtifactError:
        path = os.path.join(self._root, folder)
        if os.path.islink(path):
            return OutsideArtifactError(
                f"{self.url}/{key} resolves outside {self._root}: {folder} is a link (to {os.path.realpath(path)}), "
                "and blockdraft writes nothing through a link; remove that link"
            )
        return OutsideArtifactError(f"{self.url}/{key} cannot be written: {path} is a file, not a folder; move that "
                                    "file away")

    @contextmanager
    def writing(self, key: str) -> Iterator[NewFile]:
        """A new file for `key`, renamed into place (replacing what is there, a link itself, never its target) when the
        block ends without an error, removed otherwise."""
        fd = self._folder_fd(key, create=True)
        assert fd is not None
        new = None
        try:
            new = self._new_file(fd, key)
            yield new
            os.close(new.fd)
            new.fd = -1
            os.replace(new.tmp, new.name, src_dir_fd=fd, dst_dir_fd=fd)
            new.tmp = ""
        finally:
            if new is not None:
                if new.fd >= 0:
                    os.close(new.fd)
                if new.tmp:
                    try:
                        os.unlink(new.tmp, dir_fd=fd)
                    except FileNotFoundError:
                        pass
            os.close(fd)

    def read_checksum(self, key: str) -> tuple[int, str] | None:
        """(size, checksum) of every byte of `key`'s file as read now, opened like `writing` opens (no link followed on
        the way, nor the file itself a link); None when there is no such regular file. For files a writer will move."""
        fd = self._folder_fd(key, create=False)
        if fd is None:
            return None
        try:
            try:
                file_fd = os.open(os.path.basename(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in _ABSENT:
                    return None
                raise
            if not stat.S_ISREG(os.fstat(file_fd).st_mode):
                os.close(file_fd)
                return None
            return crc64nvme_file(file_fd)
        finally:
            os.close(fd)

    def move(self, source_key: str, key: str) -> None:
        """Rename the file at `source_key` to `key`, both folders opened like `writing` opens them."""
        src = self._folder_fd(source_key, create=False)
        if src is None:
            raise FileNotFoundError(source_key)
        try:
            dst = self._folder_fd(key, create=True)
            assert dst is not None
            try:
                os.replace(os.path.basename(source_key), os.path.basename(key), src_dir_fd=src, dst_dir_fd=dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def remove_folder(self, key: str) -> None:
        """Remove the folder `key` and all below it, never following a link (`shutil.rmtree` with a folder descriptor:
        a link in there is removed itself, and a link at `key` is refused)."""
        parent = self._folder_fd(key, create=False)
        if parent is not None:
            try:
                shutil.rmtree(os.path.basename(key), dir_fd=parent)
            except FileNotFoundError:
                pass
            finally:
                os.close(parent)

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
        """`head` when it needs no read: the file is there, unchanged since its checksum was last computed; else
        None."""
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

    def put_file(self, key: str, local_path: Path, checksum: str | None = None, over: str | None = None) -> None:
        # A folder has no conditional rename: `over` is not checked; the writer's lease check right before is the guard.
        with self.writing(key) as new, open(local_path, "rb") as src, open(new.fd, "wb", closefd=False) as dst:
            crc = Crc64Nvme()
            while chunk := src.read(READ_CHUNK):
                crc.update(chunk)
                dst.write(chunk)
            if checksum is not None and crc.b64 != checksum:
                raise StoreError(
                    f"the bytes copied from {local_path.name} to {key} do not match its expected checksum (crc64nvme "
                    f"{crc.b64} != {checksum}); the source changed or the copy is bad"
                )

    @staticmethod
    def _write_synced(new: NewFile, data: bytes) -> None:
        with open(new.fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writing(key) as new:
            self._write_synced(new, data)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        fd = self._folder_fd(key, create=True)
        assert fd is not None
        try:
            new = self._new_file(fd, key)
            try:
                self._write_synced(new, data)
                try:  # whole, and only if nothing (not even a link) has that name (atomic on POSIX filesystems)
                    os.link(new.tmp, new.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    return False
                return True
            finally:
                os.close(new.fd)
                os.unlink(new.tmp, dir_fd=fd)
        finally:
            os.close(fd)

    def abort_partial_uploads(self, keys: Collection[str] | None = None) -> int:
        """Remove temp files left by a killed writer (a rename never happened, so they are nobody's data): those of
        `keys`, or when None every one under this root except in the folders of other artifacts below it. Only
        blockdraft's temp names (`TMP_PREFIX`) are ever removed."""
        if not self.root.is_dir():
            return 0
        if keys is None:
            leftovers = _own_temp_files(self.root)
            for path in leftovers:
                path.unlink(missing_ok=True)
            return len(leftovers)
        return sum(self._remove_temp_files_of(key) for key in keys)

    def _remove_temp_files_of(self, key: str) -> int:
        """Remove the temp files that writes of `key` leave beside it: `TMP_PREFIX + name` and
        `TMP_PREFIX + name + ".*"`, in its folder opened like `writing` opens it."""
        fd = self._folder_fd(key, create=False)
        if fd is None:
            return 0
        stem, removed = TMP_PREFIX + os.path.basename(key), 0
        try:
            for name in os.listdir(fd):
                if name == stem or name.startswith(stem + "."):
                    try:
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                    except (FileNotFoundError, IsADirectoryError, PermissionError):
                        pass
            return removed
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        fd = self._folder_fd(key, create=False)
        if fd is None:
            return
        try:
            os.unlink(os.path.basename(key), dir_fd=fd)  # a link itself, never its target
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


def _own_temp_files(root: Path) -> list[Path]:
    """Every temp file under `root`, not descending into folders (or symlinks) that are the roots of other artifacts."""
    found = []
    for folder, subdirs, names in os.walk(root):
        here = Path(folder)
        subdirs[:] = [d for d in subdirs if not any((here / d / marker).exists() for marker in ROOT_MARKERS)]
        found += [here / name for name in names if name.startswith(TMP_PREFIX)]
    return found


def _walk(path: str, folder: str, prefix: str) -> Iterator[ObjectInfo]:
    """The files under `path` whose key (`folder` + their path below it) starts with `prefix`: sorted, a folder's files
    before its subfolders, symlinked folders not followed (as `os.walk` goes), and one directory scan plus one stat per
    file."""
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
