"""The `tokenize` stage: completions -> per-turn Arrow rows with exact loss masks, as a verified artifact.

Layout of the output folder (`datasets.load_from_disk(OUTPUT)` gives a DatasetDict with `train` and `held_out`):

    dataset_dict.json
    train/shard-00000-part-000.arrow ...  state.json  dataset_info.json
    held_out/...                                       (same)
    quarantine/shard-00000.jsonl                       rejected rows, one JSON object each, with the reason
    .blockdraft-shards/shard-00000.json                per-shard completion records (resume)
    blockdraft-manifest.json                           written last, by `commit_artifact`

One shard = one input file, processed start to end by one worker process, streaming: a worker holds one batch
of conversations and one Arrow record batch at a time. A shard is skipped on a rerun only when its completion
record names this run's config digest and the same input file (key, size, checksum) and every file it lists
reads back with the recorded size and checksum; anything else is redone from scratch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from blockdraft.config import BlockdraftConfig, ConfigError
from blockdraft.data.completions import (
    SUFFIXES,
    RawRecord,
    RowRejected,
    is_completions_file,
    iter_records,
    normalise,
    source_id_of,
)
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
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    ArtifactError,
    FileEntry,
    InputRef,
    State,
    VerifyReport,
    commit_artifact,
    entry_for_local_file,
    manifest_input,
    raw_input,
    read_manifest,
    uncommit,
    verify_artifact,
)
from blockdraft.store.checksum import READ_CHUNK, Crc64Nvme, crc64nvme_file
from blockdraft.store.local import TMP_PREFIX

KIND = "tokenized"
SPLITS = ("train", "held_out")
RECORDS_DIR = ".blockdraft-shards"
QUARANTINE_DIR = "quarantine"
RECORD_FORMAT = "blockdraft-tokenize-shard/1"
EMPTY_SPLIT_FILE = "empty.arrow"
# Conversations rendered and encoded together; small enough that a worker's memory stays flat.
CONVERSATION_BATCH = 32
# Rows per Arrow record batch written.
ARROW_BATCH_ROWS = 256
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TokenizerSource:
    """The tokenizer and chat template a run uses, resolved from the config and the overrides."""

    tokenizer_json: str
    tokenizer_sha256: str
    vocab_size: int
    template: ChatTemplate  # compiled with the tokenizer's special tokens as variables
    template_source: str
    target_template_sha256: str | None


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
    store_settings: dict[str, Any]
    output_dir: str
    schema: pa.Schema


@dataclass(frozen=True)
class ShardTask:
    """One input file: `name` (shard-00003) names its outputs and record."""

    index: int
    name: str
    key: str
    size: int
    checksum: str


@dataclass
class TokenizeSummary:
    """What a tokenize run left at the destination, as verified there (`report`).

    Timings (seconds) are of this call: `shard_phase_seconds` wall time of the shards it ran; per shard it ran,
    `worker_seconds` (wall) and `worker_cpu_seconds` (CPU) inside the worker and `worker_peak_rss_mib`, that worker's
    peak resident memory.
    """

    output: str
    report: VerifyReport
    counts: dict[str, Any]
    shards_total: int
    shards_skipped: int
    already_committed: bool
    template_sha256: str
    template_matches_target: bool | None
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    shard_phase_seconds: float = 0.0
    worker_seconds: list[float] = field(default_factory=list)
    worker_cpu_seconds: list[float] = field(default_factory=list)
    worker_peak_rss_mib: list[float] = field(default_factory=list)


class TokenizeProgress:
    """Progress callbacks (no-ops here; the CLI draws a rich bar). Byte counts are of the input as stored."""

    def start(self, total_bytes: int, shards_total: int, shards_skipped: int) -> None:
        """Called once, before any shard runs; skipped shards' bytes are not in `total_bytes`."""

    def advance(self, nbytes: int, rows: int, tokens: int) -> None:
        """Called as workers consume input and write rows."""

    def warn(self, message: str) -> None:
        """A problem the user must see before the run goes on (a template that is not the target's)."""
        logging.getLogger("blockdraft.tokenize").warning(message)


