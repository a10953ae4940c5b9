"""One rank's training loop, the progress lines it prints, and its stop at the first step that is not finite.

One rank's training loop over its `TrainingSetup` (`setup`): steps, metrics, resume and verified checkpoints.

Ranks are data-parallel (DDP): each trains on its own slice of every global batch; see `blockdraft.stages.train.loss`
for why the loss is scaled so that DDP equals one process on the global batch. Only rank 0 writes the metrics log (and
feeds the trackers of train.report_to) and the checkpoints; every rank checks before each checkpoint that the replicas
are still bit-equal.

Progress for a log without a terminal (Slurm, nohup): one plain line every train.log_every_s seconds with the step,
the loss, the held-out tau estimate, tokens/s and the time left; a terminal's bar shows the same
(`Reporter.status_line`).

The run stops at the first step whose numbers are not finite: a NaN or infinite loss or gradient norm (a learning
rate far too high, an overflow) would otherwise go on into NaN weights, checkpoints that verify and an export that
serves garbage. Every rank checks the same all-reduced numbers, so every rank stops at the same step, before that
step's checkpoint is taken; the weights are checked once more right before each checkpoint.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockdraft.config import DFlashConfig, EvalConfig, TargetConfig, TrainConfig
from blockdraft.data.agreement import (
    agreement_warning,
    describe_agreement,
    load_tokenizer,
    sample_indices,
    target_agreement,
    think_ids,
)
from blockdraft.errors import DivergedError, TrainingInterrupted
from blockdraft.model.finite import describe_nonfinite, nonfinite_weights
from blockdraft.reporter import Reporter
from blockdraft.stages.train.checkpoint import read_checkpoint, resume_note
from blockdraft.stages.train.data import BlockBatch, TrainRows, anchor_generator, build_block_batch
from blockdraft.stages.train.loss import Teacher
from blockdraft.stages.train.metrics import Figures, MetricsLog, Trackers, claim_log_dir
from blockdraft.stages.train.ranks import RankPlacement, check_ranks_in_sync, rng_state, set_rng_state
from blockdraft.stages.train.setup import TrainingSetup, describe_limit, resume_schedule
from blockdraft.stages.train.signal import (
    HeldOut,
    TrainingSignal,
    decode_checkpoint,
    prompts_before_supervision,
    target_stop_ids,
)
from blockdraft.stages.train.step import MicroBatch, Prefetcher, SideStreams, StepInputs, accumulate
from blockdraft.store.artifact import VerifyReport


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m10s` or `42s`."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressLines:
    """Says one status line (`Reporter.status_line`) at most every `every_s` seconds of `clock`, and the first after
    `every_s`; the time left is this run's pace so far times the steps left."""

    def __init__(self, reporter: Reporter, every_s: float, start: int, total: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter, self.every_s, self.start, self.total, self.clock = reporter, every_s, start, total, clock
        self._began = self._last = clock()

    def step(self, entry: dict[str, Any], held_out_tau: float | None) -> str | None:
        """After the step of `entry` (a metrics entry): the line said, or None when it is not yet time."""
        now = self.clock()
        if now - self._last < self.every_s:
            return None
        self._last = now
        done = int(entry["step"])
        pace = (now - self._began) / max(1, done - self.start)
        held = f"{held_out_tau:.2f}" if held_out_tau is not None else "-"
        line = (f"train step {done}/{self.total}  loss {entry['loss']:.4f}  held-out tau {held}  "
                f"{entry['tokens_per_s']:,.0f} tokens/s  {entry['supervised_tokens_per_s']:,.0f} supervised/s  "
                f"padding {entry['padding_share']:.0%}  ETA {format_duration(pace * (self.total - done))}")
        self.reporter.status_line(line)
        return line


_ADVICE = ("lower train.lr (or raise train.warmup_ratio) and train into a new train.output: a resumed run keeps its "
           "checkpoint's learning rate")


def check_finite_step(entry: Mapping[str, Any], last_checkpoint: int | None) -> None:
    """DivergedError when a step's metrics `entry` holds a loss or gradient norm that is not finite; `last_checkpoint`:
    the step of this run's newest verified checkpoint (None: none yet), which the line names."""
    loss, grad_norm = float(entry["loss"]), float(entry["grad_norm"])
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    newest = "no checkpoint of this run verified yet" if last_checkpoint is None else (
        f"the newest verified checkpoint is step {last_checkpoint}")
    raise DivergedError(
        f"training diverged at step {entry['step']}: loss {loss}, gradient norm {grad_norm} (learning rate "
        f"{entry['lr']:g}); the run stopped before checkpointing it ({newest}); {_ADVICE}"
    )


def check_finite_weights(drafter: nn.Module, step: int) -> None:
    """DivergedError when the drafter's weights after `step` hold a NaN or an infinity (checked before its
    checkpoint)."""
    if bad := nonfinite_weights(drafter):
        raise DivergedError(f"training diverged at step {step}: {describe_nonfinite(bad)}; the run stopped before "
                            f"checkpointing it; {_ADVICE}")


@dataclass
class PendingStep:
    """A launched optimizer step whose numbers are still on the drafter's device: the all-reduced named sums
    (`step.accumulate`), the loss's denominator and the gradient norm (tensors), the learning rate it used, and when it
    started (perf_counter)."""

    step: int
    started: float
    sums: dict[str, torch.Tensor]
    weight_sum: torch.Tensor
    grad_norm: torch.Tensor
    lr: float


class Trainer:
    """One rank of a training run: `train()` resumes (`resume`), then runs `step` and `maybe_checkpoint` to the end.

    The sections it reads: `tc` ([train]), `dflash` (num_anchors), `target` (the tokenizer folder: target agreement and
    stop ids), `eval_config` (how a checkpoint is decoded on the held-out prompts). `setup`: the run's drafter, target,
    objective, optimizer and checkpoints (`setup.build_training`); `rows`: the verified training rows; `reporter`: this
    rank's; `start_over`: `train --force`, for resuming.
    After `train()`: `steps_run`, `metrics` (the last `RECENT_METRICS` steps of this run: no rank holds the whole
    history; rank 0's `train.log_dir/metrics.jsonl` has it), `resumed_from` (a step or None), `last_checkpoint` (the
    newest checkpoint this run verified or resumed from; None on ranks other than 0 unless resumed).
    """

    RECENT_METRICS = 1000

    def __init__(self, tc: TrainConfig, dflash: DFlashConfig, target: TargetConfig, eval_config: EvalConfig,
                 place: RankPlacement, rows: TrainRows, setup: TrainingSetup, reporter: Reporter,
                 start_over: bool = False) -> None:
        self.tc, self.dflash, self.target_config, self.eval_config = tc, dflash, target, eval_config
        self.start_over = start_over  # `train --force`: start at step 0 when checkpoints are there but none verifies
        self.place, self.rows, self.setup, self.reporter = place, rows, setup, reporter
        self.log = MetricsLog(Path(tc.log_dir), tc.plot_every_minutes * 60, reporter.warn)
        self.trackers: Trackers | None = None  # open while `train` runs
        self.metrics: deque[dict[str, Any]] = deque(maxlen=self.RECENT_METRICS)
        self.steps_run = 0
        self.resumed_from: int | None = None
        self.last_checkpoint: VerifyReport | None = None
        self._streams = SideStreams(place.target_device, place.drafter_device)
        # The training signal (docs/TRAINING-SIGNAL.md), on rank 0: a fixed held-out sample measured every
        # train.eval_every steps and at each checkpoint, and held-out prompts each checkpoint is decoded on.
        main = place.is_main
        self.held_out = (
            HeldOut.sample(rows.held_out, tc.eval_rows, tc.seed, tc.max_length, tc.batch_size) if main else None
        )
        # a target served by an engine has no model here to decode with or to measure agreement on
        in_process = setup.target.model is not None
        self.decode_prompts = (prompts_before_supervision(rows.held_out, tc.decode_eval_prompts)
                               if main and in_process else [])
        self._measures_agreement = main and in_process and tc.target_agreement_rows > 0
        if main and not in_process and (tc.decode_eval_prompts or tc.target_agreement_rows):
            reporter.say("the target is served by vLLM (train.target_engine): no checkpoint decoded during training "
                         "and no target agreement measured here; run `blockdraft eval` on a checkpoint and "
                         "`blockdraft tokenize --check-target` where the target fits")
        self.signal = TrainingSignal(reporter.warn, len(rows), setup.per_epoch)
        self._held: dict[int, dict[str, Any]] = {}  # held-out figures measured after a step, logged with its entry
        self._lines: ProgressLines | None = None
        # The target's feature hooks are one set per model: the prefetching thread and the held-out measurement or a
        # checkpoint's decode (on the training thread) take turns with it.
        self._target_turn = threading.Lock()

    def train(self) -> list[dict[str, Any]]:
        """Resume, then step to `total_steps`, logging and checkpointing on the way; returns this run's latest metrics
        entries (`metrics`).

        The target makes its features `train.pipeline_depth` steps ahead in a background thread (`Prefetcher`), and a
        step's metrics are read after the next step is launched, so reading them never idles the drafter's device;
        before a checkpoint and at the end they are read at once."""
        start = self.resume()
        if start < self.setup.total_steps:  # what the steps left will be measured against
            self.reporter.say(describe_limit(self.tc, self.setup.per_epoch, len(self.rows)))
            if self._measures_agreement:
                self.signal.agreement = self._target_agreement()
            if self.place.is_main and self.held_out is None:
                self.reporter.say("train.data has no held-out rows: no held-out figures and no checkpoint decoded "
                                  "during training (tokenize with tokenize.held_out_fraction > 0, or set "
                                  "train.eval_data to a tokenized artifact of other conversations)")
        self.reporter.progress("train", start, self.setup.total_steps)
        self._lines = ProgressLines(self.reporter, self.tc.log_every_s, start, self.setup.total_steps)
        pending: PendingStep | None = None
        try:
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
                    at_checkpoint = done % self.tc.checkpoint_every == 0 or done == self.setup.total_steps
                    if self.held_out is not None and (at_checkpoint or done % self.tc.eval_every == 0):
                        with self._target_turn:
                            self._held[done] = self.held_out.measure(self.setup, self.place, self.dflash.num_anchors,
                                                                     self.tc.lm_head_chunk_blocks)
                    if at_checkpoint:
                        self._record(pending, None)
                        pending = None
                    self.maybe_checkpoint(done)  # between checkpoints: takes in a push that verified, and says so then
        except KeyboardInterrupt:
            raise TrainingInterrupted(self._interrupted(start)) from None
        self.finish_checkpoints()
        return list(self.metrics)

    def _target_agreement(self) -> dict[str, Any]:
        """Target agreement (`blockdraft.data.agreement`) on train.target_agreement_rows training rows drawn with
        train.seed, said in one line, and one warning when it is below train.min_target_agreement."""
        target = self.target_config
        picked = sample_indices(len(self.rows), self.tc.target_agreement_rows, self.tc.seed)
        think = think_ids(load_tokenizer(target.tokenizer or target.path))
        result = target_agreement(self.setup.target.model, (self.rows.row(i) for i in picked), think)
        self.reporter.say(describe_agreement(result))
        if (line := agreement_warning(result, self.tc.min_target_agreement)) is not None:
            self.reporter.warn(line)
        return result

    def _interrupted(self, start: int) -> str:
        """The line for Ctrl-C: where training stood and the last verified checkpoint, the one a rerun resumes from."""
        if self.place.is_main:
            self._counted(self.setup.checkpoints.poll())  # a push that ended just now still counts
        at = f"training interrupted after step {start + self.steps_run}"
        step = self.setup.checkpoints.last_step
        if self.last_checkpoint is None or step is None:
            return f"{at}; no checkpoint of this run verified yet: a rerun starts at step 0"
        return (f"{at}; the last verified checkpoint is {self.last_checkpoint.url} (step {step}): rerun the same "
                "command to resume from it")

    def _open_trackers(self, start: int) -> Trackers:
        """The trackers of train.report_to, logging from step `start + 1` on, in train.log_dir: on rank 0, when there
        are steps left (a rerun with none starts no W&B run)."""
        names = self.tc.report_to if self.place.is_main and start < self.setup.total_steps else []
        wandb: dict[str, str] = dict(self.tc.wandb.items())  # train.wandb, its keys as wandb.init takes them
        return Trackers(names, Path(self.tc.log_dir), start + 1, wandb, self.setup.checkpoints.resolved,
                        self.reporter.warn)

    def _record(self, pending: PendingStep, next_started: float | None) -> None:
        """Read a launched step's metrics (waiting for its device), log them and report progress. Its time runs to the
        next step's launch, or to now when it is read at once."""
        entry = self._entry(pending, (next_started or time.perf_counter()) - pending.started)
        check_finite_step(entry, self.setup.checkpoints.last_step)  # every rank: the numbers are all-reduced
        self.metrics.append(entry)
        self.steps_run += 1
        done = entry["step"]
        self.signal.trained(entry)
        held = self._held.pop(done, None)
        if held is not None:  # measured after this step: logged with it, whatever train.log_every says
            entry["eval"] = held
            self.signal.measured(held, done)
        if self.place.is_main and (held is not None or done % self.tc.log_every == 0 or done == self.setup.total_steps):
            self.log.append(entry)
            if self.trackers is not None:
                self.trackers.log(entry)
        held_tau = self.signal.held_out["tau_estimate"] if self.signal.held_out else None
        fields = {"loss": round(entry["loss"], 4), "tau": round(entry["tau_estimate"], 2)}
        if held_tau is not None:
            fields["held-out tau"] = round(held_tau, 2)
        self.reporter.progress("train", done, self.setup.total_steps, **fields)
        if self._lines is not None:
            self._lines.step(entry, held_tau)

    def resume(self) -> int:
        """Load the newest verified checkpoint of this run into the drafter, optimizer, scheduler and RNGs (every rank);
        returns the step to start from: the checkpoint's, or 0 (a fresh metrics log) when there is none."""
        found = self.setup.checkpoints.newest(self.start_over)
        if self.place.is_main:  # after the checkpoint's own refusal of another run, before the first entry is written
            output = self.tc.output or self.setup.checkpoints.store.url
            self.reporter.say("metrics log: "
                              f"{claim_log_dir(Path(self.tc.log_dir), self.setup.checkpoints.identity, output)}")
        if found is None:
            if self.place.is_main:
                self.log.start_fresh()
            return 0
        with read_checkpoint(found) as loaded:
            device = self.place.drafter_device
            self.setup.drafter.load_state_dict(
                {name: tensor.to(device) for name, tensor in loaded.drafter_state.items()}
            )
            self.setup.optimizer.load_state_dict(loaded.training_state["optimizer"])
            # this config's plan, before the recorded one replaces it
            planned = dict(vars(self.setup.scheduler.lr_lambdas[0]))
            self.setup.scheduler.load_state_dict(loaded.training_state["scheduler"])
            if (restarted := resume_schedule(self.setup.scheduler, planned, found.step, self.start_over)) is not None:
                self.reporter.warn(restarted)
            set_rng_state(loaded.training_state["rng"], self.place.drafter_device)
            if self.place.is_main and (first := self.log.restart_from(loaded.folder, found.step)) is not None:
                self.reporter.warn(
                    f"{self.log.path} did not hold this run's metrics up to step {found.step}: it restarts with the "
                    f"checkpoint's entries from step {first} on (a checkpoint keeps only those logged since the one "
                    "before)"
                )
        self.reporter.say(f"resuming from verified checkpoint {found.store.url} (step {found.step})")
        if found.report.manifest is not None and (
                note := resume_note(found.step, found.report.manifest.config, self.setup.checkpoints.resolved)):
            (self.reporter.warn if note[1] else self.reporter.say)(note[0])
        self.resumed_from, self.last_checkpoint = found.step, found.report
        return found.step

    def step(self, step: int, inputs: StepInputs[MicroBatch] | None = None) -> PendingStep:
        """Optimizer step `step` (0-based) on this rank's share of its global batch (`inputs`: made by `inputs_of`, or
        now); returns it launched, its metrics still on the device (`_record` reads them)."""
        started = time.perf_counter()
        inputs = inputs if inputs is not None else self.inputs_of(step)
        inputs.wait(self.place.drafter_device)
        sums, weight_sum, grad_norm = accumulate(
            self.setup.model, self.setup.drafter, self.setup.head, inputs.micro, self.tc.lm_head_chunk_blocks,
            self.tc.grad_clip, self.place.world_size, self.setup.objective,
        )
        lr = float(self.setup.scheduler.get_last_lr()[0])
        self.setup.optimizer.step()
        self.setup.scheduler.step()
        return PendingStep(step, started, sums, weight_sum, grad_norm, lr)

    def maybe_checkpoint(self, done: int) -> VerifyReport | None:
        """After `done` steps, at every train.checkpoint_every-th and the last: check the replicas are bit-equal, then
        (rank 0) take the checkpoint and push it in the background (`Checkpoints.save`; the final one is awaited). On
        other steps rank 0 only takes in a push that has ended. Returns the report of a checkpoint that verified during
        this call (the one before, or the final one), else None; raises when train.max_checkpoint_failures pushes in a
        row failed, or the final one did."""
        final = done == self.setup.total_steps
        if done % self.tc.checkpoint_every != 0 and not final:
            return self._counted(self.setup.checkpoints.poll()) if self.place.is_main else None
        check_finite_weights(self.setup.drafter, done)  # every rank: the replicas are equal
        if self.place.world_size > 1:
            check_ranks_in_sync(self.setup.drafter, self.place.world_size)
        if not self.place.is_main:
            return None
        if final:  # the curves of the whole run, in the final checkpoint; before, they are redrawn in the background
            self.log.plotter.now()
        if self.decode_prompts:
            self._decode(done)
        state = self._training_state(done)
        return self._counted(self.setup.checkpoints.save(done, self.setup.drafter, state, self.log, final,
                                                         self.place.world_size, self.signal.counts()))

    def _decode(self, done: int) -> None:
        """Rank 0: the checkpoint of step `done` decoded for real on the held-out prompts
        (`decoded.decode_checkpoint`)."""
        hf_model = self.setup.target.model
        stops = target_stop_ids(hf_model, self.target_config.tokenizer or self.target_config.path)
        with self._target_turn:
            decoded = decode_checkpoint(self.setup.drafter, hf_model, self.decode_prompts, self.eval_config, stops)
        self.reporter.say(
            f"checkpoint step {done} decoded on {decoded['prompts']} held-out prompts: tau {decoded['tau']:.2f}, "
            f"speedup {decoded['speedup']:.2f}x, lossless {'yes' if decoded['lossless'] else 'NO'} "
            f"({decoded['seconds']:.1f}s)"
        )
        self.signal.decoded_at(decoded, done)

    def finish_checkpoints(self) -> VerifyReport | None:
        """Rank 0: wait for the checkpoint still being pushed, if any, and take it in (the end of `train`)."""
        return self._counted(self.setup.checkpoints.finish()) if self.place.is_main else None

    def _counted(self, report: VerifyReport | None) -> VerifyReport | None:
        self.last_checkpoint = report or self.last_checkpoint
        return report

    def inputs_of(self, step: int) -> StepInputs[MicroBatch]:
        """This rank's micro-batches of `step` on the drafter's device with their target features [b, S, K*H], in the
        target's dtype. Runs in the prefetching thread: the token ids go straight to the target's device, and the
        target's forward and the copies to the drafter's device run on side streams (CUDA) whose event the step waits
        on."""
        place = self.place
        epoch, in_epoch = divmod(step, self.setup.per_epoch)
        idx = self.setup.order.rows(epoch, in_epoch, place.rank)
        micro = []
        for batch in self._batches(idx, epoch):
            with self._streams.active(), self._target_turn:
                # the target's forward and copies, off the drafter's stream (CUDA)
                if batch.packed is None:
                    ids, mask, positions = (
                        batch.input_ids.to(place.target_device),
                        batch.attention_mask_context.long().to(place.target_device),
                        None,
                    )
                else:  # the rows back to back, each seen alone (`TargetModel.packed`; the mask stays on the host)
                    packed = batch.packed
                    ids, mask = packed.input_ids.to(place.target_device), packed.real
                    positions = packed.positions.to(place.target_device)
                final = None
                if self.setup.objective.distills:
                    # the whole target runs: its final hidden states give each slot's distribution
                    features, final = self.setup.target.features_and_final(ids, mask, positions)
                else:
                    features = self.setup.target.features(ids, mask, positions)
                if batch.packed is not None:  # laid back out as the drafter's rows, on the target's device
                    features = batch.packed.unpack(features)
                    final = None if final is None else batch.packed.unpack(final)
                moved = batch.to(place.drafter_device)
                teacher = None if final is None else Teacher.for_blocks(final.to(place.drafter_device),
                                                                        moved.block_positions)
                # what the target computed: packed rows run one by one compute no padding at all
                computed = batch.num_positions
                if batch.packed is not None and not self.setup.target.packs_in_one_forward:
                    computed = batch.num_tokens
                micro.append(MicroBatch(moved, features.to(place.drafter_device), batch.num_tokens, teacher,
                                        computed))
        return StepInputs(micro, self._streams.record())

    def _batches(self, idx: list[int], epoch: int) -> Iterator[BlockBatch]:
        """The micro-batches of rows `idx` (this rank's share of a step), `train.batch_size` rows each, a row's anchors
        drawn by its own generator; with `train.packing` the target reads each micro-batch's rows packed into
        sequences of at most `train.max_length` tokens."""
        tc = self.tc
        for first in range(0, len(idx), tc.batch_size):
            rows = idx[first : first + tc.batch_size]
            yield build_block_batch(
                [self.rows.row(i) for i in rows],
                num_anchors=self.dflash.num_anchors,
                block_size=self.setup.spec.block_size,
                mask_token_id=self.setup.spec.mask_token_id,
                gamma=self.setup.gamma,
                generators=[anchor_generator(tc.seed, epoch, i) for i in rows],
                attention=self.setup.attention,
                pack_to=tc.max_length if tc.packing else None,
            )

    def _entry(self, pending: PendingStep, seconds: float) -> dict[str, Any]:
        """The metrics of a launched step: its `Figures` from the all-reduced sums, with its step, epoch, learning rate,
        gradient norm and time."""
        sums = {name: value.cpu() for name, value in pending.sums.items()}
        figures = Figures.of_sums(sums, pending.weight_sum).entry()
        return {
            "step": pending.step + 1,
            "epoch": pending.step // self.setup.per_epoch,
            "lr": pending.lr,
            "grad_norm": float(pending.grad_norm),
            **figures,
            "step_time_s": seconds,
            "tokens_per_s": figures["tokens"] / seconds,
            "supervised_tokens_per_s": figures["supervised"] / seconds,
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


__all__ = ["PendingStep", "ProgressLines", "Trainer", "check_finite_step", "check_finite_weights", "format_duration"]
