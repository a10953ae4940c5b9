"""One shard, in one worker process: one task (an input file, or one part of it: `tasks.py`) -> its Arrow files, its
quarantine file and, last, its piece record.

A finished shard is a piece of the output (`StageOutput.put_piece`, written after its files), keyed by `piece_key`:
the run's config digest, the input file's key and size, and the part. Its counts hold the shard's row statistics
(`stats`), the token ids its rows hold (`token_ids`, a `SeenIds` record), its Arrow files per split in the order written
(`split_files`), what it read of the input (`input`: the
file's pin, the raw bytes it read and their checksum; `resume.input_unchanged`, `tasks.checksum_from_reads`) and the
task size its run cut the input with (`task_size`: a rerun cuts it the same way to keep the piece, `stage._cut`).

An input file that cannot be decoded whole is dropped whole, with no piece (see `tokenize_shard`; the stage drops the
file's other parts too).

A worker streams: it holds one batch of `CONVERSATION_BATCH` conversations and at most `ARROW_BATCH_ROWS`
(arrow_rows.py) pending rows per split, so its memory does not grow with the shard or the dataset. The tokenizer,
compiled template and special-token pattern are built once per process (`install_tools`), never shipped with each task.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
from tokenizers import Tokenizer

from blockdraft.config import StoreConfig
from blockdraft.data.completions import RowRejected, check_special_tokens, group_of, normalise, source_id_of
from blockdraft.data.formats import HELD_OUT_SPLIT, TOKENIZED_KIND, TRAIN_SPLIT
from blockdraft.data.inputs import STAT_PIN, check_unchanged, pin_is_trusted
from blockdraft.data.ranges import RangeReader
from blockdraft.data.records import RawRecord
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
from blockdraft.data.seen_ids import SEEN_IDS, SeenIds
from blockdraft.data.streams import InputUnreadable
from blockdraft.data.tokenizer import special_token_pattern
from blockdraft.errors import OutsideArtifactError
from blockdraft.stages.tokenize.arrow_rows import SplitWriter, written_entry
from blockdraft.stages.tokenize.hf_layout import QUARANTINE_DIR, SPLITS
from blockdraft.stages.tokenize.tasks import INPUT_READ, TASK_SIZE, ShardTask, check_listed, piece_key
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import FileEntry
from blockdraft.store.local import LocalStore
from blockdraft.store.output import StageOutput
from blockdraft.store.writable import disk_full_error

# Part of the config digest: bump it when the rows' bytes change for the same options, so old shards are redone.
SHARD_FORMAT = "blockdraft-tokenize-shard/5"
# Conversations rendered and encoded together; small enough that a worker's memory stays flat.
CONVERSATION_BATCH = 32
# What clipping to max_length cut off, in every piece's stats: rows clipped, tokens dropped, supervised tokens dropped.
CLIP_KEYS = ("rows_clipped", "tokens_clipped", "supervised_tokens_clipped")
_PR_SET_PDEATHSIG = 1
# progress(input bytes consumed, rows written, tokens written): deltas since the last call.
Advance = Callable[[int, int, int], None]
# A worker's StageOutput only records pieces, keyed each on its own (`piece_key`); the parent's commits the output.
PIECES_ONLY = ""


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs for one shard besides the tokenizer and template (installed once per process,
    `tools_key`)."""

    tools_key: str
    thinking: str
    max_length: int
    held_out_fraction: float
    rows_per_file: int | None
    file_bytes: int
    max_row_bytes: int
    eot_id: int
    vocab_size: int
    config_digest: str
    input_url: str
    store: StoreConfig
    output_dir: str
    schema: pa.Schema
    task_size: int  # the input bytes per task the run cut its input with (`tasks.task_size`), recorded in every piece


