"""Training checkpoints: what one holds, how it is written in the background and published, and how a run resumes from
it.

Checkpoints are artifacts: written locally, published through `StageOutput`, verified at the destination. Layout under
the run's output store: `step-00000500/` per checkpoint, each its own artifact holding the drafter in the export format
(`config.json`, `model.safetensors`), `training-state.pt` (optimizer, scheduler, RNG states, data position), the
resolved config (`blockdraft-config.json`), the metrics logged since the checkpoint before (its window of
`metrics.jsonl`: checkpoints do not grow with the run) and the latest training curves. Resume reads only checkpoints
that verify; one whose push never completed (no manifest) or whose files differ is skipped
(`model.formats.search_checkpoints`), and when every committed one differs the run stops rather than overwrite them from
step 0, unless `train --force`. The newest that verifies is resumed from only when its `StageOutput` (keyed by the run
identity and the data) says `done`. Pruning (`prune_checkpoints`) keeps the newest verified ones and every Nth for good.

Written in the background: `Checkpoints` copies the state to the host at its step, then one worker thread writes,
pushes and verifies it while training goes on. A `Snapshot` is everything one checkpoint holds, taken on the training
thread: the drafter and the optimizer state copied to the CPU (training changes the originals in place), the RNG states,
and the metrics window and curves as files. The `BackgroundWriter` runs one job at a time on its own thread; whoever
owns it (`Checkpoints`) takes the job's outcome on its own thread, so nothing of a checkpoint counts before its push
verified.

What a resumed run takes from its checkpoint and what from this config (`resume_note`, said when a setting changed in
between): a checkpoint holds the weights, the optimizer's state, the schedule's position, the RNG states and where in
the data the run stood. The optimizer's state includes its parameter groups, so the learning rate and weight decay the
first run was started with go on (`CHECKPOINT_SETTINGS`); every other setting comes from this config (more steps,
another checkpoint interval, another warmup). The run identity's settings (seed, data, DFlash shape, ...) cannot
differ: the checkpoint of another identity is refused before this is asked.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import torch
from safetensors.torch import load_file

from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig, TrainConfig
from blockdraft.errors import ArtifactError, ConfigError, StoreError, redact_settings
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.model.formats import (
    CHECKPOINT_KIND,
    PINNED_CONFIG_NAME,
    STATE_NAME,
    WEIGHTS_NAME,
    Resumable,
    checkpoint_key,
    checkpoint_steps,
    search_checkpoints,
)
from blockdraft.reporter import Reporter
from blockdraft.stages.train.metrics import METRICS_NAME, MetricsLog
from blockdraft.stages.train.ranks import config_leaves
from blockdraft.store import Store
from blockdraft.store.artifact import InputRef, State, VerifyReport, uncommit, verify_artifact
from blockdraft.store.manifest import measured
from blockdraft.store.output import StageOutput, stage_key

T = TypeVar("T")


def host_copy(value: Any) -> Any:
    """`value` (a state dict: nested dicts, lists, tuples of tensors and plain values) with every tensor copied to the
    CPU, so that later in-place updates of the originals (an optimizer step) do not reach it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return value


def drafter_on_host(drafter: DFlashDrafter) -> DFlashDrafter:
    """A CPU copy of `drafter` (same spec, its parameters copied), built without a second initialisation."""
    with torch.device("meta"):
        copy = DFlashDrafter(drafter.spec)
    copy.load_state_dict(host_copy(drafter.state_dict()), assign=True)
    return copy


