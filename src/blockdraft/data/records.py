"""Raw records of one completions file: each line of a JSON Lines file (plain, .gz, .zst), each element of a JSON array,
or each row of a Parquet file, parsed but not yet normalised (`completions.normalise` does that).

A row is never held whole when it is larger than `max_row_bytes` (`tokenize.max_row_bytes`): a longer line is read on in
small chunks to its newline and dropped, a larger Parquet row is never turned into Python objects; either becomes a
record whose `oversize` is set, with only its first `HEAD_BYTES` kept for the quarantine.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from blockdraft.config import MAX_ROW_BYTES
from blockdraft.data.streams import CountingReader, InputUnreadable, decoding, decoding_parquet, decompressed

PARQUET_BATCH_ROWS = 256
ARRAY_READ = 1 << 20  # bytes read at a time from a JSON array
MAX_ARRAY_ELEMENT = 256 << 20  # one element of a JSON array larger than this is refused: use JSON Lines
SKIP_CHUNK = 1 << 20  # bytes read at a time while skipping input: the rest of a line, or up to a part's start
HEAD_BYTES = 256  # what a record keeps of a row too large to hold (for the quarantine)
PARQUET_COLUMNS = (("messages",), ("conversations",), ("prompt_token_ids", "completion_token_ids"),
                   ("prompt_ids", "completion_ids"))


@dataclass
class RawRecord:
    """One row as read: its position in the input (1-based line or row number; None for a line of a plain JSON Lines
    file read from the middle, where `offset` locates it), the parsed object or None, its text, and for a line its byte
    offset in the (decompressed) file. `oversize`: the row's bytes when it is larger than the reader's `max_row_bytes`
    (then `data` is None and `text` holds its start only)."""

    position: int | None
    data: Any
    text: str
    offset: int | None = None
    oversize: int = 0


def iter_records(stream: BinaryIO, key: str, counter: list[int] | None = None, max_row_bytes: int = MAX_ROW_BYTES,
                 conversations: bool = False) -> Iterator[RawRecord]:
    """Every row of one completions file, in order. `key` (its name) selects the format by suffix.

    `stream` is any readable binary file-like (a local file, a store object); Parquet needs it seekable.
    `counter[0]`, when given, is kept equal to the input bytes consumed so far. A file that cannot be read whole (cut
    short, corrupt, not the format its name says; with `conversations`, Parquet without conversation columns) raises
    `InputUnreadable` after the rows before the fault: the caller must drop the whole file, never keep the rows before
    the cut as if they were all of it. A row larger than `max_row_bytes` is an `oversize` record (module doc).
    """
    if key.lower().endswith(".parquet"):
        with decoding_parquet(key):
            yield from _iter_parquet(stream, key, counter, max_row_bytes, conversations)
        return
    yield from iter_counted(CountingReader(stream), key, counter, max_row_bytes)


def iter_counted(
    reader: CountingReader, key: str, counter: list[int] | None = None, max_row_bytes: int = MAX_ROW_BYTES
) -> Iterator[RawRecord]:
    """`iter_records` of a line or JSON-array format read through `reader` (which counts and checksums the raw
    bytes)."""
    with decoding(key):
        buffered = decompressed(reader, key.lower())  # type: ignore[arg-type]
        if starts_as_json_array(buffered):
            yield from _iter_json_array(buffered, reader, key, counter)
            return
        offset = 0
        for lineno, line in enumerate(bounded_lines(buffered, max_row_bytes), 1):
            if counter is not None:
                counter[0] = reader.bytes_read
            start, offset = offset, offset + line.size
            record = record_of_line(lineno, line, start)
            if record is not None:
                yield record


class Line(NamedTuple):
    """One line of a stream: its bytes with its ending (a line over the bound: its first `HEAD_BYTES` only), its size in
    bytes with its ending, and for a line over the bound its bytes before the newline (else 0)."""

    data: bytes
    size: int
    oversize: int = 0


def bounded_lines(buffered: BinaryIO, limit: int, seen: Callable[[bytes], None] | None = None) -> Iterator[Line]:
    """The lines of `buffered`, none held longer than `limit` bytes before its newline: a longer one is read on in
    chunks of `SKIP_CHUNK` to its newline, and given with its first `HEAD_BYTES` only. `seen`, when given, gets every
    byte read, in order (a reader that checksums what lies past a point)."""
    while line := buffered.readline(limit + 1):
        if seen is not None:
            seen(line)
        if len(line) <= limit or line.endswith(b"\n"):
            yield Line(line, len(line))
            continue
        head, size = line[:HEAD_BYTES], len(line)
        del line  # the bounded part read so far: not held while the rest is skipped
        rest, ended = skip_line(buffered, seen)
        yield Line(head, size + rest, size + rest - ended)


def skip_line(buffered: BinaryIO, seen: Callable[[bytes], None] | None = None) -> tuple[int, bool]:
    """Read and drop the rest of the current line, `SKIP_CHUNK` bytes at a time: (bytes read, whether a newline ended
    it)."""
    size = 0
    while chunk := buffered.readline(SKIP_CHUNK):
        if seen is not None:
            seen(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            return size, True
    return size, False


def record_of_line(position: int | None, line: Line, offset: int) -> RawRecord | None:
    """The record of one JSON Lines line (`line_record`, or an `oversize` one), or None for a blank line."""
    if line.oversize:
        return RawRecord(position, None, line.data.decode("utf-8", errors="replace") + "...", offset,
                         oversize=line.oversize)
    if not line.data or line.data.isspace():  # isspace stops at the first non-blank byte; strip would copy the line
        return None
    return line_record(position, line.data, offset)


def starts_as_json_array(buffered: BinaryIO) -> bool:
    """Whether a (decompressed, buffered) stream's first non-blank byte opens a JSON array, without consuming it."""
    peek = getattr(buffered, "peek", None)
    return peek is not None and peek(64)[:64].lstrip().startswith(b"[")