@dataclass(frozen=True)
class ShardOutput:
    """One finished shard as its piece records it: every file it made (Arrow and quarantine) and its piece counts,
    {"stats": row counts (rows_in, rows_out, tokens, rejected by reason, ...), "token_ids": the ids its rows hold,
    "split_files": {split: [path, ...]}}."""

    name: str
    files: list[FileEntry]
    counts: dict[str, Any]

    @property
    def stats(self) -> dict[str, Any]:
        return self.counts["stats"]

    def seen_ids(self) -> SeenIds:
        return SeenIds.from_record(self.counts[SEEN_IDS])

    def arrow_files(self) -> list[tuple[str, str]]:
        """(path, checksum) of its Arrow files in the order written: train then held_out, parts in order."""
        checksums = {e.path: e.checksum for e in self.files}
        return [(path, checksums[path]) for split in SPLITS for path in self.counts["split_files"][split]]


@dataclass(frozen=True)
class ShardRun:
    """A shard tokenized by this run: what it holds, and the worker's wall and CPU seconds and peak resident MiB for it,
    and which process ran it."""

    output: ShardOutput
    seconds: float
    cpu_seconds: float
    peak_rss_mib: float
    pid: int = 0


def is_held_out(key: str, fraction: float) -> bool:
    """Deterministic split by conversation: `key` is the row's group (`group_of`), else its source id; the first 8
    bytes of sha256(key) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h < fraction * 2**64


class _ShardCounts:
    def __init__(self, vocab_size: int) -> None:
        self.c: Counter[str] = Counter(dict.fromkeys(CLIP_KEYS, 0))  # recorded even when nothing was clipped
        self.seen = SeenIds(vocab_size)  # the token ids of the rows written (kept apart from the summed stats)
        self.rejected: Counter[str] = Counter()
        self.thinking: Counter[str] = Counter()
        # an input dropped whole: its key -> reason, detail, rows read before the fault
        self.failed: dict[str, Any] = {}

    def add_row(self, split: str, row: TurnRow) -> None:
        """A row written to `split`; a clipped one also adds what `max_length` cut off it (see `TurnRow`)."""
        self.c.update({"rows_out": 1, f"{split}_rows": 1, "tokens": len(row.input_ids),
                       "supervised_tokens": int(row.loss_mask.sum())})
        self.thinking[row.thinking] += 1
        self.seen.add(row.input_ids)
        if row.clipped_tokens:
            self.c.update({"rows_clipped": 1, "tokens_clipped": row.clipped_tokens,
                           "supervised_tokens_clipped": row.clipped_supervised})

    def as_dict(self) -> dict[str, Any]:
        return {**dict(self.c), "rejected": dict(self.rejected), "thinking": dict(self.thinking),
                "failed_inputs": dict(self.failed)}


WORKER: dict[str, Any] = {}


def tools_key(tokenizer_sha256: str, template: ChatTemplate) -> str:
    return hashlib.sha256(
        json.dumps([tokenizer_sha256, template.sha256, template.variables], sort_keys=True).encode()
    ).hexdigest()


def install_tools(tokenizer_json: str, template_text: str, variables: dict[str, str]) -> None:
    """Build this process's tokenizer and compiled template once (a pool worker does it while the parent lists
    inputs)."""
    template = compile_chat_template(template_text, variables)
    key = tools_key(hashlib.sha256(tokenizer_json.encode()).hexdigest(), template)
    if WORKER.get("key") != key:
        special = special_token_pattern(tokenizer_json, variables)
        WORKER["tools"], WORKER["key"] = (Tokenizer.from_str(tokenizer_json), template, special), key


def worker_init(progress_queue: Any, parent_pid: int, tokenizer_json: str, template_text: str,
                variables: dict[str, str]) -> None:
    WORKER["queue"] = progress_queue
    if sys.platform == "linux":
        # A worker must not outlive a killed parent: it would keep writing shard files under a rerun's feet.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the line above took effect
            os._exit(1)
    install_tools(tokenizer_json, template_text, variables)


def _remove_shard_outputs(output: StageOutput, name: str) -> None:
    """Delete every output of one shard (its piece first, so a crash in between never leaves a piece over missing
    files).

    Each file is deleted through the store, in its folder opened one name at a time without following a link: a link
    planted at a split or quarantine folder is OutsideArtifactError ("resolves outside"), and nothing is removed through
    it. Temporary files are their writers' to remove (`LocalStore.writing` removes its own when the block fails) and a
    killed run's are removed by the parent before any shard runs (`resume.keep_finished_shards`)."""
    output.drop_piece(name)
    for key in _shard_files(output.store, name):
        output.store.delete(key)


