"""The `tokenize` stage: completions -> per-turn Arrow rows with exact loss masks, as a verified artifact.

The output folder is a DatasetDict as `datasets.save_to_disk` lays it out (`hf_layout`), plus quarantine files, the
finished shards' pieces (`.blockdraft-pieces/`, see `blockdraft.store.output`) and the manifest, written last.

One shard = one task: an input file, or a part of a large one (`tasks.py`), processed by one worker process (`shard.py`;
`runner.py` runs them). Whether the output is done is its `StageOutput`'s to say: done when its manifest records this
run's config digest (`made_with`) and stage key (the digest and the inputs by content) and verifies, and nothing failed
(an input file left out makes it partial: a rerun tries it again). Else the finished shards are kept (`resume.py`) and
the rest redone; the lease (`StageOutput.begin`) keeps a second run from writing the same output meanwhile.

Each input byte is checksummed once, by the task that reads it: the parent lists inputs without reading them, and a
local file's checksum (for the lineage) is put together from its tasks' (`tasks.checksum_from_reads`). Only a rerun over
a committed output of this config asks for checksums up front, to tell whether it is done (`_InputPins.key`: a raw input
file is read only if it changed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from blockdraft.added_tokens import known_mask_token_id, local_text_config, tokenizer_added_tokens
from blockdraft.config import BlockdraftConfig, DFlashConfig, StoreConfig, TargetConfig, TokenizeConfig
from blockdraft.data.formats import TOKENIZED_KIND
from blockdraft.data.inputs import STAT_PIN, InputFile, list_inputs
from blockdraft.data.seen_ids import SEEN_IDS, SeenIds, mask_in_data_problem
from blockdraft.data.tokenizer import TokenizerSource, check_mask_token, end_of_turn_id, resolve_tokenizer
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.tokenize.hf_layout import output_schema, write_split_metadata
from blockdraft.stages.tokenize.report import InputFilesFailed, TokenizeSummary, clip_warning, merge_counts
from blockdraft.stages.tokenize.resume import drop_failed_files, finished_shard_entries, keep_finished_shards
from blockdraft.stages.tokenize.runner import ShardRunner
from blockdraft.stages.tokenize.shard import SHARD_FORMAT, ShardOutput, ShardRun, WorkerSettings, tools_key
from blockdraft.stages.tokenize.tasks import (
    INPUT_READ,
    TASK_SIZE,
    ShardTask,
    checksum_from_reads,
    piece_key,
    plan_tasks,
    task_size,
)
from blockdraft.store import ObjectInfo, Store, open_store
from blockdraft.store.artifact import InputRef, VerifyReport, raw_input
from blockdraft.store.output import STAGE_KEY, StageOutput, recorded_pieces, refuse_nested, stage_key
from blockdraft.store.transfer import stage_and_push
from blockdraft.store.writable import DiskFull, disk_full_error, unwritable_error

STAGE = "tokenize"
DIGEST_FIELD = "tokenize_run.config_digest"  # where the manifest's config records the digest its rows depend on
FAILED_FIELD = "failed_inputs"  # the counts field naming the input files a commit left out, by key


def run(
    config: BlockdraftConfig,
    input: str,
    output: str,
    reporter: Reporter | None = None,
    *,
    force: bool = False,
    spawn_one: bool = False,
) -> StageResult:
    """Tokenize completions at `input` (file, folder or completions artifact) into a verified `tokenized` artifact at
    `output`.

    Options come from `config.tokenize` (thinking, max_length, held_out_fraction, workers, task_bytes = input bytes per
    task, file_bytes = bytes per Arrow file, rows_per_shard = rows per Arrow file if set, end_of_turn);
    the tokenizer and template from `config.target` (`resolve_tokenizer`). Reports (to a `Reporter()` when none is
    given) progress as ("tokenize", input bytes done, input bytes to do, rows=, tokens=), and warnings (a template not
    the target tokenizer's own; more than 1% of the rows clipped to `tokenize.max_length`). `spawn_one`: run even a
    single worker in a spawned process (`ShardRunner`).
    Resumes: finished shards of this run are kept, the rest redone. Returns what was verified at the destination, with a
    `TokenizeSummary` as details; ConfigError for unusable input or options; `DiskFull` (one line: where, how much) when
    the output's disk fills, after removing the temporary files.

    An input file that cannot be decoded whole (cut short, corrupt, not its format) is left out whole; the other files
    go on, the artifact is committed with the failed files named (`counts.failed_inputs`, a quarantine line each), and
    then `InputFilesFailed` is raised with the result, so a run that lost a file never ends as a plain success. A rerun
    tries the failed files again.
    """
    started = time.perf_counter()
    reporter = reporter or Reporter()
    out_store = open_store(output, config.store)
    refuse_nested(open_store(input, config.store), out_store)
    if out_store.local_path() is None:
        result = _run_to_remote(config, input, output, reporter, started, force, spawn_one)
    else:
        result = _run_local(config, input, output, reporter, started, force, spawn_one)
    if result.details.counts.get("input_files_failed"):
        raise InputFilesFailed(result)
    _check_mask_in_rows(config.dflash, config.target, result)
    return result


def _mask_token_id(dflash: DFlashConfig, target: TargetConfig) -> int | None:
    """The mask id training will use: dflash.mask_token_id, else the target family's reserved one (None: neither)."""
    mask = dflash.mask_token_id
    return mask if mask is not None else known_mask_token_id(local_text_config(target.path))


def _check_mask_in_rows(dflash: DFlashConfig, target: TargetConfig, result: StageResult) -> None:
    """ConfigError (one line, naming an id that fits) when the committed rows hold the mask id training will use. The
    artifact stays as committed: its rows are right, the mask id is not, and a rerun with another one finds it done."""
    mask, record = _mask_token_id(dflash, target), result.details.counts.get(SEEN_IDS)
    if mask is None or record is None:
        return
    text = local_text_config(target.path)
    seen = SeenIds.from_record(record)
    folder = target.tokenizer or target.path
    added = tokenizer_added_tokens(Path(folder)) if folder else {}
    rows = text.get("vocab_size")
    vocab_size = rows if isinstance(rows, int) else seen.size  # the target's embedding rows; else the tokenizer's ids
    if problem := mask_in_data_problem(mask, seen, result.url, vocab_size, added, known_mask_token_id(text)):
        raise ConfigError(f"{problem} (the artifact is committed and kept; train refuses this mask id on it)")


def _run_local(config: BlockdraftConfig, input: str, output: str, reporter: Reporter, started: float, force: bool,
               spawn_one: bool) -> StageResult:
    plan = _plan(config.tokenize, config.target, config.dflash, config.store, config.resolved(), input, output,
                 reporter, force)
    with _writable(plan.out_dir), ShardRunner(plan.opts.workers, plan.src, spawn_one) as runner:
        report = plan.out.done()
        done = report is not None and report.manifest is not None
        if report is not None and done:
            # Left as it is: rewriting the manifest would change its sha256 and make every dependent artifact look
            # stale.
            ran = _Ran(kept=len(plan.tasks))
        else:
            report, ran = _tokenize(plan, runner, reporter)
    assert report.manifest is not None, "a done or committed output has its manifest"
    summary = _summary(plan, report.manifest.counts, ran, reporter)
    return StageResult(STAGE, plan.out.url, report, done, time.perf_counter() - started, summary)


@dataclass(frozen=True)
class _Ran:
    """What this call did to the output: `kept` shards from an earlier run, the shards it ran and their phase's
    seconds."""

    kept: int
    runs: list[ShardRun] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def _summary(plan: _Plan, counts: dict[str, Any], ran: _Ran, reporter: Reporter) -> TokenizeSummary:
    """The run's summary, from the committed manifest's `counts` and what this call ran; warns when rows were
    clipped."""
    warnings = list(plan.warnings)
    max_length = plan.opts.max_length
    if (message := clip_warning(counts, max_length)) is not None:
        reporter.warn(message)
        warnings.append(message)
    by_process: dict[int, float] = {}
    for r in ran.runs:
        by_process[r.pid] = by_process.get(r.pid, 0.0) + r.cpu_seconds
    return TokenizeSummary(
        counts=counts, shards_total=len(plan.tasks), shards_skipped=ran.kept, template_sha256=plan.src.template.sha256,
        template_matches_target=_matches_target(plan.src), warnings=warnings, max_length=max_length,
        shard_phase_seconds=ran.seconds, worker_seconds=[r.seconds for r in ran.runs],
        worker_cpu_seconds=[r.cpu_seconds for r in ran.runs], worker_peak_rss_mib=[r.peak_rss_mib for r in ran.runs],
        input_files=len(plan.inputs.files), process_cpu_seconds=dict(sorted(by_process.items())),
    )


def _matches_target(src: TokenizerSource) -> bool | None:
    """Whether the template is the target's own (None: the target names none)."""
    return None if src.target_template_sha256 is None else src.target_template_sha256 == src.template.sha256


def _run_to_remote(config: BlockdraftConfig, input: str, output: str, reporter: Reporter, started: float, force: bool,
                   spawn_one: bool) -> StageResult:
    """A remote OUTPUT (s3://): preflight in seconds, tokenize into a local staging folder while finished shards are
    pushed, then push the rest, verify it all there and commit the manifest last."""

    def run_locally(local: Path) -> StageResult:
        return _run_local(config, input, str(local), reporter, started, force, spawn_one)

    staged, pushed = stage_and_push(output, config.store, TOKENIZED_KIND, run_locally, finished_shard_entries,
                                    reporter=reporter, force=force)
    result = cast(StageResult, staged)
    return dataclasses.replace(result, url=pushed.destination, report=pushed.verify,
                               seconds=time.perf_counter() - started)


class _InputPins:
    """The inputs by content: an artifact input's lineage, or each raw file with its CRC64NVME as known (listed, asked
    of the store, or put together from what its tasks read) or its ETag."""

    def __init__(self, store: Store, files: list[InputFile], artifact_lineage: list[InputRef] | None) -> None:
        self.store, self.files, self.artifact_lineage = store, files, artifact_lineage
        self.checksums = {f.key: f.checksum for f in files if f.checksum}
        self.read = False  # whether the tasks' reads have been put together (`combine`)

    def key(self, digest: str) -> str:
        """The output's stage key: the config digest and the inputs by content. Before the tasks ran (a rerun asking
        whether the output is done), a checksum not known yet is asked of the store: a local file's comes from the
        checksum cache, read only when it changed since it was last read."""
        if not self.read:
            for f in self.files:
                if f.key not in self.checksums and (info := self.store.head(f.key)) is not None and info.checksum:
                    self.checksums[f.key] = info.checksum
        return stage_key({"config_digest": digest}, self.lineage())

    def lineage(self) -> list[InputRef]:
        if self.artifact_lineage is not None:
            return self.artifact_lineage
        return [raw_input(self.store, ObjectInfo(f.key, f.size, self.checksums.get(f.key), f.etag)) for f in self.files]

    def combine(self, tasks: list[ShardTask], shards: list[ShardOutput]) -> None:
        """Each file's checksum put together from what its tasks read, compared with the one known before reading:
        ArtifactError when they differ, the input changed while it was tokenized. A local file's is kept for the lineage
        (a failed file's, when its tasks did not read it all, asked of the store)."""
        reads = {s.name: s.counts.get(INPUT_READ, {}) for s in shards}
        by_file: dict[int, list[dict[str, Any]]] = {}
        for task in tasks:
            by_file.setdefault(task.file_index, []).append(reads.get(task.name, {}))
        self.read = True
        for i, f in enumerate(self.files):
            combined = checksum_from_reads(f.size, by_file.get(i, []))
            known = self.checksums.get(f.key)
            if combined is not None and known is not None and combined != known:
                raise ArtifactError(f"input {f.key} changed while it was tokenized (its tasks read crc64nvme "
                                    f"{combined}; it had {known} when listed); rerun when the input is complete")
            if not f.pin.startswith(STAT_PIN) or known is not None:
                continue  # a store object keeps what its store lists (an ETag alone stays so)
            if combined is None and (info := self.store.head(f.key)) is not None:
                combined = info.checksum  # a file left out as unreadable: read once more, for the lineage
            if combined is not None:
                self.checksums[f.key] = combined


@dataclass(frozen=True)
class _Plan:
    """One tokenize run, resolved once (`_plan`): its options (`opts`, [tokenize]) and where the store settings
    (`store`) say its input and output are, what it reads, what it writes, the config digest its shards are keyed on,
    the config its manifest records (`run_config`) and the tokenizer's warnings."""

    opts: TokenizeConfig
    store: StoreConfig
    src: TokenizerSource
    eot_id: int
    digest: str
    out: StageOutput
    out_dir: Path
    inputs: _InputPins
    cut: _Cut
    run_config: dict[str, Any]
    warnings: list[str]

    @property
    def tasks(self) -> list[ShardTask]:
        return self.cut.tasks


@dataclass(frozen=True)
class _Cut:
    """How a run cuts its input: its `tasks`, of at most about `size` input bytes each; `recorded`: the finished pieces
    the output held when the cut was chosen; `kept_earlier`: the size is the one those pieces were cut with, not the one
    for this run's workers, so that they are kept."""

    tasks: list[ShardTask]
    size: int
    recorded: int
    kept_earlier: bool = False


def _cut(opts: TokenizeConfig, in_store: Store, files: list[InputFile], out_store: Store, digest: str) -> _Cut:
    """The run's tasks, sized for its workers (`task_size`). When the output holds finished pieces of this config that
    were cut with another size (a run with another number of workers, or over other inputs), and more of them match
    that cut than this one, the input is cut that way instead, so that a resume keeps them: rows never depend on the
    cut, and finished work is worth more than an even share. A piece that records no size was cut with `task_bytes`."""
    size = task_size(sum(f.size for f in files), opts.workers, opts.task_bytes, opts.min_task_bytes)
    pieces = recorded_pieces(out_store)
    cut = _Cut(plan_tasks(in_store, files, size), size, len(pieces))
    recorded = {name: piece.config.get(STAGE_KEY) for name, piece in pieces.items()}

    def kept(tasks: list[ShardTask]) -> int:
        return sum(recorded.get(t.name) == piece_key(digest, t) for t in tasks if t.name in recorded)

    best = kept(cut.tasks)
    if best == len(recorded):
        return cut
    sizes = Counter(p.counts.get(TASK_SIZE, opts.task_bytes) for p in pieces.values())
    for other, _ in sizes.most_common():
        if not isinstance(other, int) or other == size or not 1024 <= other <= opts.task_bytes:
            continue  # not a size a run of this config could have chosen
        earlier = _Cut(plan_tasks(in_store, files, other), other, len(pieces), kept_earlier=True)
        if (found := kept(earlier.tasks)) > best:
            cut, best = earlier, found
    return cut


def _config_digest(opts: TokenizeConfig, src: TokenizerSource, eot_id: int) -> str:
    """What the rows depend on: tokenize options, tokenizer, template, end-of-turn id, shard format. Not `workers` nor
    `min_task_bytes`: they only choose how the input is cut into tasks, and the rows are the same for any cut (so a
    rerun with another number of workers finds its output done, or resumes it)."""
    options = opts.resolved()
    options.pop("workers")
    options.pop("min_task_bytes")
    data = {"tokenize": options, "tokenizer": src.tokenizer_sha256, "template": src.template.sha256,
            "template_variables": src.template.variables, "eot_id": eot_id, "format": SHARD_FORMAT}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _plan(
    opts: TokenizeConfig, target: TargetConfig, dflash: DFlashConfig, store: StoreConfig, recorded: dict[str, Any],
    input: str, output: str, reporter: Reporter, force: bool,
) -> _Plan:
    """Plan a run from the sections it reads: `opts` ([tokenize]), `target` (tokenizer, template, the target's config),
    `dflash` (the mask id training will use), `store`; `recorded`: the whole config resolved
    (`BlockdraftConfig.resolved`), which the manifest records with this run's [tokenize] (less `workers`) and what it
    resolved (`tokenize_run`)."""
    src, warnings = resolve_tokenizer(target)
    for message in warnings:
        reporter.warn(message)
    eot_id = end_of_turn_id(src.tokenizer_json, opts.end_of_turn)
    # The mask id training will use, the derived default included, must be none of the tokenizer's added tokens.
    vocab_size = local_text_config(target.path).get("vocab_size")
    check_mask_token(_mask_token_id(dflash, target), src.tokenizer_json, vocab_size)
    digest = _config_digest(opts, src, eot_id)
    out_store = open_store(output, store)
    out_dir = out_store.local_path()
    assert out_dir is not None, "a remote output is staged in a local folder by run()"
    in_store, files, artifact_lineage = list_inputs(input, store)
    cut = _cut(opts, in_store, files, out_store, digest)
    options = opts.resolved()
    options.pop("workers")  # how many processes ran does not change the rows
    run_config = {
        **recorded,
        "tokenize": options,
        "tokenize_run": {
            "config_digest": digest,
            "thinking": opts.thinking,
            "template_sha256": src.template.sha256,
            "template_source": src.template_source,
            "target_template_sha256": src.target_template_sha256,
            "template_matches_target": _matches_target(src),
            "tokenizer_sha256": src.tokenizer_sha256,
            "end_of_turn": opts.end_of_turn,
            "end_of_turn_id": eot_id,
            "task_size": cut.size,
            "split_rule": "held_out iff int(sha256(group, else source_id)[:8 bytes], big-endian) < held_out_fraction * "
                          "2**64",
        },
    }
    inputs = _InputPins(in_store, files, artifact_lineage)
    # The key names the inputs by content: asked for only of an output of this config, and at commit.
    out = StageOutput(out_store, TOKENIZED_KIND, lambda: inputs.key(digest), made_with={DIGEST_FIELD: digest},
                      failures=FAILED_FIELD, force=force, reporter=reporter)
    return _Plan(opts=opts, store=store, src=src, eot_id=eot_id, digest=digest, out=out, out_dir=out_dir, inputs=inputs,
                 cut=cut, run_config=run_config, warnings=warnings)


@contextlib.contextmanager
def _writable(out_dir: Path) -> Iterator[None]:
    """The output folder written inside the block: one that is a file is refused up front; a write refused by the system
    (read-only, not permitted) is one line naming the folder (`unwritable_error`)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output {out_dir} is a file, not a folder; point OUTPUT at a folder (new, or a tokenize "
                          "output)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as exc:
        error = unwritable_error(exc, out_dir)
        if error is None:
            raise
        raise error from None


def _tokenize(plan: _Plan, runner: ShardRunner, reporter: Reporter) -> tuple[VerifyReport, _Ran]:
    """Uncommit, keep the finished shards, redo the rest, then commit; returns the report read back at the destination
    and what this call ran.

    A full disk is one line (`DiskFull`), after every temporary file of the output is removed."""
    plan.out.begin()
    try:
        reporter.say(_plan_line(plan))
        kept = keep_finished_shards(plan.out, plan.inputs.store, plan.digest, plan.tasks)
        pending = [t for t in plan.tasks if t.name not in kept]
        if kept:
            reporter.say(f"resuming: {len(kept)} of {len(plan.tasks)} shards already done (records and files match "
                         "this run)")
        if plan.cut.recorded > len(kept):
            reporter.say(f"redoing the input of {plan.cut.recorded - len(kept)} finished shards that do not match this "
                         "run (another cut of the input, config or input bytes); their files are deleted")
        ran = _run_pending(plan, runner, pending, reporter, len(kept))
        made = {r.output.name: r.output for r in ran.runs}
        shards = {t.name: kept.get(t.name) or made[t.name] for t in plan.tasks}
        return _commit(plan, drop_failed_files(plan.out, plan.tasks, shards)), ran
    except DiskFull:
        plan.out.store.abort_partial_uploads()
        raise
    except OSError as exc:
        error = disk_full_error(exc, plan.out_dir)
        if error is None:
            raise
        plan.out.store.abort_partial_uploads()
        raise error from None


def _plan_line(plan: _Plan) -> str:
    """The start line: how many tasks of about what size the input is cut into, for how many workers."""
    workers = plan.opts.workers
    mean = sum(t.share for t in plan.tasks) / max(len(plan.tasks), 1)
    line = (f"tokenize: {len(plan.tasks)} tasks of about {_bytes(mean)} for {workers} "
            f"worker{'s' if workers != 1 else ''} (task size {_bytes(plan.cut.size)}")
    if plan.cut.kept_earlier:
        line += ": the size the finished shards of the run it resumes were cut with, to keep them"
    return line + ")"


def _bytes(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


class _Progress:
    """Turns the workers' deltas into the reporter's absolute progress over the input bytes still to tokenize."""

    def __init__(self, reporter: Reporter, total_bytes: int) -> None:
        self.reporter, self.total = reporter, total_bytes
        self.bytes = self.rows = self.tokens = 0
        reporter.progress(STAGE, 0, total_bytes, rows=0, tokens=0)

    def advance(self, nbytes: int, rows: int, tokens: int) -> None:
        self.bytes, self.rows, self.tokens = self.bytes + nbytes, self.rows + rows, self.tokens + tokens
        self.reporter.progress(STAGE, self.bytes, self.total, rows=self.rows, tokens=self.tokens)


def _run_pending(plan: _Plan, runner: ShardRunner, pending: list[ShardTask], reporter: Reporter, kept: int) -> _Ran:
    opts = plan.opts
    settings = WorkerSettings(
        tools_key=tools_key(plan.src.tokenizer_sha256, plan.src.template), thinking=opts.thinking,
        max_length=opts.max_length,
        held_out_fraction=opts.held_out_fraction, rows_per_file=opts.rows_per_shard, file_bytes=opts.file_bytes,
        max_row_bytes=opts.max_row_bytes, eot_id=plan.eot_id,
        vocab_size=plan.src.vocab_size, config_digest=plan.digest, input_url=plan.inputs.store.url, store=plan.store,
        output_dir=str(plan.out_dir), schema=output_schema(), task_size=plan.cut.size,
    )
    progress = _Progress(reporter, sum(t.share for t in pending))
    started = time.monotonic()
    runs = runner.run(pending, settings, progress.advance)
    return _Ran(kept, runs, time.monotonic() - started)


def _commit(plan: _Plan, shards: list[ShardOutput]) -> VerifyReport:
    """Split metadata, then the manifest (`StageOutput.commit` verifies every file at the destination first)."""
    plan.inputs.combine(plan.tasks, shards)
    metadata = write_split_metadata(plan.out_dir, [s.arrow_files() for s in shards], output_schema())
    entries = [entry for s in shards for entry in s.files] + metadata
    counts = merge_counts([s.stats for s in shards])
    seen = SeenIds(plan.src.vocab_size)
    for s in shards:
        seen.update(s.seen_ids())
    counts[SEEN_IDS] = seen.to_record()  # what train checks dflash.mask_token_id against
    counts["shards"] = len(plan.tasks)
    counts["input_files"] = len(plan.inputs.files)
    counts["held_out_fraction"] = plan.opts.held_out_fraction
    return plan.out.commit(entries, config=plan.run_config, lineage=plan.inputs.lineage(), counts=counts)
