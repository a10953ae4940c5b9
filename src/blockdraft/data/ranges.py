"""One task's share of a completions file, so that one large input keeps several workers busy (docs/TOKENIZATION.md,
"Tasks"): where a file is cut (`split_file`), and the rows one part owns with the checksum of the raw bytes it read
(`RangeReader`).

A part is a `ReadRange` of one of four kinds:

- `whole`: every row of the file; the checksum covers the whole file (what the parser leaves is read too).
- `lines`: bytes [start, end) of a plain (uncompressed) JSON Lines file. The part owns the lines that start inside its
  range: it seeks to start - 1 and, unless that byte ends a line, skips the rest of the line it lands in; it reads on
  past `end` to finish its last line. It checksums exactly [start, end), so the parts' checksums combine into the
  file's.
- `stream`: decompressed bytes [start, end) of a .gz or .zst JSON Lines file (end None: to the end), owned the same way.
  A compressed stream cannot be entered in the middle, so the part decompresses from the file's start and skips the
  bytes before `start` (decompressing is about 100x faster than tokenizing; `MAX_STREAM_PARTS` bounds what the skipping
  costs) and counts the lines it skips, so positions stay the file's line numbers. It checksums the raw bytes it read;
  the last part reads the whole file, so it is the one that finds a cut or corrupt stream and checksums the file.
- `row_groups`: Parquet row groups [start, end); it checksums the raw bytes [crc_start, crc_end), which tile the file.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, BinaryIO

from awscrt import checksums

from blockdraft.config import MAX_ROW_BYTES
from blockdraft.data.records import (
    PARQUET_BATCH_ROWS,
    SKIP_CHUNK,
    RawRecord,
    bounded_lines,
    check_parquet_columns,
    iter_counted,
    iter_records,
    parquet_records,
    record_of_line,
    skip_line,
    starts_as_json_array,
)
from blockdraft.data.streams import CountingReader, InputUnreadable, decoding, decoding_parquet, decompressed
from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme, crc64nvme_bytes

# A compressed stream is cut into at most this many parts: part k decompresses the k parts before its own, so the whole
# file is decompressed about MAX_STREAM_PARTS / 2 times over (a few % of the tokenizing time at 16).
MAX_STREAM_PARTS = 16
# Compressed bytes decompressed from a file's start to estimate its ratio.
RATIO_SAMPLE = 1 << 20
# A compressed file of at most task_bytes / COMPRESSED_MIN bytes is read whole, unopened here (it would take better than
# 8x compression to hold more than task_bytes: at worst one task is larger).
COMPRESSED_MIN = 8


@dataclass(frozen=True)
class ReadRange:
    """Which rows of one input file a task owns (kinds in the module doc); `end` None: to the end of the file."""

    kind: str = "whole"
    start: int = 0
    end: int | None = None
    first_row: int = 0  # row_groups: rows in the groups before `start`
    crc_start: int = 0  # row_groups: the raw bytes this part checksums
    crc_end: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Opener = Callable[[], AbstractContextManager[BinaryIO]]


def split_file(open_read: Opener, key: str, size: int, task_bytes: int) -> list[tuple[ReadRange, int]]:
    """The parts of file `key` (`size` bytes) for tasks of at most about `task_bytes` input bytes, each with its share
    of the file's bytes (for progress; the shares add up to `size`).

    A file is cut into a power-of-two number of equal parts, so that one file spreads evenly over 2, 4, 8, ... workers.
    What cannot be cut is one `whole` part: a file of at most `task_bytes` (decompressed, for .gz/.zst: estimated from
    the file's first MiB when it is larger than `task_bytes / COMPRESSED_MIN`), a JSON array, Parquet with one row
    group, a file whose start does not decode (the worker then reports it as unreadable).
    """
    name = key.lower()
    if size <= (task_bytes // COMPRESSED_MIN if name.endswith((".gz", ".zst")) else task_bytes):
        return [(ReadRange(), size)]
    try:
        with open_read() as stream:
            if name.endswith(".parquet"):
                return _split_parquet(stream, key, size, task_bytes)
            if name.endswith((".gz", ".zst")):
                return _split_stream(stream, key, size, task_bytes)
            if stream.read(64).lstrip().startswith(b"["):
                return [(ReadRange(), size)]  # a JSON array is read by one task, streamed
            n = _parts(size, task_bytes)
            bounds = [size * k // n for k in range(n + 1)]
            return [(ReadRange("lines", a, b), b - a) for a, b in pairwise(bounds)]
    except InputUnreadable:
        return [(ReadRange(), size)]


def _parts(nbytes: int, task_bytes: int) -> int:
    n = 1
    while nbytes > n * task_bytes:
        n *= 2
    return n


def _shares(size: int, n: int) -> list[int]:
    return [b - a for a, b in pairwise(size * k // n for k in range(n + 1))]


def _split_stream(stream: BinaryIO, key: str, size: int, task_bytes: int) -> list[tuple[ReadRange, int]]:
    with decoding(key):
        if starts_as_json_array(decompressed(CountingReader(stream), key.lower())):  # type: ignore[arg-type]
            return [(ReadRange(), size)]
        estimate = _decompressed_size(stream, key.lower(), size)
    n = min(MAX_STREAM_PARTS, _parts(estimate, task_bytes))
    if n == 1:
        return [(ReadRange(), size)]
    step = -(-estimate // n)
    parts = [ReadRange("stream", k * step, (k + 1) * step if k < n - 1 else None) for k in range(n)]
    return list(zip(parts, _shares(size, n), strict=True))


def _decompressed_size(stream: BinaryIO, name: str, size: int) -> int:
    """An estimate of a compressed file's decompressed size, from the file alone (so every run cuts it alike): the
    compressed size times the ratio of its first `RATIO_SAMPLE` bytes; for gzip, the trailer's size modulo 2**32 lifted
    by the multiple of 2**32 nearest that. (A zstd frame header's size would name its first frame only.) A wrong
    estimate only unbalances the parts (the last one reads whatever lies beyond); each still reads right."""
    stream.seek(0)
    head = stream.read(RATIO_SAMPLE)
    if name.endswith(".zst"):
        sampled = int(size * _zstd_ratio(head))
    else:
        decomp = zlib.decompressobj(31)
        out = len(decomp.decompress(head, 64 << 20))
        sampled = int(size * out / max(len(head) - len(decomp.unconsumed_tail) - len(decomp.unused_data), 1))
        stream.seek(size - 4)
        isize = struct.unpack("<I", stream.read(4))[0]
        return min((isize + j * (1 << 32) for j in range(1 << 8)), key=lambda n: abs(n - sampled))
    return max(sampled, size)


def _zstd_ratio(head: bytes) -> float:
    """Decompressed bytes per compressed byte over the start of a zstd file (at most 64 MiB decompressed)."""
    import zstandard

    source = io.BytesIO(head)
    out = 0
    with zstandard.ZstdDecompressor().stream_reader(source, read_size=1 << 14, read_across_frames=True,
                                                    closefd=False) as reader:
        while out < 64 << 20 and (chunk := reader.read(1 << 20)):
            out += len(chunk)
    return out / max(source.tell(), 1)


def _split_parquet(stream: BinaryIO, key: str, size: int, task_bytes: int) -> list[tuple[ReadRange, int]]:
    import pyarrow.parquet as pq

    with decoding_parquet(key):
        meta = pq.ParquetFile(stream).metadata
    offsets, rows = [], []
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        columns = [group.column(c) for c in range(group.num_columns)]
        firsts = [
            c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
            for c in columns
        ]
        offsets.append(min(firsts) if firsts else 0)
        rows.append(group.num_rows)
    if len(offsets) < 2 or offsets[0] < 4 or any(b <= a for a, b in pairwise(offsets)) or offsets[-1] >= size:
        return [(ReadRange(), size)]  # one row group, or a layout this cut does not expect: read whole
    target = size / _parts(size, task_bytes)
    cuts = [0]  # the first row group of each part
    for i in range(1, len(offsets)):
        if offsets[i] - offsets[cuts[-1]] >= target:
            cuts.append(i)
    bounds = [0, *(offsets[i] for i in cuts[1:]), size]
    out = []
    for j, first in enumerate(cuts):
        last = cuts[j + 1] if j + 1 < len(cuts) else len(offsets)
        part = ReadRange("row_groups", first, last, sum(rows[:first]), bounds[j], bounds[j + 1])
        out.append((part, bounds[j + 1] - bounds[j]))
    return out if len(out) > 1 else [(ReadRange(), size)]


class RangeReader:
    """The rows of one part of file `key` (`size` bytes) read from `stream`, once.

    After `finish()`, `window` (file offsets) and `crc` (base64 CRC64NVME) say which raw bytes were read and checksummed
    (None: not checksummed, when `checksum` is False for Parquet whose checksum is known from its listing): the windows
    of a file's parts tile it, so their checksums combine into the file's. `reads` lists (start, end, crc) of every raw
    byte range the part's rows depend on (a `lines` part also on the byte before its range and the end of its last line,
    a Parquet part also on the footer): a resumed part is checked against them.
    `rows_before`: rows of the file before this part's first (for a part that fails midway, the rows read before the
    fault). A row larger than `max_row_bytes` is never held whole (`blockdraft.data.completions`, `oversize` records).
    """

    def __init__(self, stream: BinaryIO, key: str, size: int, part: ReadRange, checksum: bool = True,
                 max_row_bytes: int = MAX_ROW_BYTES) -> None:
        self.stream, self.key, self.size, self.part, self.checksum = stream, key, size, part, checksum
        self.max_row_bytes = max_row_bytes
        self.window: tuple[int, int] | None = None
        self.crc: str | None = None
        self.reads: list[tuple[int, int, str]] = []
        self.rows_before = part.first_row
        self._reader: CountingReader | None = None
        self._previous = b""  # a `lines` part: the byte before its range
        self._tail = _Past(0, 0)  # a `lines` part: its last line's bytes past its range, checksummed as they are read
        self._counter = [0]
        self._done = 0.0

    def records(self) -> Iterator[RawRecord]:
        kind = self.part.kind
        if kind == "whole":
            if self.key.lower().endswith(".parquet"):
                yield from iter_records(self.stream, self.key, self._counter, self.max_row_bytes, conversations=True)
                return
            self._reader = CountingReader(self.stream, 0, (0, None))
            yield from iter_counted(self._reader, self.key, self._counter, self.max_row_bytes)
        elif kind == "lines":
            yield from self._lines()
        elif kind == "stream":
            yield from self._stream()
        else:
            yield from self._row_groups()

    def fraction(self) -> float:
        """How much of this part is read, 0 to 1 (progress)."""
        if self.part.kind == "whole":
            return min(self._counter[0] / max(self.size, 1), 1.0)
        return min(self._done, 1.0)

    def _lines(self) -> Iterator[RawRecord]:
        start, end = self.part.start, self.part.end
        assert end is not None
        base = max(start - 1, 0)
        self.stream.seek(base)
        self._reader = CountingReader(self.stream, base, (start, end))
        buffered = io.BufferedReader(self._reader, buffer_size=1 << 20)  # type: ignore[arg-type]
        # Its last line's bytes past `end` decide its rows too: every byte of the lines it reads passes `_tail`.
        self._tail = _Past(base, end)
        offset = base
        if start > 0:
            self._previous = buffered.read(1)
            self._tail.feed(self._previous)
            offset += len(self._previous)
            if self._previous != b"\n":  # landed inside a line: it belongs to the part before
                offset += skip_line(buffered, self._tail.feed)[0]
        lines = bounded_lines(buffered, self.max_row_bytes, self._tail.feed)
        lineno = 0
        while offset < end and (line := next(lines, None)) is not None:  # a line starting past `end` is not read
            line_start, offset = offset, offset + line.size
            lineno += 1
            self._done = (offset - start) / (end - start)
            # A line number is known only counting from the file's start; elsewhere `offset` locates the line.
            record = record_of_line(lineno if start == 0 else None, line, line_start)
            if record is not None:
                yield record

    def _stream(self) -> Iterator[RawRecord]:
        start, end = self.part.start, self.part.end
        self._reader = CountingReader(self.stream, 0, (0, None))
        with decoding(self.key):
            buffered = decompressed(self._reader, self.key.lower())  # type: ignore[arg-type]
            offset = newlines = 0
            if start > 0:
                while offset < start - 1 and (chunk := buffered.read(min(start - 1 - offset, SKIP_CHUNK))):
                    offset, newlines = offset + len(chunk), newlines + chunk.count(b"\n")
                    self.rows_before = newlines
                previous = buffered.read(1) if offset == start - 1 else b""
                offset += len(previous)
                if previous and previous != b"\n":
                    skipped, ended = skip_line(buffered)
                    offset, newlines = offset + skipped, newlines + ended
                newlines += previous == b"\n"
            self.rows_before = newlines
            lines = bounded_lines(buffered, self.max_row_bytes)
            while (end is None or offset < end) and (line := next(lines, None)) is not None:
                line_start, offset = offset, offset + line.size
                newlines += 1
                self._done = (
                    (offset - start) / (end - start) if end is not None else self._reader.bytes_read / max(self.size, 1)
                )
                record = record_of_line(newlines, line, line_start)
                if record is not None:
                    yield record

    def _row_groups(self) -> Iterator[RawRecord]:
        import pyarrow.parquet as pq

        groups = list(range(self.part.start, self.part.end or 0))
        position = self.part.first_row
        with decoding_parquet(self.key):
            pf = pq.ParquetFile(self.stream, page_checksum_verification=True)
            check_parquet_columns(pf.schema_arrow.names, self.key)
            total = max(sum(pf.metadata.row_group(g).num_rows for g in groups), 1)
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups):
                for record in parquet_records(batch, position, self.max_row_bytes):
                    position += 1
                    self._done = (position - self.part.first_row) / total
                    yield record

    def finish(self) -> None:
        """Complete the checksum (after the rows, or after a fault): a `whole` or last `stream` part reads the rest of
        the file; a Parquet part reads its byte window in one sequential pass."""
        part = self.part
        if self._reader is not None:
            if part.kind == "whole" or (part.kind == "stream" and part.end is None):
                self._reader.drain()
            reader = self._reader
            start = part.start if part.kind == "lines" else 0
            self.window, self.crc = (start, start + reader.window_bytes), reader.crc.b64
            self.reads = [(*self.window, self.crc)]
            if part.kind == "lines" and self.window[1] == part.end:
                tail = self._tail
                pieces = [(crc64nvme_bytes(self._previous), len(self._previous)), (self.crc, self.window[1] - start),
                          (tail.crc.b64, tail.length)]
                self.reads = [(start - len(self._previous), self.window[1] + tail.length, crc_concat(pieces))]
            return
        if not self.checksum:
            return
        start, end = (part.crc_start, part.crc_end) if part.kind == "row_groups" else (0, self.size)
        self.window, self.crc = (start, end), range_crc(self.stream, start, end)
        self.reads = [(start, end, self.crc)] if self.crc else []
        if end < self.size and self.crc:  # the footer, which every row group part reads
            self.stream.seek(self.size - 8)
            footer = self.size - 8 - int.from_bytes(self.stream.read(4), "little")
            footer_crc = range_crc(self.stream, footer, self.size)
            self.reads.append((footer, self.size, footer_crc or ""))


class _Past:
    """Checksums the bytes fed to it, in file order from offset `pos`, that lie at or past file offset `end`."""

    def __init__(self, pos: int, end: int) -> None:
        self.pos, self.end, self.length, self.crc = pos, end, 0, Crc64Nvme()

    def feed(self, data: bytes) -> None:
        skip = max(self.end - self.pos, 0)
        if skip < len(data):
            self.crc.update(data[skip:] if skip else data)
            self.length += len(data) - skip
        self.pos += len(data)


def crc_concat(parts: list[tuple[str, int]]) -> str:
    """The CRC64NVME of consecutive byte ranges from theirs: [(base64 CRC, length), ...] in order (no reading)."""
    total = 0
    for crc, length in parts:
        total = checksums.combine_crc64nvme(total, int.from_bytes(base64.b64decode(crc), "big"), length)
    return base64.b64encode(total.to_bytes(8, "big")).decode()


def range_crc(stream: BinaryIO, start: int, end: int) -> str | None:
    """CRC64NVME of bytes [start, end) of a seekable stream; None when the stream ends before `end`."""
    stream.seek(start)
    crc, left = Crc64Nvme(), end - start
    while left > 0 and (chunk := stream.read(min(left, READ_CHUNK))):
        crc.update(chunk)
        left -= len(chunk)
    return crc.b64 if left == 0 else None


__all__ = ["MAX_STREAM_PARTS", "RangeReader", "ReadRange", "crc_concat", "range_crc", "split_file"]