def _shard_files(store: Store, name: str) -> list[str]:
    """Every whole file of one shard in the output, by key: its Arrow files of each split and its quarantine file (a
    listing follows no link to a folder)."""
    arrow = [
        info.key for split in SPLITS for info in store.list(f"{split}/{name}-part-") if info.key.endswith(".arrow")
    ]
    return [*arrow, f"{QUARANTINE_DIR}/{name}.jsonl"]


def _to_parent_queue() -> Advance | None:
    """In a pool worker, progress goes to the parent's queue (set up by `worker_init`); elsewhere nowhere."""
    q = WORKER.get("queue")
    if q is None:
        return None
    return lambda nbytes, rows, tokens: q.put((nbytes, rows, tokens))


def tokenize_shard(task: ShardTask, settings: WorkerSettings, progress: Advance | None = None) -> ShardRun:
    """Tokenize one task (an input file or a part of one) into its Arrow files and quarantine file; record it (last) as
    a finished piece.

    `progress(nbytes, rows, tokens)` is called as it goes; in a pool worker, progress goes to the parent's queue.
    An input that cannot be decoded whole is dropped whole: its quarantine holds one line with the reason, its stats
    count it under `input_files_failed`, and no piece is recorded, so a rerun tries it again. A full disk raises
    `DiskFull` after removing every file of the shard.
    """
    started, cpu_started = time.monotonic(), time.process_time()
    if WORKER.get("key") != settings.tools_key:
        raise RuntimeError("tokenize_shard called in a process without this run's tokenizer and template installed")
    out = Path(settings.output_dir)
    store = LocalStore(out)
    output = StageOutput(store, TOKENIZED_KIND, PIECES_ONLY)
    _remove_shard_outputs(output, task.name)
    writers = {
        split: SplitWriter(store, split, task.name, settings.schema, settings.rows_per_file, settings.file_bytes)
        for split in SPLITS
    }
    reading = _Reading(task.share, progress or _to_parent_queue())
    try:
        shard = _write_shard(task, settings, store, output, writers, reading)
    except BaseException as exc:
        written = sum(writer.bytes_written for writer in writers.values())
        try:
            for writer in writers.values():
                writer.discard()  # closes its open file: an unlinked file still open keeps its space
            _remove_shard_outputs(output, task.name)
        except OutsideArtifactError:
            pass  # a link swapped in meanwhile: nothing is removed through it, and the error raised below names it
        error = (
            disk_full_error(exc, out, written, reading.done / max(task.share, 1)) if isinstance(exc, OSError) else None
        )
        if error is None:
            raise
        raise error from None
    return ShardRun(shard, time.monotonic() - started, time.process_time() - cpu_started, peak_rss_mib(), os.getpid())


class _Reading:
    """How much of its task's input bytes (`share`) a shard has read (`done`, for progress and the disk-full estimate),
    and what of it was reported to `progress`."""

    def __init__(self, share: int, progress: Advance | None) -> None:
        self.share, self.progress, self.done, self.reported = share, progress, 0, 0

    def report(self, done: int, rows: int, tokens: int) -> None:
        """`done` input bytes read so far, and the rows and tokens written since the last report."""
        self.done = done
        if self.progress is not None:
            self.progress(done - self.reported, rows, tokens)
        self.reported = done


