"""One split of one shard as Arrow stream files: rows batched, files rotated once they reach `file_bytes` (or, when
set, `rows_per_file` rows), each renamed into place only when whole."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from blockdraft.data.render import TurnRow
from blockdraft.store.artifact import FileEntry
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.local import TMP_PREFIX

# Rows per Arrow record batch written.
ARROW_BATCH_ROWS = 256


class SplitWriter:
    """Arrow stream files of one split of one shard, renamed only when whole. A file is closed after the record batch
    that brings it to `file_bytes` (so it exceeds that by less than one batch), or at `rows_per_file` rows when set."""

    def __init__(self, split_dir: Path, stem: str, schema: pa.Schema, rows_per_file: int | None, file_bytes: int) -> None:
        self.dir, self.stem, self.schema = split_dir, stem, schema
        self.rows_per_file, self.file_bytes = rows_per_file or (1 << 62), file_bytes
        self.files: list[FileEntry] = []
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._tmp: Path | None = None
        self._rows_in_file = 0
        self._pending: list[tuple[TurnRow, str]] = []

    def add(self, row: TurnRow, source_id: str) -> None:
        self._pending.append((row, source_id))
        if len(self._pending) >= ARROW_BATCH_ROWS or self._rows_in_file + len(self._pending) >= self.rows_per_file:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            if self._writer is None:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._tmp = self.dir / f"{TMP_PREFIX}{self.stem}-part-{len(self.files):03d}.arrow"
                self._writer = pa.ipc.new_stream(str(self._tmp), self.schema)
            assert self._tmp is not None
            room = self.rows_per_file - self._rows_in_file
            chunk, self._pending = self._pending[:room], self._pending[room:]
            self._writer.write_batch(record_batch(chunk, self.schema))
            self._rows_in_file += len(chunk)
            if self._rows_in_file >= self.rows_per_file or self._tmp.stat().st_size >= self.file_bytes:
                self._close_file()

    def _close_file(self) -> None:
        assert self._writer is not None and self._tmp is not None
        self._writer.close()
        final = self.dir / self._tmp.name.removeprefix(TMP_PREFIX)
        os.replace(self._tmp, final)
        size, checksum = crc64nvme_file(final)
        self.files.append(FileEntry(path=f"{self.dir.name}/{final.name}", size=size, checksum=checksum))
        self._writer, self._tmp, self._rows_in_file = None, None, 0

    def close(self) -> list[FileEntry]:
        self._flush()
        if self._writer is not None:
            self._close_file()
        return self.files

    def discard(self) -> list[FileEntry]:
        """Delete every file written so far (an input that failed is dropped whole, a full disk stops the shard); returns
        the files left: none."""
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError:  # its last bytes may not fit either: the file is deleted all the same
                pass
        for path in [self._tmp, *(self.dir / Path(e.path).name for e in self.files)]:
            if path is not None:
                path.unlink(missing_ok=True)
        self.files, self._pending, self._writer, self._tmp = [], [], None, None
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
