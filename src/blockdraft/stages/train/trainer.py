"""One rank's training loop over its `TrainingSetup` (`setup`): steps, metrics, resume and verified checkpoints.

Ranks are data-parallel (DDP): each trains on its own slice of every global batch; see `blockdraft.stages.train.loss`
for why the loss is scaled so that DDP equals one process on the global batch. Only rank 0 writes the metrics log (and
feeds the trackers of train.report_to) and the checkpoints; every rank checks before each checkpoint that the replicas
are still bit-equal.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockdraft.config import BlockdraftConfig
from blockdraft.reporter import Reporter
from blockdraft.stages.train.batch import anchor_generator, build_block_batch
from blockdraft.stages.train.checkpoint import read_checkpoint
from blockdraft.stages.train.data import TrainRows
from blockdraft.stages.train.loss import Teacher
from blockdraft.stages.train.metrics import MetricsLog
from blockdraft.stages.train.placement import RankPlacement
from blockdraft.stages.train.prefetch import Prefetcher, SideStreams, StepInputs
from blockdraft.stages.train.replicas import check_ranks_in_sync, rng_state, set_rng_state
from blockdraft.stages.train.setup import TrainingSetup
from blockdraft.stages.train.step import MicroBatch, accumulate, step_metrics
from blockdraft.stages.train.trackers import Trackers
from blockdraft.store.artifact import VerifyReport


@dataclass
class PendingStep:
    """A launched optimizer step whose numbers are still on the drafter's device: the all-reduced totals, the loss's
    denominator and the gradient norm (tensors), the learning rate it used, and when it started (perf_counter)."""

    step: int
    started: float
    totals: torch.Tensor
    weight_sum: torch.Tensor
    grad_norm: torch.Tensor
    lr: float


class Trainer:
    """One rank of a training run: `train()` resumes (`resume`), then runs `step` and `maybe_checkpoint` to the end.

    `setup`: the run's drafter, target, objective, optimizer and checkpoints (`setup.build_training`); `rows`: the
    verified training rows; `reporter`: this rank's; `start_over`: `train --force`, for resuming.
    After `train()`: `steps_run`, `metrics` (the last `RECENT_METRICS` steps of this run: no rank holds the whole history;
    rank 0's `train.log_dir/metrics.jsonl` has it), `resumed_from` (a step or None), `last_checkpoint` (the newest
    checkpoint this run verified or resumed from; None on ranks other than 0 unless resumed).
    """

    RECENT_METRICS = 1000

    def __init__(self, config: BlockdraftConfig, place: RankPlacement, rows: TrainRows, setup: TrainingSetup, reporter: Reporter,
                 start_over: bool = False) -> None:
        tc = self.tc = config.train
        self.start_over = start_over  # `train --force`: start at step 0 when checkpoints are there but none verifies
        self.config, self.place, self.rows, self.setup, self.reporter = config, place, rows, setup, reporter
        self.log = MetricsLog(Path(tc.log_dir), tc.plot_every_minutes * 60, reporter.warn)
        self.trackers: Trackers | None = None  # open while `train` runs
        self.metrics: deque[dict[str, Any]] = deque(maxlen=self.RECENT_METRICS)
        self.steps_run = 0
        self.resumed_from: int | None = None
        self.last_checkpoint: VerifyReport | None = None
        self._streams = SideStreams(place.target_device, place.drafter_device)

    def train(self) -> list[dict[str, Any]]:
        """Resume, then step to `total_steps`, logging and checkpointing on the way; returns this run's latest metrics
        entries (`metrics`).

        The target makes its features `train.pipeline_depth` steps ahead in a background thread (`Prefetcher`), and a
        step's metrics are read after the next step is launched, so reading them never idles the drafter's device;
        before a checkpoint and at the end they are read at once."""
        start = self.resume()
        self.reporter.progress("train", start, self.setup.total_steps)
        pending: PendingStep | None = None
        with (
            self._open_trackers(start) as self.trackers,
            Prefetcher(self.inputs_of, start, self.setup.total_steps, self.tc.pipeline_depth) as feed,
        ):
            for step in range(start, self.setup.total_steps):
                launched = self.step(step, feed.get(step))
                if pending is not None:
                    self._record(pending, launched.started)
                pending = launched
                done = step + 1
                if done % self.tc.checkpoint_every == 0 or done == self.setup.total_steps:
                    self._record(pending, None)
                    pending = None
                    self.maybe_checkpoint(done)
        self.finish_checkpoints()
        return list(self.metrics)

    def _open_trackers(self, start: int) -> Trackers:
        """The trackers of train.report_to, logging from step `start + 1` on, in train.log_dir: on rank 0, when there are
        steps left (a rerun with none starts no W&B run)."""
        names = self.tc.report_to if self.place.is_main and start < self.setup.total_steps else []
        wandb: dict[str, str] = dict(self.tc.wandb.items())  # train.wandb, its keys as wandb.init takes them
        return Trackers(names, Path(self.tc.log_dir), start + 1, wandb, self.setup.checkpoints.resolved, self.reporter.warn)

    def _record(self, pending: PendingStep, next_started: float | None) -> None:
        """Read a launched step's metrics (waiting for its device), log them and report progress. Its time runs to the
        next step's launch, or to now when it is read at once."""
        entry = self._entry(pending, (next_started or time.perf_counter()) - pending.started)
        self.metrics.append(entry)
        self.steps_run += 1
        done = entry["step"]
        if self.place.is_main and (done % self.tc.log_every == 0 or done == self.setup.total_steps):
            self.log.append(entry)
            if self.trackers is not None:
                self.trackers.log(entry)
        self.reporter.progress("train", done, self.setup.total_steps, loss=round(entry["loss"], 4), tau=round(entry["tau_estimate"], 2))

    def resume(self) -> int:
        """Load the newest verified checkpoint of this run into the drafter, optimizer, scheduler and RNGs (every rank);
        returns the step to start from: the checkpoint's, or 0 (a fresh metrics log) when there is none."""
        found = self.setup.checkpoints.newest(self.start_over)
        if found is None:
            if self.place.is_main:
                self.log.start_fresh()
            return 0
        with read_checkpoint(found) as loaded:
            device = self.place.drafter_device
            self.setup.drafter.load_state_dict({name: tensor.to(device) for name, tensor in loaded.drafter_state.items()})
            self.setup.optimizer.load_state_dict(loaded.training_state["optimizer"])
            self.setup.scheduler.load_state_dict(loaded.training_state["scheduler"])
            set_rng_state(loaded.training_state["rng"], self.place.drafter_device)
            if self.place.is_main and (first := self.log.restart_from(loaded.folder, found.step)) is not None:
                self.reporter.warn(
                    f"{self.log.path} did not hold this run's metrics up to step {found.step}: it restarts with the checkpoint's "
                    f"entries from step {first} on (a checkpoint keeps only those logged since the one before)"
                )
        self.reporter.say(f"resuming from verified checkpoint {found.store.url} (step {found.step})")
        self.resumed_from, self.last_checkpoint = found.step, found.report
        return found.step

    def step(self, step: int, inputs: StepInputs[MicroBatch] | None = None) -> PendingStep:
        """Optimizer step `step` (0-based) on this rank's share of its global batch (`inputs`: made by `inputs_of`, or
        now); returns it launched, its metrics still on the device (`_record` reads them)."""
        started = time.perf_counter()
        inputs = inputs if inputs is not None else self.inputs_of(step)
        inputs.wait(self.place.drafter_device)
        totals, weight_sum, grad_norm = accumulate(
            self.setup.model, self.setup.drafter, self.setup.head, inputs.micro, self.tc.lm_head_chunk_blocks, self.tc.grad_clip, self.place.world_size,
            self.setup.objective,
        )
        lr = float(self.setup.scheduler.get_last_lr()[0])
        self.setup.optimizer.step()
        self.setup.scheduler.step()
        return PendingStep(step, started, totals, weight_sum, grad_norm, lr)

    def maybe_checkpoint(self, done: int) -> VerifyReport | None:
        """After `done` steps, at every train.checkpoint_every-th and the last: check the replicas are bit-equal, then
        (rank 0) take the checkpoint and push it in the background (`Checkpoints.save`; the final one is awaited). On
        other steps rank 0 only takes in a push that has ended. Returns the report of a checkpoint that verified during
        this call (the one before, or the final one), else None; raises when train.max_checkpoint_failures pushes in a
        row failed, or the final one did."""
        final = done == self.setup.total_steps
        if done % self.tc.checkpoint_every != 0 and not final:
            return self._counted(self.setup.checkpoints.poll()) if self.place.is_main else None
        if self.place.world_size > 1:
            check_ranks_in_sync(self.setup.drafter, self.place.world_size)
        if not self.place.is_main:
            return None
        if final:  # the curves of the whole run, in the final checkpoint; before, they are redrawn in the background
            self.log.plotter.now()
        state = self._training_state(done)
        return self._counted(self.setup.checkpoints.save(done, self.setup.drafter, state, self.log, final, self.place.world_size))

    def finish_checkpoints(self) -> VerifyReport | None:
        """Rank 0: wait for the checkpoint still being pushed, if any, and take it in (the end of `train`)."""
        return self._counted(self.setup.checkpoints.finish()) if self.place.is_main else None

    def _counted(self, report: VerifyReport | None) -> VerifyReport | None:
        self.last_checkpoint = report or self.last_checkpoint
        return report

    def inputs_of(self, step: int) -> StepInputs[MicroBatch]:
        """This rank's micro-batches of `step` on the drafter's device with their target features [b, S, K*H], in the
        target's dtype. Runs in the prefetching thread: the token ids go straight to the target's device, and the target's
        forward and the copies to the drafter's device run on side streams (CUDA) whose event the step waits on."""
        tc, place = self.tc, self.place
        epoch, in_epoch = divmod(step, self.setup.per_epoch)
        idx = self.setup.order.rows(epoch, in_epoch, place.rank)
        micro = []
        for first in range(0, len(idx), tc.batch_size):
            rows = idx[first : first + tc.batch_size]
            batch = build_block_batch(
                [self.rows.row(i) for i in rows],
                num_anchors=self.config.dflash.num_anchors,
                block_size=self.setup.spec.block_size,
                mask_token_id=self.setup.spec.mask_token_id,
                gamma=self.setup.gamma,
                generators=[anchor_generator(tc.seed, epoch, i) for i in rows],
                attention=self.setup.attention,
            )
            with self._streams.active():  # the target's forward and the copies, off the drafter's stream (CUDA)
                ids, mask = batch.input_ids.to(place.target_device), batch.attention_mask_context.long().to(place.target_device)
                final = None
                if self.setup.objective.distills:  # the whole target runs: its final hidden states give each slot's distribution
                    features, final = self.setup.target.features_and_final(ids, mask)
                else:
                    features = self.setup.target.features(ids, mask)
                moved = batch.to(place.drafter_device)
                teacher = None if final is None else Teacher.for_blocks(final.to(place.drafter_device), moved.block_positions)
                micro.append(MicroBatch(moved, features.to(place.drafter_device), batch.num_tokens, teacher))
        return StepInputs(micro, self._streams.record())

    def _entry(self, pending: PendingStep, seconds: float) -> dict[str, Any]:
        """The metrics of a launched step from its all-reduced totals (`step.step_metrics`), with its step, epoch,
        learning rate, gradient norm and time."""
        figures = step_metrics(pending.totals.cpu(), pending.weight_sum, self.setup.spec.block_size)
        return {
            "step": pending.step + 1,
            "epoch": pending.step // self.setup.per_epoch,
            "lr": pending.lr,
            "grad_norm": float(pending.grad_norm),
            **figures,
            "step_time_s": seconds,
            "tokens_per_s": figures["tokens"] / seconds,
        }

    def _training_state(self, done: int) -> dict[str, Any]:
        """What a resumed run needs besides the weights: optimizer, scheduler, RNGs, and where in the data it stood."""
        return {
            "optimizer": self.setup.optimizer.state_dict(),
            "scheduler": self.setup.scheduler.state_dict(),
            "rng": rng_state(self.place.drafter_device),
            "data": {"step": done, "epoch": done // self.setup.per_epoch, "step_in_epoch": done % self.setup.per_epoch},
            "world_size": self.place.world_size,
        }


__all__ = ["PendingStep", "Trainer"]