# ---------------------------------------------------------------------------------------------- tokenizer, template


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> tuple[str, int, str | None, dict[str, str]]:
    """(tokenizer JSON, vocabulary size, its own chat template, its special tokens by name) of a tokenizer folder.

    Cached per process: loading converts vocab/merges when the folder has no tokenizer.json (seconds).
    """
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer folder {path} does not exist; set target.path/target.tokenizer or pass --tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(exc).__name__}); point --tokenizer at a Hugging Face tokenizer folder") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"the tokenizer in {path} has no fast (Rust) version; offsets need one, give a folder with tokenizer.json")
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    special = {name: str(value) for name, value in tok.special_tokens_map.items() if isinstance(value, str)}
    return tok.backend_tokenizer.to_str(), len(tok), template, special


def _read_template_file(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"chat template file {p} does not exist; pass a Jinja file with --chat-template or fix target.chat_template")
    return p.read_text()


def _target_template(cfg: BlockdraftConfig) -> str | None:
    """The target's own chat template text (target.chat_template, else the target tokenizer's), or None when unknown."""
    if cfg.target.chat_template:
        return _read_template_file(cfg.target.chat_template)
    target_tok = cfg.target.tokenizer or cfg.target.path
    if target_tok and Path(target_tok).is_dir():
        return _load_tokenizer(target_tok)[2]
    return None


def resolve_tokenizer(cfg: BlockdraftConfig, tokenizer: str | None, chat_template: str | None) -> tuple[TokenizerSource, list[str]]:
    """The tokenizer/template of this run and the warnings to show loudly (template not the target's)."""
    tok_path = tokenizer or cfg.target.tokenizer or cfg.target.path
    if not tok_path:
        raise ConfigError("no tokenizer: set target.path (or target.tokenizer) in the config, or pass --tokenizer DIR")
    tokenizer_json, vocab_size, own_template, special_tokens = _load_tokenizer(str(tok_path))
    target_text = _target_template(cfg)
    if chat_template:
        text, source = _read_template_file(chat_template), f"file {Path(chat_template).name}"
    elif target_text is not None:
        text, source = target_text, "target"
    elif own_template is not None:
        text, source = own_template, f"tokenizer {Path(tok_path).name}"
    else:
        raise ConfigError(f"the tokenizer in {tok_path} has no chat template; pass one with --chat-template FILE")
    template = compile_chat_template(text, special_tokens)
    target_sha = hashlib.sha256(target_text.encode()).hexdigest() if target_text is not None else None
    warnings = []
    if target_sha is None:
        warnings.append(
            f"no target chat template to compare with (set target.path in the config): rows use the template from {source}"
        )
    elif target_sha != template.sha256:
        warnings.append(
            f"the chat template ({source}, sha256 {template.sha256[:12]}) differs from the target's own "
            f"(sha256 {target_sha[:12]}): a drafter trained on these rows learns another prompt format than the target serves"
        )
    src = TokenizerSource(
        tokenizer_json=tokenizer_json,
        tokenizer_sha256=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        vocab_size=vocab_size,
        template=template,
        template_source=source,
        target_template_sha256=target_sha,
    )
    return src, warnings


@functools.lru_cache(maxsize=8)
def _eot_id(tokenizer_json: str, token: str) -> int:
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_str(tokenizer_json).token_to_id(token)
    if token_id is None:
        raise ConfigError(f"end-of-turn token {token!r} is not in the tokenizer's vocabulary; set tokenize.end_of_turn to the one it uses")
    return token_id


@functools.lru_cache(maxsize=1)
def output_schema() -> pa.Schema:
    """The Arrow schema of the rows, with the `datasets` feature metadata so `load_from_disk` restores the types."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
            "num_tokens": datasets.Value("int32"),
            "num_supervised": datasets.Value("int32"),
            "source_id": datasets.Value("string"),
            "turn": datasets.Value("int32"),
        }
    ).arrow_schema


def is_held_out(source_id: str, fraction: float) -> bool:
    """Deterministic split by conversation: the first 8 bytes of sha256(source_id) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(source_id.encode()).digest()[:8], "big")
    return h < fraction * 2**64


# ---------------------------------------------------------------------------------------------- worker side


