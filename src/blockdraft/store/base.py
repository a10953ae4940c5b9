"""The store interface: a flat key space under one root URL (a local folder or an S3 prefix).

Artifacts, manifests and verification (`blockdraft.store.artifact`) are written once against this interface;
each backend only moves bytes and reports what is at the destination.
"""

from __future__ import annotations

import abc
import os
import uuid
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme

# Every name blockdraft keeps beside an artifact's files (its lease, a copy's origin, piece records, a pull's incoming
# folder, temporary files) starts with this, so a writer tells its own bookkeeping from a user's files by name alone.
BOOKKEEPING_PREFIX = ".blockdraft-"
# A file being written: `TMP_PREFIX + final name + "." + random` (or + final name alone, where one writer owns the
# name), renamed when whole. A name only blockdraft creates, so cleaning up temp files never touches a user's file.
TMP_PREFIX = BOOKKEEPING_PREFIX + "tmp-"
# At the root of an output a stage has begun to write and not committed yet: which kind it is making. It says the files
# there are an earlier run's of that kind, so a rerun may resume over them; removed once the manifest is written.
WRITING_NAME = BOOKKEEPING_PREFIX + "writing.json"
# The lease of an output's one writer (`output.Lease`), at its root while a run writes it.
LEASE_NAME = BOOKKEEPING_PREFIX + "lease.json"
# What only an artifact's own root holds (its manifest, its writer's lease, the mark of a stage writing it; the names of
# `artifact.MANIFEST_NAME`, `LEASE_NAME` and `WRITING_NAME`): a folder below a writer's root that holds one is
# another artifact's, whose files that writer never touches.
ROOT_MARKERS = ("blockdraft-manifest.json", LEASE_NAME, WRITING_NAME)


def is_bookkeeping(key: str) -> bool:
    """Whether `key` (relative, '/'-separated) is blockdraft's bookkeeping: a part of its path is a name only it
    creates."""
    return any(part.startswith(BOOKKEEPING_PREFIX) for part in key.split("/"))


_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NewFile:
    """A file being written at one key of a LocalStore (`LocalStore.writing`): created under a temp name in the key's
    folder, which is held open (`dir_fd`), so the rename into place happens in that same folder whatever is swapped in
    on the way."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.dir_fd, self.name = dir_fd, name
        self.tmp = f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}"
        self.fd = os.open(self.tmp, _NEW_FILE_FLAGS, 0o644, dir_fd=dir_fd)

    def reopen(self, flags: int) -> int:
        """Another descriptor of the temp file (an O_DIRECT one), opened in the same held folder."""
        return os.open(self.tmp, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)


class LocalFolder(Protocol):
    """Where a download lands: a local store's `writing` (`LocalStore`)."""

    def writing(self, key: str) -> AbstractContextManager[NewFile]: ...


ABSENT = ""  # `put_file(over=ABSENT)`: write only where no object is


@dataclass(frozen=True)
class ObjectInfo:
    """What the destination says about one object. `checksum` is base64 CRC64NVME, or None when it has none."""

    key: str
    size: int
    checksum: str | None = None
    etag: str | None = None


class Store(abc.ABC):
    """Objects addressed by keys relative to `url` ('a/b.arrow'), '/'-separated."""

    url: str

    @abc.abstractmethod
    def child(self, key_prefix: str) -> Store:
        """A store rooted at `url/key_prefix`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, recursively, sizes included (checksums may be None)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and checksum as read from the destination, or None if the object is absent.

        A backend that cannot get the checksum from metadata returns checksum None; callers then read
        the object back (`checksum_by_reading`) and never count an absent checksum as a match.
        """

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A binary stream of the object's bytes; raises FileNotFoundError if absent."""

    @abc.abstractmethod
    def put_file(self, key: str, local_path: Path, checksum: str | None = None, over: str | None = None) -> None:
        """Upload a whole local file; appears at `key` only when complete. `checksum` lets the server reject corruption.
        `over`, where the store has conditional writes (S3): the object appears only if `key` still holds the object of
        that etag (ABSENT: none), else StoreError and nothing is replaced, so a writer that lost its lease while it
        uploaded cannot replace what the new writer committed."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; absent is not an error."""

    @abc.abstractmethod
    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write a small object only if no object has that key (an atomic create: O_EXCL, or S3's `If-None-Match: *`);
        False when one exists. The one primitive that lets two writers agree on who owns an output (`output.Lease`)."""

    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def checksum_by_reading(self, key: str) -> tuple[int, str]:
        """(size, checksum) recomputed from the bytes read back from the destination."""
        crc = Crc64Nvme()
        size = 0
        with self.open_read(key) as f:
            while chunk := f.read(READ_CHUNK):
                crc.update(chunk)
                size += len(chunk)
        return size, crc.b64

    def get_file(self, key: str, into: LocalFolder, as_key: str) -> tuple[int, str]:
        """Download to `as_key` of the local folder `into`, atomically (`LocalStore.writing`: a temp name renamed when
        whole, no link followed on the way).

        Returns (size, base64 CRC64NVME) of the bytes as received, for the caller to compare with the manifest.
        """
        crc = Crc64Nvme()
        size = 0
        with into.writing(as_key) as new, self.open_read(key) as src, open(new.fd, "wb", closefd=False) as dst:
            while chunk := src.read(READ_CHUNK):
                crc.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return size, crc.b64

    def abort_partial_uploads(self, keys: Collection[str] | None = None) -> int:
        """Drop this writer's unfinished uploads (S3 multipart uploads, local temp files) of `keys`, or when None of
        every key under this root outside the roots of other artifacts below it; returns how many. Nothing to do by
        default."""
        return 0

    def parent(self) -> Store | None:
        """The store one folder up, or None at the top (a filesystem's root, a bucket's)."""
        return None

    def local_path(self) -> Path | None:
        """The folder behind a local store; None for remote stores."""
        return None