def peak_rss_mib() -> float:
    """This process's own high-water resident memory (VmHWM; ru_maxrss would count a spawning parent's after exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_shard(task: ShardTask, settings: WorkerSettings, out: LocalStore, output: StageOutput,
                 writers: dict[str, SplitWriter], reading: _Reading) -> ShardOutput:
    tokenizer, template, special = WORKER["tools"]
    counts = _ShardCounts(settings.vocab_size)
    quarantine_key = f"{QUARANTINE_DIR}/{task.name}.jsonl"
    read = 0
    failure: InputUnreadable | None = None
    store = open_store(settings.input_url, settings.store)
    # The quarantine file is written like every file of the output (`LocalStore.writing`: its folder opened without
    # following a link, renamed into place when the block ends, removed if it fails).
    with (out.writing(quarantine_key) as new, open(new.fd, "w", encoding="utf-8", closefd=False) as quarantine,
          store.open_read(task.input_key) as raw):
        trusted = _check_pin(task, raw)
        # Parquet is read by seeking; its checksum is a second, sequential pass, skipped when the listing names it.
        reader = RangeReader(raw, task.input_key, task.file.size, task.part,
                             checksum=not (task.input_key.lower().endswith(".parquet") and task.file.checksum),
                             max_row_bytes=settings.max_row_bytes)

        def reject(record: RawRecord, source_id: str | None, turn: int | None, reason: str, detail: str) -> None:
            counts.rejected[reason] += 1
            entry = {"source_id": source_id, "turn": turn, "reason": reason, "detail": detail, "input": task.input_key,
                     "position": record.position, "offset": record.offset, "row": record.text}
            quarantine.write(json.dumps(entry, ensure_ascii=False) + "\n")

        batches = _Batches(tokenizer, template, special, settings, writers, counts, reject)
        batch: list[RawRecord] = []
        try:
            for record in reader.records():
                batch.append(record)
                read += 1
                if len(batch) >= CONVERSATION_BATCH:
                    rows, tokens = batches.process(batch)
                    batch = []
                    reading.report(int(task.share * reader.fraction()), rows, tokens)
            rows, tokens = batches.process(batch)
        except InputUnreadable as exc:
            failure, rows, tokens = exc, 0, 0
        reader.finish()
        _check_pin(task, raw)
        if task.part.kind == "whole":
            check_listed(task.input_key, task.file.size, task.file.checksum, reader.window, reader.crc)
        reading.report(task.share, rows, tokens)
        if failure is not None:
            # Dropped whole: none of its rows or row rejections stay, only the one line that says why.
            line, counts = _failed_counts(task.input_key, failure, reader.rows_before + read, settings.vocab_size)
            quarantine.seek(0)
            quarantine.truncate()
            quarantine.write(json.dumps(line, ensure_ascii=False) + "\n")
    split_files = {split: writers[split].discard() if failure else writers[split].close() for split in SPLITS}
    quarantine_entry = written_entry(out, quarantine_key)
    shard = ShardOutput(
        task.name,
        [*(e for split in SPLITS for e in split_files[split]), quarantine_entry],
        {"stats": counts.as_dict(), SEEN_IDS: counts.seen.to_record(),
         "split_files": {split: [e.path for e in split_files[split]] for split in SPLITS},
         INPUT_READ: {"pin": task.file.pin, "pin_trusted": trusted,
                      "window": list(reader.window) if reader.window else None,
                      "crc": reader.crc, "reads": [list(r) for r in reader.reads]},
         TASK_SIZE: settings.task_size},
    )
    if failure is None:
        # The piece is recorded last: it is the shard's "done", and it names exactly the files the shard made.
        output.put_piece(task.name, piece_key(settings.config_digest, task), shard.files, shard.counts)
    return shard


def _check_pin(task: ShardTask, raw: BinaryIO) -> bool:
    """ArtifactError when a local input no longer has the stat it was listed with; whether its pin may stand for its
    content later (`pin_is_trusted`; a pin from a store's checksum or ETag always may)."""
    if not task.file.pin.startswith(STAT_PIN):
        return True
    st = os.fstat(raw.fileno())
    check_unchanged(task.input_key, task.file, st)
    return pin_is_trusted(st)


def _failed_counts(
    key: str, failure: InputUnreadable, rows_read: int, vocab_size: int
) -> tuple[dict[str, Any], _ShardCounts]:
    """(its one quarantine line, its counts: `input_files_failed` 1 and its entry in `failed_inputs`) for an input file
    dropped whole."""
    record = {"reason": failure.reason, "detail": failure.detail, "rows_read_before_failure": rows_read}
    line = {"source_id": None, "turn": None, "reason": failure.reason, "detail": failure.detail, "input": key,
            "position": rows_read + 1, "row": None, "rows_read_before_failure": rows_read}
    counts = _ShardCounts(vocab_size)
    counts.c["input_files_failed"] = 1
    counts.failed[key] = record
    return line, counts


@dataclass
class _Batches:
    """What a shard's conversation batches go through and into: the worker's tokenizer, template and special-token
    pattern, its settings, the split writers, the shard's counts and its quarantine (`reject`)."""

    tokenizer: Any
    template: ChatTemplate
    special: re.Pattern[str] | None
    settings: WorkerSettings
    writers: dict[str, SplitWriter]
    counts: _ShardCounts
    reject: Callable[[RawRecord, str | None, int | None, str, str], None]  # (record, source_id, turn, reason, detail)

    def process(self, batch: list[RawRecord]) -> tuple[int, int]:
        """Normalise, render, encode and mask one batch; write its rows; return (rows, tokens) written."""
        settings, counts, reject = self.settings, self.counts, self.reject
        planned: list[tuple[RawRecord, str, PlannedTurn]] = []
        ready: list[tuple[RawRecord, str, TurnRow | TurnRejection]] = []
        for record in batch:
            counts.c["rows_in"] += 1
            try:
                conv = normalise(record)
                if conv.prompt_ids is None:  # generator ids are trained as they are, not rendered from the text
                    check_special_tokens(conv, self.special)
            except RowRejected as exc:
                counts.c["rejected_rows"] += 1
                reject(record, source_id_of(record), None, exc.reason, exc.detail)
                continue
            if conv.prompt_ids is not None:
                counts.c["turns_in"] += 1
                ready.append((record, conv.source_id,
                              row_from_generator_ids(conv, settings.max_length, settings.vocab_size)))
                continue
            for item in plan_turns(conv, self.template, settings.thinking):  # type: ignore[arg-type]
                counts.c["turns_in"] += 1
                if isinstance(item, PlannedTurn):
                    planned.append((record, conv.source_id, item))
                else:
                    ready.append((record, conv.source_id, item))
        if planned:
            # One `encode` per text, not `encode_batch`: that starts the tokenizer's own thread pool, which does not
            # scale on few cores (the stage scales by worker processes, one core each) and can deadlock in a forked
            # child.
            encodings = [self.tokenizer.encode(p.full, add_special_tokens=False) for _, _, p in planned]
            for (record, source_id, p), enc in zip(planned, encodings, strict=True):
                ready.append((record, source_id, mask_turn(p, enc, settings.eot_id, settings.max_length)))
        rows = tokens = 0
        for record, source_id, result in ready:
            if isinstance(result, TurnRejection):
                counts.c["rejected_turns"] += 1
                reject(record, source_id, result.turn, result.reason, result.detail)
                continue
            held = is_held_out(group_of(record) or source_id, settings.held_out_fraction)
            split = HELD_OUT_SPLIT if held else TRAIN_SPLIT
            self.writers[split].add(result, source_id)
            counts.add_row(split, result)
            rows, tokens = rows + 1, tokens + int(result.input_ids.shape[0])
        return rows, tokens
