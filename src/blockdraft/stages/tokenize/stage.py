"""The `tokenize` stage: completions -> per-turn Arrow rows with exact loss masks, as a verified artifact.

The output folder is a DatasetDict as `datasets.save_to_disk` lays it out (`hf_layout`), plus quarantine files, the
finished shards' pieces (`.blockdraft-pieces/`, see `blockdraft.store.stage_io`) and the manifest, written last.

One shard = one task: an input file, or a part of a large one (`plan.py`), processed by one worker process (`shard.py`;
`runner.py` runs them). Done and resume go through the output's `StageOutput`: the output is done when its manifest
names this run's stage key (the config digest and the inputs by content) and verifies; else each shard is kept only
when its piece names this run's config digest and the same part of the same input file (key, size), every file it lists
reads back as listed, and the input bytes it was made from are unchanged (`plan.input_unchanged`). Anything else is
deleted and redone from scratch.

Each input byte is checksummed once, by the task that reads it: the parent lists inputs without reading them, and a local
file's checksum (for the lineage) is put together from its tasks' (`plan.file_checksum`). Only a rerun over a committed output
asks for checksums up front, to tell whether it is done (`_already_done`: a raw input file is read only if it changed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from blockdraft.config import BlockdraftConfig
from blockdraft.data.inputs import STAT_PIN, InputFile, list_inputs
from blockdraft.data.tokenizer import TokenizerSource, check_mask_token, end_of_turn_id, resolve_tokenizer
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.tokenize.hf_layout import KIND, output_schema, remove_leftovers, write_split_metadata
from blockdraft.stages.tokenize.plan import INPUT_READ, ShardTask, file_checksum, input_unchanged, piece_key, plan_tasks
from blockdraft.stages.tokenize.report import InputFilesFailed, TokenizeSummary, clip_warning, merge_counts
from blockdraft.stages.tokenize.runner import ShardRunner
from blockdraft.stages.tokenize.shard import CLIP_KEYS, SHARD_FORMAT, ShardOutput, WorkerSettings, tools_key
from blockdraft.stages.tokenize.shard_io import DiskFull, disk_full_error, unwritable_error
from blockdraft.store import ObjectInfo, Store, open_store
from blockdraft.store.artifact import FileEntry, InputRef, VerifyReport, entry_for_local_file, raw_input, read_manifest
from blockdraft.store.local import LocalStore
from blockdraft.store.stage_io import StageOutput, recorded_pieces, refuse_nested, stage_key
from blockdraft.store.staged import stage_and_push

STAGE = "tokenize"
LOCK_NAME = ".blockdraft-tokenize.lock"  # in the output folder; held by the one run that writes it


def run(
    config: BlockdraftConfig,
    input: str,
    output: str,
    reporter: Reporter | None = None,
    *,
    force: bool = False,
    tokenizer: str | None = None, chat_template: str | None = None,
) -> StageResult:
    """Tokenize completions at `input` (file, folder or completions artifact) into a verified `tokenized` artifact at `output`.

    Options come from `config.tokenize` (thinking, max_length, held_out_fraction, workers, task_bytes = input bytes per
    task, file_bytes = bytes per Arrow file, rows_per_shard = rows per Arrow file if set, end_of_turn);
    `tokenizer`/`chat_template` override the target's (`config.target`). Reports (to a `Reporter()` when none is given)
    progress as ("tokenize", input bytes done, input bytes to do, rows=, tokens=), and warnings (a template not the
    target's; more than 1% of the rows clipped to `tokenize.max_length`).
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
    out_store = open_store(output, config.store)
    refuse_nested(open_store(input, config.store), out_store)
    if out_store.local_path() is None:
        result = _run_to_remote(config, input, output, reporter, tokenizer, chat_template, started, force)
    else:
        result = _run_local(config, input, output, reporter, tokenizer, chat_template, started, force)
    if result.details.counts.get("input_files_failed"):
        raise InputFilesFailed(result)
    return result


def _run_local(config: BlockdraftConfig, input: str, output: str, reporter: Reporter, tokenizer: str | None,
               chat_template: str | None, started: float, force: bool) -> StageResult:
    plan = _plan(config, input, output, tokenizer, chat_template, reporter, force)
    with _writable(plan.out_dir), ShardRunner(config.tokenize.workers, plan.src) as runner, _output_lock(plan.out_dir):
        report = _already_done(plan)
        if report is not None and report.manifest is not None:
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
                   chat_template: str | None, started: float, force: bool) -> StageResult:
    """A remote OUTPUT (s3://): preflight in seconds, tokenize into a local staging folder while finished shards are
    pushed, then push the rest, verify it all there and commit the manifest last."""

    def run_locally(local: Path) -> StageResult:
        return _run_local(config, input, str(local), reporter, tokenizer, chat_template, started, force)

    staged, pushed = stage_and_push(output, config.store, KIND, run_locally, finished_shard_entries, reporter=reporter, force=force)
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
    files: list[InputFile]
    tasks: list[ShardTask]
    artifact_lineage: list[InputRef] | None  # an artifact input's; raw files' is made once their checksums are known
    checksums: dict[str, str]  # input key -> CRC64NVME known before reading (listed, or from the checksum cache)
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
          reporter: Reporter, force: bool) -> _Plan:
    opts = config.tokenize
    src, warnings = resolve_tokenizer(config.target, tokenizer, chat_template)
    for message in warnings:
        reporter.warn(message)
    eot_id = end_of_turn_id(src.tokenizer_json, opts.end_of_turn)
    check_mask_token(config.dflash.mask_token_id, src.tokenizer_json)
    digest = _config_digest(config, src, eot_id)
    out_store = open_store(output, config.store)
    out_dir = out_store.local_path()
    assert out_dir is not None, "a remote output is staged in a local folder by run()"
    in_store, files, artifact_lineage = list_inputs(input, config.store)
    tasks = plan_tasks(in_store, files, opts.task_bytes)
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
    out = StageOutput(out_store, KIND, "", force=force, reporter=reporter)  # its key names the inputs by content: set once their checksums are known
    summary = TokenizeSummary(counts={}, shards_total=len(tasks), shards_skipped=0, template_sha256=src.template.sha256,
                              template_matches_target=matches, warnings=warnings, max_length=opts.max_length, input_files=len(files))
    checksums = {f.key: f.checksum for f in files if f.checksum}
    return _Plan(config, src, eot_id, digest, out, out_dir, in_store, files, tasks, artifact_lineage, checksums, run_config, summary)


