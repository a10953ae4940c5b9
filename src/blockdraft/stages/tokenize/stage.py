"""The `tokenize` stage: completions -> per-turn Arrow rows with exact loss masks, as a verified artifact.

Layout of the output folder (`datasets.load_from_disk(OUTPUT)` gives a DatasetDict with `train` and `held_out`):

    dataset_dict.json
    train/shard-00000-part-000.arrow ...  state.json  dataset_info.json
    held_out/...                                       (same)
    quarantine/shard-00000.jsonl                       rejected rows, one JSON object each, with the reason
    .blockdraft-shards/shard-00000.json                per-shard completion records (resume)
    blockdraft-manifest.json                           written last, by `commit_artifact`

One shard = one input file, processed start to end by one worker process (`blockdraft.stages.tokenize.shard`). A shard is skipped on a rerun only when its completion
record names this run's config digest and the same input file (key, size, checksum) and every file it lists
reads back with the recorded size and checksum; anything else is redone from scratch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from blockdraft.config import BlockdraftConfig
from blockdraft.data.completions import list_completions
from blockdraft.data.tokenizer import TokenizerSource, end_of_turn_id, resolve_tokenizer
from blockdraft.errors import ConfigError
from blockdraft.stages.tokenize.shard import (
    QUARANTINE_DIR,
    RECORD_FORMAT,
    RECORDS_DIR,
    SPLITS,
    ShardTask,
    WorkerSettings,
    install_tools,
    output_schema,
    tokenize_shard,
    tools_key,
    worker_init,
    write_atomic,
)
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    FileEntry,
    InputRef,
    State,
    VerifyReport,
    commit_artifact,
    entry_for_local_file,
    uncommit,
    verify_artifact,
)
from blockdraft.store.local import TMP_PREFIX

KIND = "tokenized"
EMPTY_SPLIT_FILE = "empty.arrow"


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


# ---------------------------------------------------------------------------------------------- the stage


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
            write_atomic(folder / name, json.dumps(data, indent=2, sort_keys=True).encode())
            written.append(folder / name)
    write_atomic(out / "dataset_dict.json", json.dumps({"splits": list(SPLITS)}).encode())
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
            install_tools(src.tokenizer_json, src.template.text, src.template.variables)
            return
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=worker_init,
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
    eot_id = end_of_turn_id(src.tokenizer_json, opts.end_of_turn)
    digest = _config_digest(config, src, eot_id)
    out_store = open_store(output, config.store)
    out_dir = out_store.local_path()
    assert out_dir is not None, "remote outputs are staged in a local folder by tokenize_dataset"
    in_store, files, lineage = list_completions(input, config.store)
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
        tools_key=tools_key(run.src.tokenizer_sha256, run.src.template), thinking=opts.thinking, max_length=opts.max_length,
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