class _SplitWriter:
    """Arrow stream files of one split of one shard, rotated every `rows_per_file` rows, renamed only when whole."""

    def __init__(self, split_dir: Path, stem: str, schema: pa.Schema, rows_per_file: int) -> None:
        self.dir, self.stem, self.schema, self.rows_per_file = split_dir, stem, schema, rows_per_file
        self.files: list[dict[str, Any]] = []
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
        self.files.append({"path": f"{self.dir.name}/{final.name}", "size": size, "checksum": checksum, "rows": self._rows_in_file})
        self._writer, self._tmp, self._rows_in_file = None, None, 0

    def close(self) -> list[dict[str, Any]]:
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
        self.c: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.thinking: Counter[str] = Counter()

    def as_dict(self) -> dict[str, Any]:
        return {**dict(self.c), "rejected": dict(self.rejected), "thinking": dict(self.thinking)}


_WORKER: dict[str, Any] = {}


def _tools_key(tokenizer_sha256: str, template: ChatTemplate) -> str:
    return hashlib.sha256(json.dumps([tokenizer_sha256, template.sha256, template.variables], sort_keys=True).encode()).hexdigest()


def _install_tools(tokenizer_json: str, template_text: str, variables: dict[str, str]) -> None:
    """Build this process's tokenizer and compiled template once (a pool worker does it while the parent lists inputs)."""
    template = compile_chat_template(template_text, variables)
    key = _tools_key(hashlib.sha256(tokenizer_json.encode()).hexdigest(), template)
    if _WORKER.get("key") != key:
        from tokenizers import Tokenizer

        _WORKER["tools"], _WORKER["key"] = (Tokenizer.from_str(tokenizer_json), template), key


def _worker_init(progress_queue: Any, parent_pid: int, tokenizer_json: str, template_text: str, variables: dict[str, str]) -> None:
    # The tokenizer's own thread pool deadlocks in forked children and does not scale on few cores: one process = one core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["queue"] = progress_queue
    if sys.platform == "linux":
        # A worker must not outlive a killed parent: it would keep writing shard files under a rerun's feet.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the line above took effect
            os._exit(1)
    _install_tools(tokenizer_json, template_text, variables)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_shard_outputs(out: Path, name: str) -> None:
    """Delete every output of one shard (record first, so a crash in between never leaves a record over missing files)."""
    (out / RECORDS_DIR / f"{name}.json").unlink(missing_ok=True)
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


def tokenize_shard(task: ShardTask, settings: WorkerSettings, progress: Any = None) -> dict[str, Any]:
    """Tokenize one input file into its Arrow files and quarantine file; return (and write, last) its completion record.

    `progress(nbytes, rows, tokens)` is called as it goes; in a pool worker, progress goes to the parent's queue.
    """
    if progress is None and "queue" in _WORKER:
        q = _WORKER["queue"]

        def progress(nbytes: int, rows: int, tokens: int) -> None:
            q.put((nbytes, rows, tokens))

    started, cpu_started = time.monotonic(), time.process_time()
    if _WORKER.get("key") != settings.tools_key:
        raise RuntimeError("tokenize_shard called in a process without this run's tokenizer and template installed")
    tokenizer, template = _WORKER["tools"]
    out = Path(settings.output_dir)
    _remove_shard_outputs(out, task.name)
    writers = {split: _SplitWriter(out / split, task.name, settings.schema, settings.rows_per_file) for split in SPLITS}
    counts = _ShardCounts()
    quarantine_path = out / QUARANTINE_DIR / f"{task.name}.jsonl"
    quarantine_path.parent.mkdir(parents=True, exist_ok=True)
    quarantine_tmp = quarantine_path.with_name(TMP_PREFIX + quarantine_path.name)
    bytes_read = [0]
    reported = 0
    store = open_store(settings.input_url, _store_settings(settings.store_settings))
    with open(quarantine_tmp, "w", encoding="utf-8") as quarantine, store.open_read(task.key) as raw:
        # Parquet is read by seeking (footer first), so only streamed formats are checksummed as they are read.
        stream = raw if task.key.lower().endswith(".parquet") else _ChecksummedStream(raw)

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
        if isinstance(stream, _ChecksummedStream):
            stream.finish(task)
        if progress is not None:
            progress(task.size - reported, rows, tokens)
    os.replace(quarantine_tmp, quarantine_path)
    files = [dict(f, split=split) for split in SPLITS for f in writers[split].close()]
    q_size, q_checksum = crc64nvme_file(quarantine_path)
    record = {
        "format": RECORD_FORMAT,
        "shard": task.name,
        "input": {"key": task.key, "size": task.size, "checksum": task.checksum},
        "config_digest": settings.config_digest,
        "files": files,
        "quarantine": {"path": f"{QUARANTINE_DIR}/{quarantine_path.name}", "size": q_size, "checksum": q_checksum},
        "counts": counts.as_dict(),
    }
    # The record is written last: its presence is the shard's "done", and it names exactly the files it made.
    _write_atomic(out / RECORDS_DIR / f"{task.name}.json", json.dumps(record, indent=1, sort_keys=True).encode())
    record["peak_rss_mib"] = _peak_rss_mib()
    record["seconds"] = time.monotonic() - started
    record["cpu_seconds"] = time.process_time() - cpu_started
    return record


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