def line_record(position: int | None, line: bytes, offset: int) -> RawRecord:
    """One JSON Lines row: parsed, or `data` None when the line is not JSON (the row is then rejected as `bad_json`)."""
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    try:
        data = loads_row(line)
    except ValueError:
        data = None
    return RawRecord(position, data, text, offset)


def loads_row(text: str | bytes) -> Any:
    """`json.loads`, with JSON nested deeper than Python's parser recurses raised as ValueError like any other row that
    does not parse (`RecursionError` would end the whole run)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to parse") from None


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value that opens at `text[start]` with a bracket ends (the index after its closing bracket), found
    by counting brackets outside strings, without parsing it; None when `text` ends first. For an element the parser
    cannot hold (nested past its recursion limit), so that it is skipped as one bad row."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _iter_json_array(
    buffered: BinaryIO, reader: CountingReader, key: str, counter: list[int] | None
) -> Iterator[RawRecord]:
    """A JSON array, not JSON Lines, streamed one element at a time (memory: about one element, not the file).

    A file that does not parse whole is unreadable (the caller drops it, rows before the fault included); an element
    larger than `MAX_ARRAY_ELEMENT` is refused with a line that suggests JSON Lines."""
    decoder = json.JSONDecoder()
    text_of = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, want, index = "", 0, False, ARRAY_READ, 0

    def more() -> None:
        nonlocal buf, pos, eof
        data = buffered.read(want)
        eof = not data
        buf = buf[pos:] + text_of.decode(data, final=eof)
        pos = 0

    def unreadable(why: str) -> InputUnreadable:
        return InputUnreadable("undecodable_input", f"it starts as a JSON array but does not parse whole: {why}", key)

    def skip_blank() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            more()

    more()
    if skip_blank() != "[":
        raise unreadable("no opening bracket")
    pos += 1
    expect_value = True
    while True:
        c = skip_blank()
        if not expect_value:
            if c == ",":
                pos, expect_value = pos + 1, True
                continue
            if c == "]":
                pos += 1
                if skip_blank():
                    raise unreadable(f"data after the closing bracket, at character {pos}")
                return
            raise unreadable(f"expected ',' or ']' after element {index}" if c else "the file ends inside the array")
        if c == "]" and index == 0:
            expect_value = False
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
            complete = end < len(buf) or eof  # a number cut at the end of what was read would parse short
            text = json.dumps(value, ensure_ascii=False)
        except RecursionError:  # valid JSON nested deeper than the parser recurses: one bad row, skipped whole
            skipped = value_end(buf, pos)
            if skipped is None and eof:
                raise unreadable(f"the file ends inside element {index + 1}") from None
            if skipped is not None:
                head, pos, want, index, expect_value = buf[pos:pos + HEAD_BYTES], skipped, ARRAY_READ, index + 1, False
                if counter is not None:
                    counter[0] = reader.bytes_read
                yield RawRecord(index, None, head + "...")
                continue
            value, end, complete, text = None, 0, False, ""
        except json.JSONDecodeError as exc:
            # Cut by the end of what was read so far (an open string, or an error within a few characters of the end)
            # reads on; an error anywhere else is in the file itself.
            if eof or not (exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - 8):
                raise unreadable(f"{exc.msg} in element {index + 1}") from None
            value, end, complete = None, 0, False
        if not complete:
            if len(buf) - pos > MAX_ARRAY_ELEMENT:
                raise InputUnreadable("undecodable_input", f"element {index + 1} of its JSON array is larger than "
                                      f"{MAX_ARRAY_ELEMENT >> 20} MiB; convert the file to JSON Lines (one row a line)",
                                      key)
            # a large element is read in growing steps, so it is parsed a few times only
            want = min(want * 2, MAX_ARRAY_ELEMENT)
            more()
            continue
        pos, want, index, expect_value = end, ARRAY_READ, index + 1, False
        if counter is not None:
            counter[0] = reader.bytes_read
        yield RawRecord(index, value, text)


def _iter_parquet(
    stream: BinaryIO, key: str, counter: list[int] | None, max_row_bytes: int, conversations: bool
) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(stream, page_checksum_verification=True)  # pages written with a CRC are checked against it
    if conversations:
        check_parquet_columns(pf.schema_arrow.names, key)
    total = pf.metadata.num_rows or 1
    size = stream.seek(0, io.SEEK_END)
    position = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in parquet_records(batch, position, max_row_bytes):
            position += 1
            if counter is not None:
                counter[0] = size * position // total
            yield record


def check_parquet_columns(columns: list[str], key: str) -> None:
    """`InputUnreadable("wrong_schema")` for a Parquet file with none of the column sets a conversation is read from:
    every row of it would be rejected, and the run would end with an empty artifact as if the file held nothing."""
    if not any(all(c in columns for c in wanted) for wanted in PARQUET_COLUMNS):
        shown = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "")
        raise InputUnreadable("wrong_schema", f"its columns ({shown}) hold no conversations: it needs 'messages' or "
                                              "'conversations', or 'prompt_token_ids' and 'completion_token_ids'", key)


def parquet_records(batch: Any, before: int, max_row_bytes: int) -> Iterator[RawRecord]:
    """The rows of one Parquet record batch, positions from `before` + 1. A row whose Arrow data is larger than
    `max_row_bytes` is an `oversize` record: it is never turned into Python objects or JSON text."""
    sizes = [batch.slice(i, 1).nbytes for i in range(batch.num_rows)]
    rows = batch.to_pylist() if max(sizes, default=0) <= max_row_bytes else None
    for i, nbytes in enumerate(sizes):
        position = before + i + 1
        if nbytes > max_row_bytes:
            yield RawRecord(position, None, f"(a Parquet row of {nbytes:,} bytes)", oversize=nbytes)
            continue
        row = rows[i] if rows is not None else batch.slice(i, 1).to_pylist()[0]
        yield RawRecord(position, row, json.dumps(row, ensure_ascii=False, default=str))
