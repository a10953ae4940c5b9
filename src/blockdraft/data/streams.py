"""Decompressing a completions file whole or not at all.

A gzip or zstd stream that ends before its end marker was cut short (an interrupted copy or upload); the standard
readers either raise something no user can act on or, for zstd, stop quietly at the cut, so half a file would look like
a whole one. Here every such fault becomes `InputUnreadable`, naming the file and the cause, and the caller drops the
file whole (a caller that does not catch it stops with that one line).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import zstandard

from blockdraft.errors import ConfigError
from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme

ZSTD_READ = 1 << 17  # compressed bytes fed to the decompressor at a time: bounds what one call can expand to


class InputUnreadable(ConfigError):
    """A whole input file `key` that cannot be decoded: cut short (`truncated_input`) or not the format its name says
    (`undecodable_input`). `reason` is the code recorded in the manifest and the quarantine, `detail` one line of
    cause."""

    def __init__(self, reason: str, detail: str, key: str) -> None:
        self.reason, self.detail, self.key = reason, " ".join(detail.split())[:300], key
        super().__init__(f"input {key} cannot be read whole: {reason} ({self.detail}); replace it with a complete copy "
                         "and rerun")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a worker process, re-raised in the parent
        return (type(self), (self.reason, self.detail, self.key))


class CountingReader(io.RawIOBase):
    """Wraps a binary stream positioned at file offset `base`: counts the (compressed) bytes read, for progress by input
    bytes, and checksums (CRC64NVME) those inside `window` = (start, end) in file offsets (end None: to the end of the
    file), so that a task proves which bytes of the input it read without reading them twice."""

    def __init__(self, raw: BinaryIO, base: int = 0, window: tuple[int, int | None] | None = None) -> None:
        self._raw = raw
        self.base = base
        self.bytes_read = 0
        self.window = window
        self.crc = Crc64Nvme()
        self.window_bytes = 0  # how many bytes of the window went into `crc`

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        if self.window is not None and n:
            pos = self.base + self.bytes_read
            start, end = self.window
            lo, hi = max(start - pos, 0), n if end is None else min(end - pos, n)
            if lo < hi:
                self.crc.update(data if (lo, hi) == (0, n) else data[lo:hi])
                self.window_bytes += hi - lo
        self.bytes_read += n
        return n

    def drain(self) -> None:
        """Read what the parser left (a trailer, or the rest of a file that failed to decode), so the window is
        whole."""
        while self.read(READ_CHUNK):
            pass


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file of one or more frames; raises EOFError when the file ends inside a frame
    (zstandard's stream reader returns what it has and ends quietly there)."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressor of the frame being read; None between frames
        self._leftover = b""  # bytes read past the end of the last frame: the start of the next one
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._pos >= len(self._out):
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress_more(self) -> bool:
        chunk, self._leftover = self._leftover or self._source.read(ZSTD_READ), b""
        if not chunk:
            if self._frame is not None:
                raise EOFError("the zstd stream ends inside a frame")
            return False
        if self._frame is None:
            self._frame = self._dctx.decompressobj()
        self._out, self._pos = self._frame.decompress(chunk), 0
        if self._frame.eof:
            self._leftover, self._frame = self._frame.unused_data, None
        return True


def decompressed(reader: BinaryIO, name: str) -> BinaryIO:
    """`reader` decompressed by the suffix of `name` (.gz, .zst; anything else is read as it is), buffered."""
    buffered: BinaryIO = io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[arg-type]
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=buffered)  # type: ignore[return-value]
    if name.endswith(".zst"):
        return io.BufferedReader(ZstdFrames(buffered), buffer_size=1 << 20)  # type: ignore[return-value]
    return buffered


@contextlib.contextmanager
def decoding(key: str) -> Iterator[None]:
    """Turn the errors of gzip and zstd decoding inside the block into `InputUnreadable` for the file `key`."""
    try:
        yield
    except EOFError as exc:
        raise InputUnreadable("truncated_input", "the compressed stream ends before its end marker: the file was cut "
                                                 f"short; {exc}", key) from None
    except (gzip.BadGzipFile, zlib.error, zstandard.ZstdError) as exc:
        raise InputUnreadable("undecodable_input", f"cannot decompress it as its suffix says; {type(exc).__name__}: "
                                                   f"{exc}", key) from None


@contextlib.contextmanager
def decoding_parquet(key: str) -> Iterator[None]:
    """Turn what pyarrow raises for a file that is not Parquet, is cut short or has corrupt pages into
    `InputUnreadable`.

    pyarrow reports corrupt data as an OSError without an errno; one with an errno is the disk's or the network's, not
    the file's, and goes on as it is."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        raise InputUnreadable("undecodable_input", f"cannot read it as Parquet; {type(exc).__name__}: {exc}",
                              key) from None