@dataclass
class Snapshot:
    """One checkpoint as taken at `step`: what the background writer saves, and what counts once it verified.

    `folder` (removed by `discard`) holds `files`: the metrics logged since the last checkpoint that counted and the
    curves as last drawn; `window_end` is where that window ends in the log (`MetricsLog.window_saved` once the push
    verified).
    """

    step: int
    drafter: DFlashDrafter
    training_state: dict[str, Any]
    counts: dict[str, Any]
    folder: Path
    files: list[Path]
    window_end: int
    final: bool

    @classmethod
    def take(
        cls, step: int, drafter: DFlashDrafter, training_state: dict[str, Any], log: MetricsLog, counts: dict[str, Any],
        final: bool
    ) -> Snapshot:
        folder = Path(tempfile.mkdtemp(prefix="blockdraft-ckpt-state-"))
        try:
            window, end = log.write_window(folder)
            files = [window]
            if log.plot_path.is_file():  # the plotter replaces the file whole, so this copy is one drawing
                files.append(Path(shutil.copyfile(log.plot_path, folder / log.plot_path.name)))
            return cls(step, drafter_on_host(drafter), host_copy(training_state), host_copy(counts), folder, files, end,
                       final)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class BackgroundWriter(Generic[T]):
    """One job at a time on a daemon thread: `start` it, `finished` says whether it ended, `result` waits for it and
    returns its value or raises its exception, on the caller's thread. A job left running when the process exits is
    dropped (a checkpoint without its manifest: never resumed from)."""

    def __init__(self, name: str = "blockdraft-checkpoint") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._outcome: tuple[T | None, BaseException | None] = (None, None)

    def start(self, job: Callable[[], T]) -> None:
        assert self._thread is None, "the previous job's result must be taken first"

        def run() -> None:
            try:
                self._outcome = (job(), None)
            except BaseException as exc:  # handed to the owner's thread by `result`
                self._outcome = (None, exc)

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def finished(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def result(self) -> T | None:
        """Wait for the job, then its value (None when there was no job); its exception is raised here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        (value, error), self._outcome = self._outcome, (None, None)
        if error is not None:
            raise error
        return value


# Settings the optimizer's restored parameter groups (and the schedule's base learning rate) carry from the checkpoint.
CHECKPOINT_SETTINGS = ("train.lr", "train.weight_decay")
LOCATIONS = ("train.data", "train.output")  # where the run reads and writes: may move, the checkpoint pins by content
SHOWN = 6  # changed settings named in the line; more are counted


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (checkpoint's value, this config's)} for each resolved setting that differs, locations left out;
    of `recorded`, only the sections `current` has (a manifest's config also holds its stage key)."""
    old = dict(config_leaves({name: section for name, section in recorded.items() if name in current}))
    new = dict(config_leaves(current))
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key not in LOCATIONS and old.get(key) != new.get(key)}


def resume_note(step: int, recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, bool] | None:
    """The line for a run resumed at `step` whose config differs from the one its checkpoint recorded (`recorded`,
    `current`: resolved configs), saying which changed settings are used and which are not, and whether it is a warning
    (a changed setting is not used); None when none differs."""
    changed = changed_settings(recorded, current)
    if not changed:
        return None
    ignored = {k: v for k, v in changed.items() if k in CHECKPOINT_SETTINGS}
    used = {k: v for k, v in changed.items() if k not in CHECKPOINT_SETTINGS}
    parts = [f"resuming at step {step} with settings that changed since its checkpoint"]
    if ignored:
        listed = ", ".join(f"{k} = {new} (the checkpoint's: {old})" for k, (old, new) in ignored.items())
        parts.append(f"NOT used: {listed}, since the optimizer resumes with the checkpoint's state and learning rate "
                     "(train into a new train.output to use them)")
    if used:
        listed = ", ".join(f"{k} = {new} (was {old})" for k, (old, new) in list(used.items())[:SHOWN])
        more = f" and {len(used) - SHOWN} more" if len(used) > SHOWN else ""
        parts.append(f"used from this config: {listed}{more}")
    line = "; ".join(parts) + ("; the weights, optimizer, schedule position, RNG and data position come from the "
                               "checkpoint, everything else from the config")
    return line, bool(ignored)


PINNED_DATA_FIELDS = ("template_sha256", "thinking", "tokenizer_sha256", "end_of_turn_id")


def pinned_dflash(dflash: DFlashConfig, spec: DrafterSpec) -> DFlashConfig:
    """`dflash` with every value the run derives from the target and train.init_from set to the drafter's (mask id,
    layer ids, gamma, shapes): what checkpoints record and the run identity holds."""
    return dflash.model_copy(update={
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
        "gamma": spec.gamma,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
    })


