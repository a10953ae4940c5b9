"""One shard, in one worker process: an input file -> its Arrow files, its quarantine file and, last, its piece record.

A finished shard is a piece of the output (`StageOutput.put_piece`, written after its files), keyed by `piece_key`:
the run's config digest and the input file's key, size and checksum. Its counts hold the shard's row statistics
(`stats`) and its Arrow files per split in the order written (`split_files`).

A worker streams: it holds one batch of `CONVERSATION_BATCH` conversations and at most `ARROW_BATCH_ROWS` pending rows
per split, so its memory does not grow with the shard or the dataset. The tokenizer and compiled template are built
once per process (`install_tools`), never shipped with each task.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from blockdraft.config import StoreConfig
from blockdraft.data.completions import RawRecord, RowRejected, iter_records, normalise, source_id_of
from blockdraft.data.render import (
    ChatTemplate,
    PlannedTurn,
    TurnRejection,
    TurnRow,
    compile_chat_template,
    mask_turn,
    plan_turns,
    row_from_generator_ids,
)
from blockdraft.errors import ArtifactError
from blockdraft.stages.tokenize.hf_layout import KIND, QUARANTINE_DIR, SPLITS
from blockdraft.store import open_store
from blockdraft.store.artifact import FileEntry
from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme, crc64nvme_file
from blockdraft.store.local import TMP_PREFIX, LocalStore
from blockdraft.store.stage_io import StageOutput, stage_key

# Part of the config digest: bump it when the rows' bytes change for the same options, so old shards are redone.
SHARD_FORMAT = "blockdraft-tokenize-shard/1"
# Conversations rendered and encoded together; small enough that a worker's memory stays flat.
CONVERSATION_BATCH = 32
# Rows per Arrow record batch written.
ARROW_BATCH_ROWS = 256
# What clipping to max_length cut off, in every piece's stats: rows clipped, tokens dropped, supervised tokens dropped.
CLIP_KEYS = ("rows_clipped", "tokens_clipped", "supervised_tokens_clipped")
_PR_SET_PDEATHSIG = 1
# progress(input bytes consumed, rows written, tokens written): deltas since the last call.
Advance = Callable[[int, int, int], None]


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs for one shard besides the tokenizer and template (installed once per process, `tools_key`)."""

    tools_key: str
    thinking: str
    max_length: int
    held_out_fraction: float
    rows_per_file: int
    eot_id: int
    vocab_size: int
    config_digest: str
    input_url: str
    store: StoreConfig
    output_dir: str
    output_key: str  # the run's stage key (its StageOutput's)
    schema: pa.Schema


@dataclass(frozen=True)
class ShardTask:
    """One input file: `name` (shard-00003) names its outputs and its piece."""

    index: int
    name: str
    key: str
    size: int
    checksum: str


def piece_key(config_digest: str, task: ShardTask) -> str:
    """What a finished shard depends on: the run's config digest and its input file as listed (key, size, checksum)."""
    return stage_key({"config_digest": config_digest, "input": {"key": task.key, "size": task.size, "checksum": task.checksum}})


@dataclass(frozen=True)
class ShardOutput:
    """One finished shard as its piece records it: every file it made (Arrow and quarantine) and its piece counts,
    {"stats": row counts (rows_in, rows_out, tokens, rejected by reason, ...), "split_files": {split: [path, ...]}}."""

    name: str
    files: list[FileEntry]
    counts: dict[str, Any]

    @property
    def stats(self) -> dict[str, Any]:
        return self.counts["stats"]

    def arrow_files(self) -> list[tuple[str, str]]:
        """(path, checksum) of its Arrow files in the order written: train then held_out, parts in order."""
        checksums = {e.path: e.checksum for e in self.files}
        return [(path, checksums[path]) for split in SPLITS for path in self.counts["split_files"][split]]


@dataclass(frozen=True)
class ShardRun:
    """A shard tokenized by this run: what it holds, and the worker's wall and CPU seconds and peak resident MiB for it."""

    output: ShardOutput
    seconds: float
    cpu_seconds: float
    peak_rss_mib: float


