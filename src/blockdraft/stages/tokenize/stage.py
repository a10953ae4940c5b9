"""The `tokenize` stage: completions -> per-turn Arrow rows with exact loss masks, as a verified artifact.

The output folder is a DatasetDict as `datasets.save_to_disk` lays it out (`hf_layout`), plus quarantine files, the
finished shards' pieces (`.blockdraft-pieces/`, see `blockdraft.store.stage_io`) and the manifest, written last.

One shard = one input file, processed start to end by one worker process (`shard.py`; `runner.py` runs them). Done and
resume go through the output's `StageOutput`: the output is done when its manifest names this run's stage key (the
config digest and the inputs by content) and verifies; else each shard is kept only when its piece names this run's
config digest and the same input file (key, size, checksum) and every file it lists reads back as listed. Anything else
is deleted and redone from scratch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from blockdraft.config import BlockdraftConfig
from blockdraft.data.completions import list_completions
from blockdraft.data.tokenizer import TokenizerSource, end_of_turn_id, resolve_tokenizer
from blockdraft.errors import ConfigError
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.tokenize.hf_layout import KIND, output_schema, remove_leftovers, write_split_metadata
from blockdraft.stages.tokenize.report import InputFilesFailed, TokenizeSummary, clip_warning
from blockdraft.stages.tokenize.runner import ShardRunner
from blockdraft.stages.tokenize.shard import CLIP_KEYS, SHARD_FORMAT, ShardOutput, ShardTask, WorkerSettings, piece_key, tools_key
from blockdraft.stages.tokenize.shard_io import DiskFull, disk_full_error
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import FileEntry, InputRef, VerifyReport, entry_for_local_file
from blockdraft.store.local import LocalStore
from blockdraft.store.stage_io import StageOutput, recorded_pieces, stage_key
from blockdraft.store.transfer import stage_and_push

STAGE = "tokenize"
LOCK_NAME = ".blockdraft-tokenize.lock"  # in the output folder; held by the one run that writes it
COUNT_KEYS = ("rows_in", "turns_in", "rows_out", "train_rows", "held_out_rows", "tokens", "supervised_tokens", "rejected_rows", "rejected_turns",
              *CLIP_KEYS, "input_files_failed")


def run(
    config: BlockdraftConfig,
    input: str,
    output: str,
    reporter: Reporter | None = None,
    *,
    tokenizer: str | None = None,
    chat_template: str | None = None,
) -> StageResult:
    """Tokenize completions at `input` (file, folder or completions artifact) into a verified `tokenized` artifact at `output`.

    Options come from `config.tokenize` (thinking, max_length, held_out_fraction, workers, rows_per_shard = rows per
    Arrow file, end_of_turn); `tokenizer`/`chat_template` override the target's (`config.target`). Reports (to a
    `Reporter()` when none is given) progress as ("tokenize", input bytes done, input bytes to do, rows=, tokens=), and
    warnings (a template not the target's; more than 1% of the rows clipped to `tokenize.max_length`).
    Resumes: finished shards of this run are kept, the rest redone. Returns what was verified at the destination, with a
    `TokenizeSummary` as details; ConfigError for unusable input or options; `DiskFull` (one line: where, how much) when
    the output's disk fills, after removing the temporary files.

    An input file that cannot be decoded whole (cut short, corrupt, not its format) is left out whole; the other files go
    on, the artifact is committed with the failed files named (`counts.failed_inputs`, a quarantine line each), and then
    `InputFilesFailed` is raised with the result, so a run that lost a file never ends as a plain success. A rerun tries
    the failed files again.
    """
    started = time.perf_counter()
    reporter = reporter or Reporter()
    if open_store(output, config.store).local_path() is None:
        result = _run_to_remote(config, input, output, reporter, tokenizer, chat_template, started)
    else:
        result = _run_local(config, input, output, reporter, tokenizer, chat_template, started)
    if result.details.counts.get("input_files_failed"):
        raise InputFilesFailed(result)
    return result


def _run_local(config: BlockdraftConfig, input: str, output: str, reporter: Reporter, tokenizer: str | None,
               chat_template: str | None, started: float) -> StageResult:
    plan = _plan(config, input, output, tokenizer, chat_template, reporter)
    with ShardRunner(config.tokenize.workers, plan.src) as runner, _output_lock(plan.out_dir):
        report = plan.out.done()
        # An output committed with failed input files is not done: a rerun tries them again (the other shards are kept).
        if report is not None and report.manifest is not None and not report.manifest.counts.get("input_files_failed"):
            # Rewriting the manifest would change its sha256 and make every dependent artifact look stale.
            plan.summary.counts, plan.summary.shards_skipped = report.manifest.counts, len(plan.tasks)
            _warn_if_clipped(plan.summary, reporter)
            return StageResult(STAGE, plan.out.url, report, True, time.perf_counter() - started, plan.summary)
        report = _tokenize(plan, runner, reporter)
    _warn_if_clipped(plan.summary, reporter)
    return StageResult(STAGE, plan.out.url, report, False, time.perf_counter() - started, plan.summary)


def _warn_if_clipped(summary: TokenizeSummary, reporter: Reporter) -> None:
    message = clip_warning(summary.counts, summary.max_length)
    if message is not None:
        reporter.warn(message)
        summary.warnings.append(message)


def finished_shard_entries(local_dir: Path) -> list[FileEntry]:
    """Every file of the shards finished so far in `local_dir`, as their pieces (written after the files) list them."""
    pieces = recorded_pieces(LocalStore(local_dir))
    return [entry for _, piece in sorted(pieces.items()) for entry in piece.files]


def _run_to_remote(config: BlockdraftConfig, input: str, output: str, reporter: Reporter, tokenizer: str | None,
                   chat_template: str | None, started: float) -> StageResult:
    """A remote OUTPUT (s3://): preflight in seconds, tokenize into a local staging folder while finished shards are
    pushed, then push the rest, verify it all there and commit the manifest last."""

    def run_locally(local: Path) -> StageResult:
        return _run_local(config, input, str(local), reporter, tokenizer, chat_template, started)

    staged, pushed = stage_and_push(output, config.store, run_locally, finished_shard_entries)
    result = cast(StageResult, staged)
    return dataclasses.replace(result, url=pushed.destination, report=pushed.verify, seconds=time.perf_counter() - started)


@dataclass
class _Plan:
    """One tokenize run, resolved: what it reads, what it writes, and the config digest its shards are keyed on."""

    config: BlockdraftConfig
    src: TokenizerSource
    eot_id: int
    digest: str
    out: StageOutput
    out_dir: Path
    in_store: Store
    tasks: list[ShardTask]
    lineage: list[InputRef]
    run_config: dict[str, Any]
    summary: TokenizeSummary


def _config_digest(cfg: BlockdraftConfig, src: TokenizerSource, eot_id: int) -> str:
    """What the rows depend on (not `workers`): tokenize options, tokenizer, template, end-of-turn id, shard format."""
    options = cfg.resolved()["tokenize"]
    options.pop("workers")
    data = {"tokenize": options, "tokenizer": src.tokenizer_sha256, "template": src.template.sha256,
            "template_variables": src.template.variables, "eot_id": eot_id, "format": SHARD_FORMAT}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _plan(config: BlockdraftConfig, input: str, output: str, tokenizer: str | None, chat_template: str | None,
          reporter: Reporter) -> _Plan:
    opts = config.tokenize
    src, warnings = resolve_tokenizer(config, tokenizer, chat_template)
    for message in warnings:
        reporter.warn(message)
    eot_id = end_of_turn_id(src.tokenizer_json, opts.end_of_turn)
    digest = _config_digest(config, src, eot_id)
    out_store = open_store(output, config.store)
    out_dir = out_store.local_path()
    assert out_dir is not None, "a remote output is staged in a local folder by run()"
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
    out = StageOutput(out_store, KIND, stage_key({"config_digest": digest}, lineage))
    summary = TokenizeSummary(counts={}, shards_total=len(tasks), shards_skipped=0, template_sha256=src.template.sha256,
                              template_matches_target=matches, warnings=warnings, max_length=opts.max_length)
    return _Plan(config, src, eot_id, digest, out, out_dir, in_store, tasks, lineage, run_config, summary)


@contextlib.contextmanager
def _output_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on the output folder for this run (released when the process dies, even by SIGKILL)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another tokenize is writing {out_dir}; wait for it to finish or pick another OUTPUT") from None
        yield
    finally:
        os.close(fd)


def _tokenize(plan: _Plan, runner: ShardRunner, reporter: Reporter) -> VerifyReport:
    """Uncommit, keep the finished shards, redo the rest, then commit; returns the report read back at the destination.

    A full disk is one line (`DiskFull`), after every temporary file of the output is removed."""
    plan.out.begin()
    try:
        kept = _keep_finished_shards(plan)
        pending = [t for t in plan.tasks if t.name not in kept]
        plan.summary.shards_skipped = len(kept)
        if kept:
            reporter.say(f"resuming: {len(kept)} of {len(plan.tasks)} shards already done (records and files match this run)")
        made = _run_pending(plan, runner, pending, reporter)
        return _commit(plan, [kept.get(t.name) or made[t.name] for t in plan.tasks])
    except DiskFull:
        plan.out.store.abort_partial_uploads()
        raise
    except OSError as exc:
        error = disk_full_error(exc, plan.out_dir)
        if error is None:
            raise
        plan.out.store.abort_partial_uploads()
        raise error from None


def _keep_finished_shards(plan: _Plan) -> dict[str, ShardOutput]:
    """The shards whose pieces match this run, by name; every other piece, temporary file and unnamed file is deleted.

    A piece recorded before clipping was counted (no CLIP_KEYS in its stats) is redone, so the run's counts stay exact.
    """
    kept = {}
    for task in plan.tasks:
        piece = plan.out.finished_piece(task.name, piece_key(plan.digest, task))
        if piece is not None and all(k in piece.counts.get("stats", {}) for k in CLIP_KEYS):
            kept[task.name] = ShardOutput(task.name, list(piece.files), piece.counts)
    for name in plan.out.recorded_pieces():
        if name not in kept:
            plan.out.drop_piece(name)
    plan.out.store.abort_partial_uploads()  # temporary files of a killed run
    remove_leftovers(plan.out_dir, {entry.path for shard in kept.values() for entry in shard.files})
    return kept


class _Progress:
    """Turns the workers' deltas into the reporter's absolute progress over the input bytes still to tokenize."""

    def __init__(self, reporter: Reporter, total_bytes: int) -> None:
        self.reporter, self.total = reporter, total_bytes
        self.bytes = self.rows = self.tokens = 0
        reporter.progress(STAGE, 0, total_bytes, rows=0, tokens=0)

    def advance(self, nbytes: int, rows: int, tokens: int) -> None:
        self.bytes, self.rows, self.tokens = self.bytes + nbytes, self.rows + rows, self.tokens + tokens
        self.reporter.progress(STAGE, self.bytes, self.total, rows=self.rows, tokens=self.tokens)


def _run_pending(plan: _Plan, runner: ShardRunner, pending: list[ShardTask], reporter: Reporter) -> dict[str, ShardOutput]:
    opts = plan.config.tokenize
    settings = WorkerSettings(
        tools_key=tools_key(plan.src.tokenizer_sha256, plan.src.template), thinking=opts.thinking, max_length=opts.max_length,
        held_out_fraction=opts.held_out_fraction, rows_per_file=opts.rows_per_shard, eot_id=plan.eot_id,
        vocab_size=plan.src.vocab_size, config_digest=plan.digest, input_url=plan.in_store.url, store=plan.config.store,
        output_dir=str(plan.out_dir), output_key=plan.out.key, schema=output_schema(),
    )
    progress = _Progress(reporter, sum(t.size for t in pending))
    started = time.monotonic()
    runs = runner.run(pending, settings, progress.advance)
    plan.summary.shard_phase_seconds = time.monotonic() - started
    plan.summary.worker_seconds = [r.seconds for r in runs]
    plan.summary.worker_cpu_seconds = [r.cpu_seconds for r in runs]
    plan.summary.worker_peak_rss_mib = [r.peak_rss_mib for r in runs]
    return {r.output.name: r.output for r in runs}


def _merge_counts(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' row statistics summed: every count in COUNT_KEYS, and rejections by reason, rows by thinking mode; and
    the input files left out whole, by key (`failed_inputs`: reason, detail, rows read before the fault)."""
    total: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    thinking: Counter[str] = Counter()
    failed: dict[str, Any] = {}
    for s in stats:
        c = dict(s)
        rejected.update(c.pop("rejected"))
        thinking.update(c.pop("thinking"))
        failed.update(c.pop("failed_inputs", {}))  # absent from pieces recorded before inputs could fail
        total.update(c)
    return {**{k: total.get(k, 0) for k in COUNT_KEYS}, "rejected": dict(sorted(rejected.items())), "thinking": dict(sorted(thinking.items())),
            "failed_inputs": dict(sorted(failed.items()))}


def _commit(plan: _Plan, shards: list[ShardOutput]) -> VerifyReport:
    """Split metadata, then the manifest (`StageOutput.commit` verifies every file at the destination first)."""
    metadata = write_split_metadata(plan.out_dir, [s.arrow_files() for s in shards], output_schema())
    entries = [entry for s in shards for entry in s.files] + [entry_for_local_file(plan.out_dir, p) for p in metadata]
    counts = _merge_counts([s.stats for s in shards])
    counts["shards"] = len(plan.tasks)
    counts["held_out_fraction"] = plan.config.tokenize.held_out_fraction
    plan.summary.counts = counts
    return plan.out.commit(entries, config=plan.run_config, lineage=plan.lineage, counts=counts)