def _store_settings(data: dict[str, Any]) -> Any:
    from blockdraft.config import StoreConfig

    return StoreConfig.model_validate(data)


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
        for (record, source_id, p), enc in zip(planned, encodings):
            ready.append((record, source_id, mask_turn(p, enc, settings.eot_id, settings.max_length)))
    rows = tokens = 0
    for record, source_id, result in ready:
        if isinstance(result, TurnRejection):
            counts.c["rejected_turns"] += 1
            reject(record, source_id, result.turn, result.reason, result.detail)
            continue
        split = "held_out" if is_held_out(source_id, settings.held_out_fraction) else "train"
        writers[split].add(result, source_id)
        n, s = int(result.input_ids.shape[0]), int(result.loss_mask.sum())
        counts.c["rows_out"] += 1
        counts.c[f"{split}_rows"] += 1
        counts.c["tokens"] += n
        counts.c["supervised_tokens"] += s
        counts.thinking[result.thinking] += 1
        rows, tokens = rows + 1, tokens + n
    return rows, tokens


# ---------------------------------------------------------------------------------------------- parent side


def list_input(input_url: str, settings: Any) -> tuple[Store, list[tuple[str, int, str]], list[InputRef]]:
    """(store, [(key, size, checksum)], lineage) of the completions at `input_url`: a file, a folder or an artifact."""
    store = open_store(input_url, settings)
    local = store.local_path()
    if local is not None and local.is_file():
        store = open_store(local.parent, settings)
        keys = [local.name]
    elif local is not None and not local.exists():
        raise ConfigError(f"input {input_url} does not exist; pass a completions file or folder")
    else:
        found = read_manifest(store)
        if found is not None:
            ref = manifest_input(store)
            files = [(f.path, f.size, f.checksum) for f in found[0].files if is_completions_file(f.path)]
            if not files:
                raise ConfigError(f"input artifact {input_url} lists no completions files ({', '.join(SUFFIXES)})")
            return store, files, [ref]
        keys = [info.key for info in store.list() if is_completions_file(info.key) and not info.key.startswith(".")]
    if not keys:
        raise ConfigError(f"input {input_url} has no completions files ({', '.join(SUFFIXES)}); point INPUT at a file or folder of them")
    files, lineage = [], []
    keys = sorted(keys)
    # One round trip per object on S3 (a full read on a folder): in parallel.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(store.head, keys))
    for key, info in zip(keys, infos):
        if info is None:
            raise ConfigError(f"input {input_url}/{key} disappeared while listing; retry when the input is complete")
        if info.checksum is None and info.etag is None:
            size, checksum = store.checksum_by_reading(key)
            info = type(info)(key=key, size=size, checksum=checksum, etag=info.etag)
        # An object uploaded without CRC64NVME is pinned by its ETag (recorded as lineage), not re-read whole.
        files.append((key, info.size, info.checksum or f"etag:{info.etag}"))
        lineage.append(raw_input(store, info))
    return store, files, lineage


def _config_digest(cfg: BlockdraftConfig, src: TokenizerSource, eot_id: int) -> str:
    """What the rows depend on (not `workers`): tokenize options, tokenizer, template, end-of-turn id, record format."""
    options = cfg.resolved()["tokenize"]
    options.pop("workers")
    data = {"tokenize": options, "tokenizer": src.tokenizer_sha256, "template": src.template.sha256,
            "template_variables": src.template.variables, "eot_id": eot_id, "format": RECORD_FORMAT}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _record_matches(out: Store, task: ShardTask, digest: str) -> dict[str, Any] | None:
    """The shard's completion record if it matches this run and every file it names reads back as recorded."""
    path = out.local_path() / RECORDS_DIR / f"{task.name}.json"  # type: ignore[operator]
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    expected_input = {"key": task.key, "size": task.size, "checksum": task.checksum}
    if record.get("format") != RECORD_FORMAT or record.get("config_digest") != digest or record.get("input") != expected_input:
        return None
    for f in [*record["files"], record["quarantine"]]:
        info = out.head(f["path"])
        if info is None or info.size != f["size"] or info.checksum != f["checksum"]:
            return None
    return record