def is_held_out(source_id: str, fraction: float) -> bool:
    """Deterministic split by conversation: the first 8 bytes of sha256(source_id) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(source_id.encode()).digest()[:8], "big")
    return h < fraction * 2**64


class _SplitWriter:
    """Arrow stream files of one split of one shard, rotated every `rows_per_file` rows, renamed only when whole."""

    def __init__(self, split_dir: Path, stem: str, schema: pa.Schema, rows_per_file: int) -> None:
        self.dir, self.stem, self.schema, self.rows_per_file = split_dir, stem, schema, rows_per_file
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
            room = self.rows_per_file - self._rows_in_file
            chunk, self._pending = self._pending[:room], self._pending[room:]
            self._writer.write_batch(_record_batch(chunk, self.schema))
            self._rows_in_file += len(chunk)
            if self._rows_in_file >= self.rows_per_file:
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


def _record_batch(rows: list[tuple[TurnRow, str]], schema: pa.Schema) -> pa.RecordBatch:
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


class _ShardCounts:
    def __init__(self) -> None:
        self.c: Counter[str] = Counter(dict.fromkeys(CLIP_KEYS, 0))  # always recorded, so a piece without them is older
        self.rejected: Counter[str] = Counter()
        self.thinking: Counter[str] = Counter()

    def add_row(self, split: str, row: TurnRow) -> None:
        """A row written to `split`; a clipped one also adds what `max_length` cut off it (see `TurnRow`)."""
        self.c.update({"rows_out": 1, f"{split}_rows": 1, "tokens": len(row.input_ids), "supervised_tokens": int(row.loss_mask.sum())})
        self.thinking[row.thinking] += 1
        if row.clipped_tokens:
            self.c.update({"rows_clipped": 1, "tokens_clipped": row.clipped_tokens, "supervised_tokens_clipped": row.clipped_supervised})

    def as_dict(self) -> dict[str, Any]:
        return {**dict(self.c), "rejected": dict(self.rejected), "thinking": dict(self.thinking)}


WORKER: dict[str, Any] = {}


def tools_key(tokenizer_sha256: str, template: ChatTemplate) -> str:
    return hashlib.sha256(json.dumps([tokenizer_sha256, template.sha256, template.variables], sort_keys=True).encode()).hexdigest()


def install_tools(tokenizer_json: str, template_text: str, variables: dict[str, str]) -> None:
    """Build this process's tokenizer and compiled template once (a pool worker does it while the parent lists inputs)."""
    template = compile_chat_template(template_text, variables)
    key = tools_key(hashlib.sha256(tokenizer_json.encode()).hexdigest(), template)
    if WORKER.get("key") != key:
        WORKER["tools"], WORKER["key"] = (Tokenizer.from_str(tokenizer_json), template), key


def worker_init(progress_queue: Any, parent_pid: int, tokenizer_json: str, template_text: str, variables: dict[str, str]) -> None:
    # The tokenizer's own thread pool deadlocks in forked children and does not scale on few cores: one process = one core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    WORKER["queue"] = progress_queue
    if sys.platform == "linux":
        # A worker must not outlive a killed parent: it would keep writing shard files under a rerun's feet.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the line above took effect
            os._exit(1)
    install_tools(tokenizer_json, template_text, variables)


def _remove_shard_outputs(output: StageOutput, out: Path, name: str) -> None:
    """Delete every output of one shard (its piece first, so a crash in between never leaves a piece over missing files)."""
    output.drop_piece(name)
    for split in SPLITS:
        for p in (out / split).glob(f"{name}-part-*.arrow"):
            p.unlink()
    (out / QUARANTINE_DIR / f"{name}.jsonl").unlink(missing_ok=True)


class _ChecksummedStream:
    """Reads a stream front to back while computing its size and CRC64NVME, to prove the bytes read are the listed input."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self._crc, self.size = raw, Crc64Nvme(), 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._crc.update(data)
        self.size += len(data)
        return data

    def finish(self, task: ShardTask) -> None:
        """Read what the parser left (a trailer) and compare with the listing; a mismatch means the input changed."""
        while self.read(READ_CHUNK):
            pass
        # An object listed by its ETag only (S3 without a stored checksum) can be compared by size only.
        listed_crc = None if task.checksum.startswith("etag:") else task.checksum
        if self.size != task.size or listed_crc not in (None, self._crc.b64):
            raise ArtifactError(
                f"input {task.key} changed while it was tokenized (read {self.size} bytes, crc64nvme {self._crc.b64}; "
                f"listed {task.size}, {task.checksum}); rerun when the input is complete"
            )


def _to_parent_queue() -> Advance | None:
    """In a pool worker, progress goes to the parent's queue (set up by `worker_init`); elsewhere nowhere."""
    q = WORKER.get("queue")
    if q is None:
        return None
    return lambda nbytes, rows, tokens: q.put((nbytes, rows, tokens))