def checkpoint_config(
    recorded: dict[str, Any], dflash: DFlashConfig, target: TargetConfig, tokenize_run: dict[str, Any] | None
) -> dict[str, Any]:
    """The config every checkpoint records: `recorded` (the whole config, `BlockdraftConfig.resolved`, train.output set
    to where the run writes) with the two sections the run resolves further in place of its own: `dflash` pinned to the
    drafter (`pinned_dflash`) and `target` with the dtype it resolved to.

    `tokenize_run` (what the tokenized data's manifest records: chat-template hash, thinking mode, tokenizer hash) is
    pinned under "data", so eval and export read the template a drafter was trained for from the checkpoint itself.
    """
    data = {key: (tokenize_run or {}).get(key) for key in PINNED_DATA_FIELDS}
    return {**recorded, "target": target.resolved(), "dflash": dflash.resolved(), "data": data}


def resolved_training_config(
    config: BlockdraftConfig, spec: DrafterSpec, output_url: str, tokenize_run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`checkpoint_config` of a whole config, for a checkpoint written by hand: train.output set to `output_url`, dflash
    pinned to `spec`, the target as configured."""
    recorded = config.model_copy(update={"train": config.train.model_copy(update={"output": output_url})}).resolved()
    return checkpoint_config(recorded, pinned_dflash(config.dflash, spec), config.target, tokenize_run)


# The checkpoint format, recorded first in every checkpoint's run identity: resume reads this format only.
CHECKPOINT_FORMAT = "blockdraft-checkpoint/3"  # 3: the scheduler state records its plan (schedule.WarmupCosine)


@dataclass(frozen=True)
class RunIdentity:
    """What a resumed run must share with the checkpoint for its next steps to be the ones the first run would take:
    the target, the DFlash settings pinned to the drafter (`pinned_dflash`), the data, and the train settings that set
    the path of the weights. Every checkpoint records it (`record`) and is keyed on it."""

    target: str | None
    dflash: DFlashConfig
    data_sha256: str | None
    seed: int
    global_batch: int  # rows per optimizer step, however many ranks share them
    max_length: int
    init_from: str | None  # a run started from another drafter is another run
    init: str  # other initial weights (train.init), like another seed
    distill_weight: float  # another objective
    distill_temperature: float

    @classmethod
    def of(
        cls, train: TrainConfig, dflash: DFlashConfig, target_path: str | None, data_sha256: str | None
    ) -> RunIdentity:
        """The identity of a run of `train` with the pinned `dflash`, of the target at `target_path`, on the data
        `data_sha256`."""
        return cls(target_path, dflash, data_sha256, train.seed, train.global_batch_size, train.max_length,
                   train.init_from, train.init, train.distill_weight, train.distill_temperature)

    def record(self) -> dict[str, Any]:
        """As a checkpoint records it (`counts["run"]`), format first, each setting pinned as the resolved config pins
        it."""
        return {"format": CHECKPOINT_FORMAT, **redact_settings({
            "target": self.target,
            "dflash": self.dflash.model_dump(mode="json"),
            "data_sha256": self.data_sha256,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "max_length": self.max_length,
            "init_from": self.init_from,
            "init": self.init,
            "distill": {"weight": self.distill_weight, "temperature": self.distill_temperature},
        })}


def refuse_other_format(url: str, recorded: dict[str, Any]) -> None:
    """ConfigError when the checkpoint at `url` (its recorded run identity) is not of `CHECKPOINT_FORMAT`."""
    found = recorded.get("format")
    if found != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"{url} is a checkpoint of format {found or 'unversioned'}, this blockdraft resumes only "
            f"{CHECKPOINT_FORMAT}; set train.output to a new location (or delete it) to train again from step 0"
        )


def checkpoint_output(
    store: Store, step: int, identity: dict[str, Any] | None, lineage: list[InputRef], force: bool = False
) -> StageOutput:
    """The checkpoint of `step` under `store` as a stage output: its key is the run identity and its data by content
    (`stage_key`), not by where the data lies, so a run resumes from its checkpoints after its data was pulled to
    another folder or node; `force` goes to its lease."""
    by_content = [ref.model_copy(update={"url": ""}) for ref in lineage]
    return StageOutput(store.child(checkpoint_key(step)), CHECKPOINT_KIND, stage_key(identity, by_content), force=force)


def save_checkpoint(
    store: Store,
    step: int,
    drafter: DFlashDrafter,
    training_state: dict[str, Any],
    resolved_config: dict[str, Any],
    lineage: Iterable[InputRef],
    counts: dict[str, Any],
    extra_files: Iterable[Path] = (),
    *,
    force: bool = False,
    measured_on: Iterable[InputRef] = (),
) -> VerifyReport:
    """Write, push and commit the checkpoint of `step` under `store`; returns the destination's verify report.

    The checkpoint's stage key is `stage_key(counts["run"], lineage)`: the run identity and its data. Its manifest's
    lineage lists `lineage` (the training data, first) and then `measured_on` (train.eval_data, whose rows its held-out
    figures were measured on), pinned as measured inputs: `status` says the checkpoint is stale when either changed, but
    an export or eval of it only when its training data did. The held-out data is left out of the key: it changes no
    weight, so a run resumes from its checkpoints with another train.eval_data.
    Raises ArtifactError (or the store's error) when the push does not verify: such a checkpoint has no manifest
    and resume never uses it. `force` (`train --force`) goes to the checkpoint's lease: a dead writer's is taken over.
    """
    lineage = list(lineage)
    out = checkpoint_output(store, step, counts.get("run"), lineage, force)
    out.begin()  # a resumed run rewrites checkpoints after its resume point
    try:
        with tempfile.TemporaryDirectory(prefix="blockdraft-ckpt-") as tmp:
            root = Path(tmp)
            paths = list(drafter.save_pretrained(root))
            torch.save(training_state, root / STATE_NAME)
            (root / PINNED_CONFIG_NAME).write_text(json.dumps(resolved_config, indent=2, sort_keys=True) + "\n")
            paths += [root / STATE_NAME, root / PINNED_CONFIG_NAME]
            for extra in extra_files:
                if extra.is_file():
                    shutil.copyfile(extra, root / extra.name)
                    paths.append(root / extra.name)
            inputs = [*lineage, *(measured(ref) for ref in measured_on)]
            return out.publish(root, paths, config=resolved_config, lineage=inputs, counts=counts)
    finally:
        out.release()  # a failed push gives its lease back too (a committed one already did)


def prune_checkpoints(store: Store, keep: int, keep_every: int | None = None, verified: int | None = None) -> list[int]:
    """Delete the checkpoints older than the newest `keep` that verify, except those whose step is a multiple of
    `keep_every` (kept for good); returns the deleted steps. `verified`: a step just verified (not read again).

    Runs only after a new checkpoint verified, so the newest kept one is always resumable: a newer checkpoint that does
    not verify is neither counted nor deleted. Older checkpoints are uncommitted before their files go, so a reader
    never sees a manifest over missing files.
    """
    steps = checkpoint_steps(store)
    kept = 0
    for index, step in enumerate(steps):  # newest first; older than the keep-th verified one goes
        kept += step == verified or verify_artifact(store.child(checkpoint_key(step))).state is State.VERIFIED
        if kept == keep:
            doomed = [s for s in steps[index + 1 :] if not (keep_every and s % keep_every == 0)]
            break
    else:
        return []
    for step in doomed:
        child = store.child(checkpoint_key(step))
        uncommit(child)
        for info in list(child.list()):
            child.delete(info.key)
    return doomed


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back into memory; `folder` holds its files (and metrics log, if it has one) while open."""

    folder: Path
    drafter_state: dict[str, torch.Tensor]
    training_state: dict[str, Any]


@contextmanager
def read_checkpoint(found: Resumable) -> Iterator[LoadedCheckpoint]:
    """A verified checkpoint's weights and training state; a remote one's files are fetched with their checksums
    compared."""
    source = found.artifact
    listed = {entry.path for entry in source.manifest.files}
    names = [name for name in (WEIGHTS_NAME, STATE_NAME, METRICS_NAME) if name in listed]
    with source.fetched(names) as folder:
        yield LoadedCheckpoint(folder, load_file(str(folder / WEIGHTS_NAME)),
                               torch.load(folder / STATE_NAME, weights_only=True))


@dataclass
class Written:
    """What the writer's thread did for one checkpoint: its verify report, the steps pruned, and why pruning failed."""

    report: VerifyReport
    pruned: list[int]
    prune_failed: str | None


class Checkpoints:
    """One run's checkpoints under `store`: each published under the run's stage key (its identity and its data),
    pruned to the newest `keep` plus every step that is a multiple of `keep_every`, and resumed from only when written
    by the same run.

    `save` takes a checkpoint's state at its step and hands it to one background thread that writes, pushes and verifies
    it while training goes on; one is in flight at most (the next `save` waits for it). A checkpoint counts (its metrics
    window saved, older ones pruned, its report returned) only once its push verified, taken in on the training thread
    by the next `save`, `poll` or `finish`. A failed push is a warning, `max_failures` in a row stop the run.
    `data` is the training data; `eval_data` the held-out data of train.eval_data (None: unset), recorded as a second
    input of each checkpoint (`save_checkpoint`'s `measured_on`).
    """

    def __init__(
        self, store: Store, resolved: dict[str, Any], identity: dict[str, Any], data: InputRef, keep: int | None,
        keep_every: int | None, reporter: Reporter, max_failures: int = 3, force: bool = False,
        eval_data: InputRef | None = None,
    ) -> None:
        self.store = store
        self.resolved = resolved
        self.identity = identity
        self.data = data
        self.eval_data = eval_data
        self.keep = keep
        self.keep_every = keep_every
        self.reporter = reporter
        self.max_failures = max_failures
        self.force = force  # `train --force`, for each checkpoint's lease
        self.failures = 0  # pushes failed in a row
        self.last_step: int | None = None  # the newest checkpoint of this run known to verify (resumed from or pushed)
        self._writer: BackgroundWriter[Written] = BackgroundWriter()
        self._in_flight: tuple[Snapshot, MetricsLog] | None = None

    def newest(self, start_over: bool = False) -> Resumable | None:
        """The newest checkpoint that verifies, or None when there is none; raises ConfigError when it is of another
        checkpoint format or belongs to another run. When checkpoints are there but none verifies, a start at step 0
        would overwrite them: ArtifactError naming them, unless `start_over` (`train --force`), which warns and returns
        None."""
        found, skipped = search_checkpoints(self.store)
        if found is None and skipped:
            unverified = f"no checkpoint under {self.store.url} verifies ({'; '.join(skipped)})"
            if not start_over:
                raise ArtifactError(
                    f"{unverified}; training would restart at step 0 and overwrite it: restore it (`blockdraft verify` "
                    "names the bad files), set train.output to a new location, or rerun with --force to start over"
                )
            self.reporter.warn(f"{unverified}; --force: training starts over at step 0 and overwrites it")
            return None
        for line in skipped:
            self.reporter.warn(f"not resuming from {line}")
        if found is None:
            return None
        if checkpoint_output(self.store, found.step, self.identity, [self.data]).done(found.report) is None:
            self._refuse_other_run(found)
        self.last_step = found.step
        return found

    def _refuse_other_run(self, found: Resumable) -> NoReturn:
        """ConfigError for a verified checkpoint that its `StageOutput` says is not this run's: the run identity it
        recorded (`counts["run"]`) names the format or the settings that differ; with none differing, its data does."""
        assert found.report.manifest is not None  # it verified
        recorded = found.report.manifest.counts.get("run") or {}
        refuse_other_format(found.store.url, recorded)
        differs = sorted(k for k in set(recorded) | set(self.identity) if recorded.get(k) != self.identity.get(k))
        raise ConfigError(
            f"{found.store.url} is a checkpoint of another run (differs in {', '.join(differs) or 'train.data'}); "
            "set train.output to a new location, or rerun with the original config"
        )

    def has_checkpoint(self, step: int) -> bool:
        """Whether the checkpoint of `step` of this run is already at the destination, verified (`StageOutput.done`)."""
        return checkpoint_output(self.store, step, self.identity, [self.data]).done() is not None

    def save(
        self, step: int, drafter: DFlashDrafter, state: dict[str, Any], log: MetricsLog, final: bool,
        ranks_in_sync: int, signal: dict[str, Any] | None = None,
    ) -> VerifyReport | None:
        """Take the checkpoint of `step` now (weights and `state` copied to the host, the metrics logged since the last
        checkpoint that counted, the curves as last drawn) and push it in the background, once the one in flight is
        taken in; the final one is awaited. `ranks_in_sync`: how many replicas were checked bit-equal just before (1
        without DDP); `signal`: the run's held-out, decoded and agreement figures (`TrainingSignal.counts`), recorded in
        its counts.

        Returns the report of a checkpoint that verified during this call (the one before, or the final one), else None.
        Raises ArtifactError when the final checkpoint does not verify, or when `max_failures` pushes in a row
        failed."""
        report = self.finish()
        counts = {"step": step, "run": self.identity, "ranks_in_sync": ranks_in_sync, "last": log.last,
                  **(signal or {})}
        snapshot = Snapshot.take(step, drafter, state, log, counts, final)
        self._in_flight = (snapshot, log)
        self._writer.start(partial(self._write, snapshot))
        return (self.finish() if final else None) or report

    def poll(self) -> VerifyReport | None:
        """`finish` when the push in flight has ended, else None at once: a failure is reported as soon as it is
        known."""
        return self.finish() if self._writer.finished() else None

    def finish(self) -> VerifyReport | None:
        """Wait for the checkpoint in flight and take it in: its report when it verified, None when there was none or
        its (intermediate) push failed, which is warned about and counted."""
        if self._in_flight is None:
            return None
        (snapshot, log), self._in_flight = self._in_flight, None
        try:
            written = self._writer.result()
        except (ArtifactError, StoreError, OSError) as exc:
            self._failed(snapshot, exc)
            return None
        finally:
            snapshot.discard()
        assert written is not None
        self.failures, self.last_step = 0, snapshot.step
        log.window_saved(snapshot.window_end)
        self.reporter.say(f"checkpoint step {snapshot.step}: {written.report.summary()} at {written.report.url}")
        if written.pruned:
            self.reporter.say(f"removed older checkpoints of steps {written.pruned} (train.keep_checkpoints = "
                              f"{self.keep})")
        if written.prune_failed:
            self.reporter.warn(f"older checkpoints were not removed ({written.prune_failed}); the next checkpoint "
                               "tries again")
        return written.report

    def _write(self, snapshot: Snapshot) -> Written:
        """On the writer's thread: write, push and verify the snapshot, then prune the older checkpoints."""
        report = save_checkpoint(
            self.store, snapshot.step, snapshot.drafter, snapshot.training_state, self.resolved, [self.data],
            snapshot.counts,
            snapshot.files, force=self.force, measured_on=[self.eval_data] if self.eval_data is not None else [],
        )
        pruned, prune_failed = [], None
        if self.keep is not None:
            try:
                pruned = prune_checkpoints(self.store, self.keep, self.keep_every, verified=snapshot.step)
            except (ArtifactError, StoreError, OSError) as exc:  # the checkpoint itself verified: it counts
                prune_failed = str(exc)
        return Written(report, pruned, prune_failed)

    def _failed(self, snapshot: Snapshot, exc: BaseException) -> None:
        """A push that did not verify: the final one raises; an intermediate one is warned about and counted, and
        `max_failures` in a row stop the run. Its metrics window moves to the next checkpoint."""
        step = snapshot.step
        if snapshot.final:
            raise ArtifactError(f"final checkpoint of step {step} did not verify at {self.store.url}: {exc}") from exc
        self.failures += 1
        resume = f"the verified checkpoint of step {self.last_step}" if self.last_step is not None else "the start"
        if self.failures >= self.max_failures:
            raise ArtifactError(
                f"{self.failures} checkpoints in a row did not verify at {self.store.url} (the last, step {step}: "
                f"{exc}); training stopped: fix the store, then rerun to resume from {resume} "
                f"(train.max_checkpoint_failures = {self.max_failures})"
            ) from exc
        self.reporter.warn(
            f"checkpoint of step {step} did not verify at {self.store.url} ({exc}); training goes on, it will not be "
            f"resumed from ({self.failures} failed in a row, the run stops at train.max_checkpoint_failures = "
            f"{self.max_failures})"
        )


__all__ = [
    "BackgroundWriter", "CHECKPOINT_FORMAT", "CHECKPOINT_SETTINGS", "Checkpoints", "LoadedCheckpoint",
    "PINNED_DATA_FIELDS", "RunIdentity", "Snapshot", "Written", "changed_settings", "checkpoint_config",
    "drafter_on_host", "host_copy", "pinned_dflash", "prune_checkpoints", "read_checkpoint", "refuse_other_format",
    "resolved_training_config", "resume_note", "save_checkpoint",
]
