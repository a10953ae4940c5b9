"""CRC64NVME full-object checksums, the same value S3 servers compute and return.

S3 encodes the 64-bit CRC as base64 of its 8 big-endian bytes; we keep that spelling everywhere (manifests,
upload headers, HEAD read-backs) so local and remote values compare as plain strings.
"""

from __future__ import annotations

import base64
from pathlib import Path

from awscrt import checksums

READ_CHUNK = 8 * 1024 * 1024


class Crc64Nvme:
    """Streaming CRC64NVME: feed bytes with `update`, read `b64` at the end."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes) -> None:
        self._crc = checksums.crc64nvme(data, self._crc)

    @property
    def value(self) -> int:
        return self._crc

    @property
    def b64(self) -> str:
        return base64.b64encode(self._crc.to_bytes(8, "big")).decode()


def crc64nvme_bytes(data: bytes) -> str:
    crc = Crc64Nvme()
    crc.update(data)
    return crc.b64


def crc64nvme_file(path: str | Path | int) -> tuple[int, str]:
    """(size, base64 checksum) of a local file (a path, or a descriptor it closes), read in chunks."""
    crc = Crc64Nvme()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            crc.update(chunk)
            size += len(chunk)
    return size, crc.b64