def _clean_leftovers(out: Path, keep: set[str]) -> None:
    """Remove temporary files of killed runs, records that do not match this run, the files no kept record names,
    and split metadata (rewritten at commit), so the folder holds nothing a reader could mix with this run's rows."""
    for sub in (*SPLITS, QUARANTINE_DIR, RECORDS_DIR):
        folder = out / sub
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            rel = f"{sub}/{p.name}"
            if p.name.startswith(TMP_PREFIX) or (p.suffix in (".arrow", ".jsonl", ".json") and rel not in keep):
                p.unlink()


def _write_split_metadata(out: Path, records: list[dict[str, Any]], schema: pa.Schema) -> list[Path]:
    """state.json / dataset_info.json per split and dataset_dict.json, as `datasets.save_to_disk` writes them."""
    import datasets

    features = datasets.Features.from_arrow_schema(schema)
    written = []
    for split in SPLITS:
        files = [f["path"].split("/", 1)[1] for r in records for f in r["files"] if f["split"] == split]
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        if not files:
            # `load_from_disk` needs at least one table per split: an empty split gets one schema-only file.
            empty = folder / EMPTY_SPLIT_FILE
            with pa.ipc.new_stream(str(empty), schema):
                pass
            files, written = [EMPTY_SPLIT_FILE], [*written, empty]
        fingerprint = hashlib.sha256(json.dumps([split, *files, *(f["checksum"] for r in records for f in r["files"])]).encode()).hexdigest()[:16]
        state = {
            "_data_files": [{"filename": name} for name in files],
            "_fingerprint": fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        info = {"citation": "", "description": "", "features": features.to_dict(), "homepage": "", "license": ""}
        for name, data in (("state.json", state), ("dataset_info.json", info)):
            _write_atomic(folder / name, json.dumps(data, indent=2, sort_keys=True).encode())
            written.append(folder / name)
    _write_atomic(out / "dataset_dict.json", json.dumps({"splits": list(SPLITS)}).encode())
    written.append(out / "dataset_dict.json")
    return written


@contextlib.contextmanager
def _output_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on the output folder for this run (released when the process dies, even by SIGKILL)."""
    (out_dir / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / RECORDS_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another tokenize is writing {out_dir}; wait for it to finish or pick another OUTPUT") from None
        yield
    finally:
        os.close(fd)


def _merge_counts(records: list[dict[str, Any]]) -> dict[str, Any]:
    total: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    thinking: Counter[str] = Counter()
    for r in records:
        c = dict(r["counts"])
        rejected.update(c.pop("rejected"))
        thinking.update(c.pop("thinking"))
        total.update(c)
    keys = ("rows_in", "turns_in", "rows_out", "train_rows", "held_out_rows", "tokens", "supervised_tokens", "rejected_rows", "rejected_turns")
    return {**{k: total.get(k, 0) for k in keys}, "rejected": dict(sorted(rejected.items())), "thinking": dict(sorted(thinking.items()))}


class _ShardRunner:
    """Runs shard tasks: in this process for one worker, else in a pool of spawned processes.

    The pool starts (and each worker builds its tokenizer) as soon as the runner exists, so that start-up overlaps
    the parent's listing and checksumming of the inputs.
    """

    def __init__(self, workers: int, src: TokenizerSource) -> None:
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        if workers <= 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            _install_tools(src.tokenizer_json, src.template.text, src.template.variables)
            return
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_worker_init,
            initargs=(self.queue, os.getpid(), src.tokenizer_json, src.template.text, src.template.variables),
        )
        # Ask for every worker now: the executor starts processes lazily otherwise.
        for _ in range(workers):
            self.pool.submit(os.getpid)

    def run(self, pending: list[ShardTask], settings: WorkerSettings, progress: TokenizeProgress) -> list[dict[str, Any]]:
        if self.pool is None:
            return [tokenize_shard(task, settings, progress.advance) for task in pending]
        futures = [self.pool.submit(tokenize_shard, task, settings) for task in pending]
        waiting = set(futures)
        while waiting:
            _, waiting = concurrent.futures.wait(waiting, timeout=0.2)
            self._drain(progress)
        self._drain(progress)
        return [f.result() for f in futures]

    def _drain(self, progress: TokenizeProgress) -> None:
        while True:
            try:
                nbytes, rows, tokens = self.queue.get_nowait()
            except queue.Empty:
                return
            progress.advance(nbytes, rows, tokens)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def finished_shard_entries(out_dir: Path) -> list[FileEntry]:
    """Every file of the shards finished so far in `out_dir`, as their completion records (written last) list them."""
    entries = []
    for path in sorted((out_dir / RECORDS_DIR).glob("shard-*.json")):
        record = json.loads(path.read_text())
        entries += [FileEntry(path=f["path"], size=f["size"], checksum=f["checksum"]) for f in [*record["files"], record["quarantine"]]]
    return entries


def tokenize_dataset(
    input: str,
    output: str,
    config: BlockdraftConfig,
    *,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    progress: TokenizeProgress | None = None,
) -> TokenizeSummary:
    """Tokenize completions at `input` (file, folder or completions artifact) into a verified `tokenized` artifact at `output`.

    Options come from `config.tokenize` (thinking, max_length, held_out_fraction, workers, rows_per_shard = rows per
    Arrow file, end_of_turn); `tokenizer`/`chat_template` override the target's (`config.target`). Resumes: shards whose
    completion record matches this run are kept, the rest redone. Returns what was verified at the destination.
    """
    if open_store(output, config.store).local_path() is None:
        # A remote OUTPUT (s3://): preflight in seconds, tokenize into a local staging folder while finished shards
        # are pushed, then push the rest, verify it all there and commit the manifest last.
        from blockdraft.store.transfer import stage_and_push

        def run_locally(local: Path) -> TokenizeSummary:
            return tokenize_dataset(input, str(local), config, tokenizer=tokenizer, chat_template=chat_template, progress=progress)

        summary, pushed = stage_and_push(output, config.store, run_locally, finished_shard_entries)
        summary.output, summary.report = pushed.destination, pushed.verify
        return summary
    started = time.monotonic()
    run = _prepare(input, output, config, tokenizer, chat_template, progress or TokenizeProgress())
    runner = _ShardRunner(config.tokenize.workers, run.src)
    try:
        with _output_lock(run.out_dir):
            if not _already_committed(run):
                records, pending = _resume(run)
                _run_pending(run, runner, records, pending)
                _commit(run, records)
    finally:
        runner.close()
    run.summary.seconds = time.monotonic() - started
    return run.summary


@dataclass
class _Run:
    """One tokenize run, resolved: what it reads, what it writes, and the config digest its shards are keyed on."""

    config: BlockdraftConfig
    src: TokenizerSource
    eot_id: int
    digest: str
    out_store: Store
    out_dir: Path
    in_store: Store
    tasks: list[ShardTask]
    lineage: list[InputRef]
    run_config: dict[str, Any]
    progress: TokenizeProgress
    summary: TokenizeSummary


def _prepare(input: str, output: str, config: BlockdraftConfig, tokenizer: str | None, chat_template: str | None,
             progress: TokenizeProgress) -> _Run:
    opts = config.tokenize
    src, warnings = resolve_tokenizer(config, tokenizer, chat_template)
    for message in warnings:
        progress.warn(message)
    eot_id = _eot_id(src.tokenizer_json, opts.end_of_turn)
    digest = _config_digest(config, src, eot_id)
    out_store = open_store(output, config.store)
    out_dir = out_store.local_path()
    assert out_dir is not None, "remote outputs are staged in a local folder by tokenize_dataset"
    in_store, files, lineage = list_input(input, config.store)
    tasks = [ShardTask(i, f"shard-{i:05d}", key, size, checksum) for i, (key, size, checksum) in enumerate(files)]
    matches = None if src.target_template_sha256 is None else src.target_template_sha256 == src.template.sha256
    run_config = {
        **config.resolved(),
        "tokenize_run": {
            "config_digest": digest,
            "thinking": opts.thinking,
            "template_sha256": src.template.sha256,
            "template_source": src.template_source,
            "target_template_sha256": src.target_template_sha256,
            "template_matches_target": matches,
            "tokenizer_sha256": src.tokenizer_sha256,
            "end_of_turn": opts.end_of_turn,
            "end_of_turn_id": eot_id,
            "split_rule": "held_out iff int(sha256(source_id)[:8 bytes], big-endian) < held_out_fraction * 2**64",
        },
    }
    run_config["tokenize"].pop("workers")  # how many processes ran does not change the rows
    summary = TokenizeSummary(
        output=out_store.url, report=VerifyReport(url=out_store.url, state=State.INCOMPLETE), counts={}, shards_total=len(tasks),
        shards_skipped=0, already_committed=False, template_sha256=src.template.sha256, template_matches_target=matches,
        warnings=warnings,
    )
    return _Run(config, src, eot_id, digest, out_store, out_dir, in_store, tasks, lineage, run_config, progress, summary)


def _already_committed(run: _Run) -> bool:
    """True (and the summary filled from the destination) when the output is verified for this very config and input."""
    existing = verify_artifact(run.out_store)
    m = existing.manifest
    if existing.state is State.VERIFIED and m is not None and m.kind == KIND:
        same_config = m.config.get("tokenize_run", {}).get("config_digest") == run.digest
        if same_config and [ref.model_dump() for ref in m.lineage] == [ref.model_dump() for ref in run.lineage]:
            # Rewriting the manifest would change its sha256 and make every dependent artifact look stale.
            run.summary.report, run.summary.counts, run.summary.already_committed = existing, m.counts, True
            run.summary.shards_skipped = len(run.tasks)
            return True
    return False


def _resume(run: _Run) -> tuple[dict[str, dict[str, Any]], list[ShardTask]]:
    """Uncommit, keep the shards whose records match this run, delete every other leftover; return (kept, pending)."""
    if (run.out_dir / MANIFEST_NAME).exists():
        uncommit(run.out_store)
    records: dict[str, dict[str, Any]] = {}
    for task in run.tasks:
        record = _record_matches(run.out_store, task, run.digest)
        if record is not None:
            records[task.name] = record
    kept = {f["path"] for r in records.values() for f in [*r["files"], r["quarantine"]]}
    kept |= {f"{RECORDS_DIR}/{name}.json" for name in records}
    _clean_leftovers(run.out_dir, kept)
    pending = [t for t in run.tasks if t.name not in records]
    run.summary.shards_skipped = len(run.tasks) - len(pending)
    return records, pending


def _run_pending(run: _Run, runner: _ShardRunner, records: dict[str, dict[str, Any]], pending: list[ShardTask]) -> None:
    opts = run.config.tokenize
    run.progress.start(sum(t.size for t in pending), len(run.tasks), run.summary.shards_skipped)
    settings = WorkerSettings(
        tools_key=_tools_key(run.src.tokenizer_sha256, run.src.template), thinking=opts.thinking, max_length=opts.max_length,
        held_out_fraction=opts.held_out_fraction, rows_per_file=opts.rows_per_shard, eot_id=run.eot_id,
        vocab_size=run.src.vocab_size, config_digest=run.digest, input_url=run.in_store.url,
        store_settings=run.config.store.model_dump(mode="json"), output_dir=str(run.out_dir), schema=output_schema(),
    )
    started = time.monotonic()
    for record in runner.run(pending, settings, run.progress):
        run.summary.worker_peak_rss_mib.append(record.pop("peak_rss_mib"))
        run.summary.worker_seconds.append(record.pop("seconds"))
        run.summary.worker_cpu_seconds.append(record.pop("cpu_seconds"))
        records[record["shard"]] = record
    run.summary.shard_phase_seconds = time.monotonic() - started


def _commit(run: _Run, records: dict[str, dict[str, Any]]) -> None:
    """Split metadata, then the manifest via `commit_artifact` (which verifies every file at the destination first)."""
    ordered = [records[t.name] for t in run.tasks]
    metadata = _write_split_metadata(run.out_dir, ordered, output_schema())
    entries = [FileEntry(path=f["path"], size=f["size"], checksum=f["checksum"]) for r in ordered for f in [*r["files"], r["quarantine"]]]
    entries += [entry_for_local_file(run.out_dir, p) for p in metadata]
    counts = _merge_counts(ordered)
    counts["shards"] = len(run.tasks)
    counts["held_out_fraction"] = run.config.tokenize.held_out_fraction
    run.summary.counts = counts
    run.summary.report = commit_artifact(run.out_store, KIND, entries, config=run.run_config, lineage=run.lineage, counts=counts)