def tokenize_shard(task: ShardTask, settings: WorkerSettings, progress: Advance | None = None) -> ShardRun:
    """Tokenize one input file into its Arrow files and quarantine file; record it (last) as a finished piece.

    `progress(nbytes, rows, tokens)` is called as it goes; in a pool worker, progress goes to the parent's queue.
    """
    progress = progress or _to_parent_queue()
    started, cpu_started = time.monotonic(), time.process_time()
    if WORKER.get("key") != settings.tools_key:
        raise RuntimeError("tokenize_shard called in a process without this run's tokenizer and template installed")
    tokenizer, template = WORKER["tools"]
    out = Path(settings.output_dir)
    output = StageOutput(LocalStore(out), KIND, settings.output_key)
    _remove_shard_outputs(output, out, task.name)
    writers = {split: _SplitWriter(out / split, task.name, settings.schema, settings.rows_per_file) for split in SPLITS}
    counts = _ShardCounts()
    quarantine_path = out / QUARANTINE_DIR / f"{task.name}.jsonl"
    quarantine_path.parent.mkdir(parents=True, exist_ok=True)
    quarantine_tmp = quarantine_path.with_name(TMP_PREFIX + quarantine_path.name)
    bytes_read = [0]
    reported = 0
    store = open_store(settings.input_url, settings.store)
    with open(quarantine_tmp, "w", encoding="utf-8") as quarantine, store.open_read(task.key) as raw:
        # Parquet is read by seeking (footer first), so only streamed formats are checksummed as they are read.
        checked = None if task.key.lower().endswith(".parquet") else _ChecksummedStream(raw)
        stream = raw if checked is None else cast(BinaryIO, checked)  # read() is all a streamed format asks of it

        def reject(record: RawRecord, source_id: str | None, turn: int | None, reason: str, detail: str) -> None:
            counts.rejected[reason] += 1
            entry = {"source_id": source_id, "turn": turn, "reason": reason, "detail": detail, "input": task.key,
                     "position": record.position, "row": record.text}
            quarantine.write(json.dumps(entry, ensure_ascii=False) + "\n")

        batch: list[RawRecord] = []
        for record in iter_records(stream, task.key, bytes_read):
            batch.append(record)
            if len(batch) >= CONVERSATION_BATCH:
                rows, tokens = _process_batch(batch, tokenizer, template, settings, writers, counts, reject)
                batch = []
                if progress is not None:
                    progress(bytes_read[0] - reported, rows, tokens)
                    reported = bytes_read[0]
        rows, tokens = _process_batch(batch, tokenizer, template, settings, writers, counts, reject)
        if checked is not None:
            checked.finish(task)
        if progress is not None:
            progress(task.size - reported, rows, tokens)
    os.replace(quarantine_tmp, quarantine_path)
    split_files = {split: writers[split].close() for split in SPLITS}
    q_size, q_checksum = crc64nvme_file(quarantine_path)
    quarantine_entry = FileEntry(path=f"{QUARANTINE_DIR}/{quarantine_path.name}", size=q_size, checksum=q_checksum)
    shard = ShardOutput(
        task.name,
        [*(e for split in SPLITS for e in split_files[split]), quarantine_entry],
        {"stats": counts.as_dict(), "split_files": {split: [e.path for e in split_files[split]] for split in SPLITS}},
    )
    # The piece is recorded last: it is the shard's "done", and it names exactly the files the shard made.
    output.put_piece(task.name, piece_key(settings.config_digest, task), shard.files, shard.counts)
    return ShardRun(shard, time.monotonic() - started, time.process_time() - cpu_started, _peak_rss_mib())


def _peak_rss_mib() -> float:
    """This process's own high-water resident memory (VmHWM; ru_maxrss would count a spawning parent's after exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _process_batch(
    batch: list[RawRecord],
    tokenizer: Any,
    template: ChatTemplate,
    settings: WorkerSettings,
    writers: dict[str, _SplitWriter],
    counts: _ShardCounts,
    reject: Any,
) -> tuple[int, int]:
    """Normalise, render, encode (one `encode_batch` for the batch) and mask; write rows; return (rows, tokens) written."""
    planned: list[tuple[RawRecord, str, PlannedTurn]] = []
    ready: list[tuple[RawRecord, str, TurnRow | TurnRejection]] = []
    for record in batch:
        counts.c["rows_in"] += 1
        try:
            conv = normalise(record)
        except RowRejected as exc:
            counts.c["rejected_rows"] += 1
            reject(record, source_id_of(record), None, exc.reason, exc.detail)
            continue
        if conv.prompt_ids is not None:
            counts.c["turns_in"] += 1
            ready.append((record, conv.source_id, row_from_generator_ids(conv, settings.max_length, settings.vocab_size)))
            continue
        for item in plan_turns(conv, template, settings.thinking):  # type: ignore[arg-type]
            counts.c["turns_in"] += 1
            if isinstance(item, PlannedTurn):
                planned.append((record, conv.source_id, item))
            else:
                ready.append((record, conv.source_id, item))
    if planned:
        encodings = tokenizer.encode_batch([p.full for _, _, p in planned], add_special_tokens=False)
        for (record, source_id, p), enc in zip(planned, encodings, strict=True):
            ready.append((record, source_id, mask_turn(p, enc, settings.eot_id, settings.max_length)))
    rows = tokens = 0
    for record, source_id, result in ready:
        if isinstance(result, TurnRejection):
            counts.c["rejected_turns"] += 1
            reject(record, source_id, result.turn, result.reason, result.detail)
            continue
        split = "held_out" if is_held_out(source_id, settings.held_out_fraction) else "train"
        writers[split].add(result, source_id)
        counts.add_row(split, result)
        rows, tokens = rows + 1, tokens + int(result.input_ids.shape[0])
    return rows, tokens
