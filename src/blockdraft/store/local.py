"""The embedded default store: a local folder, with the same keys, manifests and verification as S3."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from blockdraft.errors import StoreError
from blockdraft.store.base import ObjectInfo, Store
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.checksum_cache import file_checksum

TMP_PREFIX = ".tmp-"


class LocalStore(Store):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.url = "file://" + str(self.root)

    def child(self, key_prefix: str) -> LocalStore:
        return LocalStore(self.root / key_prefix)

    def local_path(self) -> Path:
        return self.root

    def _path(self, key: str) -> Path:
        return self.root / key

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.startswith(TMP_PREFIX):
                    continue  # an unfinished write, not an object
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    yield ObjectInfo(key=key, size=path.stat().st_size)

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        if not path.is_file():
            return None
        # A folder has no checksum metadata: the read-back is the check (docs/STORE.md), once per byte: a file unchanged
        # since it was last read (size, mtime, inode) keeps the checksum computed then (`checksum_cache`).
        size, checksum = file_checksum(path)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def checksum_by_reading(self, key: str) -> tuple[int, str]:
        """Every byte read (no cache): what `--deep` asks for."""
        return crc64nvme_file(self._path(key))

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def _atomic_target(self, key: str) -> tuple[Path, Path]:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
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

    def abort_partial_uploads(self) -> int:
        """Remove temp files left by a killed writer (a rename never happened, so they are nobody's data)."""
        if not self.root.is_dir():
            return 0
        leftovers = [p for p in self.root.rglob(TMP_PREFIX + "*") if p.is_file()]
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
