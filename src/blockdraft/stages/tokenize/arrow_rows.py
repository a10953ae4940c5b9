"""One split of one shard as Arrow stream files: rows batched, files rotated once they reach `file_bytes` (or, when
set, `rows_per_file` rows), each renamed into place only when whole."""

from __future__ import annotations

import errno
from contextlib import ExitStack
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from blockdraft.data.render import TurnRow
from blockdraft.store.artifact import FileEntry
from blockdraft.store.local import LocalStore

# Rows per Arrow record batch written.
ARROW_BATCH_ROWS = 256


def written_entry(store: LocalStore, key: str) -> FileEntry:
    """The manifest entry of the file a `store.writing` block just renamed into place at `key`: its size and checksum as
    read back from the folder, opened as it was written."""
    read = store.read_checksum(key)
    if read is None:
        raise FileNotFoundError(errno.ENOENT, "no regular file there right after its rename", str(store.root / key))
    return FileEntry(path=key, size=read[0], checksum=read[1])


class _Discarded(Exception):
    """Ends a file's `LocalStore.writing` block without its rename: the store removes the temp file."""


class SplitWriter:
    """Arrow stream files of one split of one shard, renamed only when whole. A file is closed after the record batch
    that brings it to `file_bytes` (so it exceeds that by less than one batch), or at `rows_per_file` rows when set.

    Every file is written through `store.writing` (the split folder opened one name at a time without following a link,
    the file created there under a new temp name and renamed within that same opened folder), so a link planted at the
    split folder is refused as resolving outside the output and nothing is written through one. There is no check before
    the use: the folder opened is the one the file is made and renamed in. pyarrow writes into the open file object,
    never by path."""

    def __init__(self, store: LocalStore, split: str, stem: str, schema: pa.Schema, rows_per_file: int | None,
                 file_bytes: int) -> None:
        self.store, self.split, self.stem, self.schema = store, split, stem, schema
        self.rows_per_file, self.file_bytes = rows_per_file or (1 << 62), file_bytes
        self.files: list[FileEntry] = []
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._file: ExitStack | None = None  # the open file's `writing` block and its file object
        self._sink: BinaryIO | None = None
        self._key = ""
        self._rows_in_file = 0
        self._pending: list[tuple[TurnRow, str]] = []

    @property
    def bytes_written(self) -> int:
        """Bytes in this split's files so far, the one being written included."""
        return sum(e.size for e in self.files) + (self._sink.tell() if self._sink is not None else 0)

    def add(self, row: TurnRow, source_id: str) -> None:
        self._pending.append((row, source_id))
        if len(self._pending) >= ARROW_BATCH_ROWS or self._rows_in_file + len(self._pending) >= self.rows_per_file:
            self._flush()

    def _open_file(self) -> None:
        self._key = f"{self.split}/{self.stem}-part-{len(self.files):03d}.arrow"
        with ExitStack() as stack:
            new = stack.enter_context(self.store.writing(self._key))
            self._sink = stack.enter_context(open(new.fd, "wb", closefd=False))
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
            self._file = stack.pop_all()

    def _flush(self) -> None:
        while self._pending:
            if self._writer is None:
                self._open_file()
            assert self._writer is not None and self._sink is not None
            room = self.rows_per_file - self._rows_in_file
            chunk, self._pending = self._pending[:room], self._pending[room:]
            self._writer.write_batch(record_batch(chunk, self.schema))
            self._rows_in_file += len(chunk)
            if self._rows_in_file >= self.rows_per_file or self._sink.tell() >= self.file_bytes:
                self._close_file()

    def _close_file(self) -> None:
        assert self._writer is not None and self._file is not None
        self._writer.close()
        # flushes the file object, then renames the temp file into place in the folder it was made in
        self._file.close()
        self._writer, self._file, self._sink, self._rows_in_file = None, None, None, 0
        self.files.append(written_entry(self.store, self._key))

    def close(self) -> list[FileEntry]:
        self._flush()
        if self._writer is not None:
            self._close_file()
        return self.files

    def discard(self) -> list[FileEntry]:
        """Delete every file written so far (an input that failed is dropped whole, a full disk stops the shard);
        returns the files left: none. A link planted on the way is refused by the store as on writing: nothing is
        removed through it."""
        if self._file is not None:
            if self._writer is not None:
                try:
                    self._writer.close()
                except OSError:  # its last bytes may not fit either: the file is deleted all the same
                    pass
            self._file.__exit__(_Discarded, _Discarded(), None)  # closes the file and removes the temp file
        files, self.files, self._pending, self._writer, self._file, self._sink = self.files, [], [], None, None, None
        for entry in files:
            self.store.delete(entry.path)
        return self.files


def record_batch(rows: list[tuple[TurnRow, str]], schema: pa.Schema) -> pa.RecordBatch:
    lengths = np.fromiter((len(r.input_ids) for r, _ in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    supervised = np.fromiter((int(r.loss_mask.sum()) for r, _ in rows), dtype=np.int32, count=len(rows))
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate([r.input_ids for r, _ in rows])))
    mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate([r.loss_mask for r, _ in rows])))
    columns = [
        ids,
        mask,
        pa.array(lengths.astype(np.int32)),
        pa.array(supervised),
        pa.array([s for _, s in rows], type=pa.string()),
        pa.array(np.fromiter((r.turn for r, _ in rows), dtype=np.int32, count=len(rows))),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)