def _lineage(plan: _Plan) -> list[InputRef]:
    """The inputs by content: an artifact's manifest, or each raw file with its checksum (`plan.checksums`) or ETag."""
    if plan.artifact_lineage is not None:
        return plan.artifact_lineage
    return [raw_input(plan.in_store, ObjectInfo(f.key, f.size, plan.checksums.get(f.key), f.etag)) for f in plan.files]


def _already_done(plan: _Plan) -> VerifyReport | None:
    """The output's report when it is already this run's output, verified; else None (then nothing was read).

    An output committed with failed input files is not done: a rerun tries them again (the other shards are kept). Only
    an output of the same config digest asks for the inputs' checksums: a local file's from the checksum cache, read
    only when it changed since it was last read."""
    try:
        found = read_manifest(plan.out.store)
    except ArtifactError:
        return None
    if found is None or found[0].counts.get("input_files_failed") or found[0].config.get("tokenize_run", {}).get("config_digest") != plan.digest:
        return None
    for f in plan.files:
        if f.key not in plan.checksums and (info := plan.in_store.head(f.key)) is not None and info.checksum:
            plan.checksums[f.key] = info.checksum
    plan.out.key = stage_key({"config_digest": plan.digest}, _lineage(plan))
    return plan.out.done()


@contextlib.contextmanager
def _writable(out_dir: Path) -> Iterator[None]:
    """The output folder written inside the block: one that is a file is refused up front; a write refused by the system
    (read-only, not permitted) is one line naming the folder (`unwritable_error`)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output {out_dir} is a file, not a folder; point OUTPUT at a folder (new, or a tokenize output)")
    try:
        yield
    except OSError as exc:
        error = unwritable_error(exc, out_dir)
        if error is None:
            raise
        raise error from None


@contextlib.contextmanager
def _output_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on the output folder for this run (released when the process dies); made by a run that fails, it goes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    created = not (out_dir / LOCK_NAME).exists()
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another tokenize is writing {out_dir}; wait for it to finish or pick another OUTPUT") from None
        try:
            yield
        except BaseException:
            if created:
                (out_dir / LOCK_NAME).unlink(missing_ok=True)
            raise
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
        return _commit(plan, _drop_failed_files(plan, {t.name: kept.get(t.name) or made[t.name] for t in plan.tasks}))
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

    def finished(task: ShardTask) -> ShardOutput | None:
        piece = plan.out.finished_piece(task.name, piece_key(plan.digest, task))
        if piece is None or not all(k in piece.counts.get("stats", {}) for k in CLIP_KEYS):
            return None
        if not input_unchanged(plan.in_store, task, piece.counts.get(INPUT_READ, {})):
            return None
        return ShardOutput(task.name, list(piece.files), piece.counts)

    recorded = plan.out.recorded_pieces()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # each check reads files back (and maybe input bytes)
        found = list(pool.map(finished, [t for t in plan.tasks if t.name in recorded]))
    kept = {shard.name: shard for shard in found if shard is not None}
    for name in recorded:
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
        held_out_fraction=opts.held_out_fraction, rows_per_file=opts.rows_per_shard, file_bytes=opts.file_bytes,
        max_row_bytes=opts.max_row_bytes, eot_id=plan.eot_id,
        vocab_size=plan.src.vocab_size, config_digest=plan.digest, input_url=plan.in_store.url, store=plan.config.store,
        output_dir=str(plan.out_dir), output_key=plan.out.key, schema=output_schema(),
    )
    progress = _Progress(reporter, sum(t.share for t in pending))
    started = time.monotonic()
    runs = runner.run(pending, settings, progress.advance)
    plan.summary.shard_phase_seconds = time.monotonic() - started
    plan.summary.worker_seconds = [r.seconds for r in runs]
    plan.summary.worker_cpu_seconds = [r.cpu_seconds for r in runs]
    plan.summary.worker_peak_rss_mib = [r.peak_rss_mib for r in runs]
    by_process: dict[int, float] = {}
    for r in runs:
        by_process[r.pid] = by_process.get(r.pid, 0.0) + r.cpu_seconds
    plan.summary.process_cpu_seconds = dict(sorted(by_process.items()))
    return {r.output.name: r.output for r in runs}


def _drop_failed_files(plan: _Plan, outputs: dict[str, ShardOutput]) -> list[ShardOutput]:
    """The shards to commit, in task order: a file that one of its tasks could not read whole is left out whole, as one
    failed input (the first failed task's quarantine line); its other tasks' pieces and files are deleted."""
    failed_files = {t.file_index for t in plan.tasks if outputs[t.name].stats.get("input_files_failed")}
    keep: list[ShardOutput] = []
    named: set[int] = set()
    for task in plan.tasks:
        shard = outputs[task.name]
        if task.file_index not in failed_files or (shard.stats.get("input_files_failed") and task.file_index not in named):
            keep.append(shard)
            named.add(task.file_index)
            continue
        plan.out.drop_piece(task.name)  # the piece first: a crash in between never leaves a piece over missing files
        for entry in shard.files:
            (plan.out_dir / entry.path).unlink(missing_ok=True)
    return keep


def _file_checksums(plan: _Plan, shards: list[ShardOutput]) -> None:
    """Each file's checksum put together from what its tasks read, compared with the one known before reading (listed, or
    from the checksum cache): ArtifactError when they differ, the input changed while it was tokenized. A local file's
    goes into `plan.checksums` for the lineage (a failed file's, when its tasks did not read it all, from the store)."""
    reads = {s.name: s.counts.get(INPUT_READ, {}) for s in shards}
    by_file: dict[int, list[dict[str, Any]]] = {}
    for task in plan.tasks:
        by_file.setdefault(task.file_index, []).append(reads.get(task.name, {}))
    for i, f in enumerate(plan.files):
        combined = file_checksum(f.size, by_file.get(i, []))
        known = plan.checksums.get(f.key)
        if combined is not None and known is not None and combined != known:
            raise ArtifactError(f"input {f.key} changed while it was tokenized (its tasks read crc64nvme {combined}; it had "
                                f"{known} when listed); rerun when the input is complete")
        if not f.pin.startswith(STAT_PIN) or known is not None:
            continue  # a store object keeps what its store lists (an ETag alone stays so)
        if combined is None and (info := plan.in_store.head(f.key)) is not None:
            combined = info.checksum  # a file left out as unreadable: read once more, for the lineage
        if combined is not None:
            plan.checksums[f.key] = combined


def _commit(plan: _Plan, shards: list[ShardOutput]) -> VerifyReport:
    """Split metadata, then the manifest (`StageOutput.commit` verifies every file at the destination first)."""
    _file_checksums(plan, shards)
    lineage = _lineage(plan)
    plan.out.key = stage_key({"config_digest": plan.digest}, lineage)
    metadata = write_split_metadata(plan.out_dir, [s.arrow_files() for s in shards], output_schema())
    entries = [entry for s in shards for entry in s.files] + [entry_for_local_file(plan.out_dir, p) for p in metadata]
    counts = merge_counts([s.stats for s in shards])
    counts["shards"] = len(plan.tasks)
    counts["input_files"] = len(plan.files)
    counts["held_out_fraction"] = plan.config.tokenize.held_out_fraction
    plan.summary.counts = counts
    return plan.out.commit(entries, config=plan.run_config, lineage=lineage, counts=counts)
