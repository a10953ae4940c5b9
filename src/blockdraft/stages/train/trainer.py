"""One rank's training: the frozen target on its device, a drafter replica on the drafter device, verified checkpoints.

Ranks are data-parallel (DDP): each trains on its own slice of every global batch; see `blockdraft.stages.train.loss`
for why the loss is scaled so that DDP equals one process on the global batch. Only rank 0 writes the metrics log
and the checkpoints; every rank checks before each checkpoint that the replicas are still bit-equal.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockdraft.config import BlockdraftConfig
from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead, TargetModel, load_target
from blockdraft.reporter import Reporter
from blockdraft.stages.train.batch import BlockBatch, anchor_generator, build_block_batch, expected_acceptance
from blockdraft.stages.train.checkpoint import Checkpoints, read_checkpoint, resolved_training_config, run_identity
from blockdraft.stages.train.data import RowOrder, TrainRows, steps_per_epoch
from blockdraft.stages.train.init import check_init_spec, load_init_drafter
from blockdraft.stages.train.loss import LossOutput, block_loss
from blockdraft.stages.train.metrics import MetricsLog
from blockdraft.stages.train.placement import RankPlacement
from blockdraft.stages.train.replicas import check_ranks_in_sync, rng_state, set_rng_state
from blockdraft.store import Store
from blockdraft.store.artifact import VerifyReport


class DraftForward(nn.Module):
    """The drafter's whole differentiable path in one forward, so DDP sees every parameter use."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, features, block_hidden, block_positions, context_positions, attention_mask):
        context = self.drafter.project_context(features)
        return self.drafter(block_hidden, context, block_positions, context_positions, attention_mask)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def forward_backward(
    model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: BlockBatch,
    features: torch.Tensor,
    chunk_blocks: int,
    grad_clip: float,
) -> tuple[LossOutput, torch.Tensor]:
    """One step's gradients: drafter forward (bf16 autocast on GPU), chunked loss, backward, clipping.

    model is the drafter's `DraftForward` (DDP-wrapped under torchrun); features [b, S, K*H] on the drafter's device.
    Returns the loss and the total gradient norm before clipping; the caller steps the optimizer.
    """
    device = features.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    block_hidden = head.embed(batch.block_ids).float()
    with autocast:
        hidden = model(features.float(), block_hidden, batch.block_positions, batch.context_positions, batch.attention_mask)
        out = block_loss(
            hidden, batch.labels, batch.weights, head.lm_head_weight, head.lm_head_bias, drafter.spec.block_size, chunk_blocks
        )
    for p in drafter.parameters():
        p.grad = None
    out.loss.backward()
    return out, torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)


class Trainer:
    """One rank of a training run: `train()` resumes (`resume`), then runs `step` and `maybe_checkpoint` to the end.

    `out_store`/`output_url`: where checkpoints go; `rows`: the verified training rows; `reporter`: this rank's.
    After `train()`: `steps_run`, `metrics` (the last `RECENT_METRICS` steps of this run: no rank holds the whole history;
    rank 0's `train.log_dir/metrics.jsonl` has it), `resumed_from` (a step or None), `last_checkpoint` (the newest
    checkpoint this run verified or resumed from; None on ranks other than 0 unless resumed).
    """

    RECENT_METRICS = 1000

    def __init__(
        self, config: BlockdraftConfig, place: RankPlacement, rows: TrainRows, out_store: Store, output_url: str, reporter: Reporter
    ) -> None:
        tc = self.tc = config.train
        self.config, self.place, self.rows, self.reporter = config, place, rows, reporter
        assert config.target.path is not None  # the stage checked it (load_target_config) before any data moved
        hf_target = load_target(config.target.path, place.target_device, config.target.dtype, reporter=reporter)
        self.spec = DrafterSpec.from_target_config(hf_target.config, config.dflash)
        init = load_init_drafter(tc.init_from, config.store) if tc.init_from else None
        if init is not None:  # train.init_from: its weights and shapes, checked against what this run derives
            self.spec = check_init_spec(init.spec, self.spec, config.dflash, hf_target.config, str(tc.init_from))
        assert self.spec.gamma is not None  # from_target_config resolves dflash.gamma or its default
        self.gamma: float = self.spec.gamma
        self.target = TargetModel(hf_target, self.spec.target_layer_ids)
        self.head = TargetHead.from_target(hf_target, place.drafter_device)
        resolved = resolved_training_config(config, self.spec, output_url, rows.tokenize_run)
        resolved["target"]["dtype"] = str(hf_target.dtype).removeprefix("torch.")  # what target.dtype resolved to
        identity = run_identity(resolved, place.world_size, rows.lineage.sha256)
        keep_every = tc.keep_checkpoint_every * tc.checkpoint_every if tc.keep_checkpoint_every else None
        self.checkpoints = Checkpoints(out_store, resolved, identity, rows.lineage, tc.keep_checkpoints, keep_every, reporter)

        torch.manual_seed(tc.seed)  # the drafter's initial weights (when not train.init_from's)
        self.drafter = DFlashDrafter(self.spec)
        if init is not None:
            self.drafter.load_state_dict(init.state_dict())
        self.drafter.to(place.drafter_device)
        self.model: nn.Module = DraftForward(self.drafter)
        if place.world_size > 1:
            device_ids = [place.drafter_device] if place.drafter_device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        self.global_batch = tc.batch_size * place.world_size
        self.per_epoch = steps_per_epoch(len(rows), self.global_batch)
        self.order = RowOrder(len(rows), tc.seed, self.global_batch, tc.batch_size)
        self.total_steps = tc.max_steps or tc.epochs * self.per_epoch
        schedule = partial(warmup_cosine, warmup=round(tc.warmup_ratio * self.total_steps), total=self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

        self.log = MetricsLog(Path(tc.log_dir), tc.plot_every_minutes * 60, reporter.warn)
        self.metrics: deque[dict[str, Any]] = deque(maxlen=self.RECENT_METRICS)
        self.steps_run = 0
        self.resumed_from: int | None = None
        self.last_checkpoint: VerifyReport | None = None
        self._queued: tuple[int, tuple[BlockBatch, torch.Tensor]] | None = None

    def train(self) -> list[dict[str, Any]]:
        """Resume, then step to `total_steps`, logging and checkpointing on the way; returns this run's latest metrics
        entries (`metrics`)."""
        start = self.resume()
        self.reporter.progress("train", start, self.total_steps)
        for step in range(start, self.total_steps):
            entry = self.step(step)
            self.metrics.append(entry)
            self.steps_run += 1
            done = step + 1
            if self.place.is_main and (done % self.tc.log_every == 0 or done == self.total_steps):
                self.log.append(entry)
            self.reporter.progress("train", done, self.total_steps, loss=round(entry["loss"], 4), tau=round(entry["tau_estimate"], 2))
            self.maybe_checkpoint(done)
        return list(self.metrics)

    def resume(self) -> int:
        """Load the newest verified checkpoint of this run into the drafter, optimizer, scheduler and RNGs (every rank);
        returns the step to start from: the checkpoint's, or 0 (a fresh metrics log) when there is none."""
        found = self.checkpoints.newest()
        if found is None:
            if self.place.is_main:
                self.log.start_fresh()
            return 0
        with read_checkpoint(found) as loaded:
            device = self.place.drafter_device
            self.drafter.load_state_dict({name: tensor.to(device) for name, tensor in loaded.drafter_state.items()})
            self.optimizer.load_state_dict(loaded.training_state["optimizer"])
            self.scheduler.load_state_dict(loaded.training_state["scheduler"])
            set_rng_state(loaded.training_state["rng"])
            if self.place.is_main and (first := self.log.restart_from(loaded.folder, found.step)) is not None:
                self.reporter.warn(
                    f"{self.log.path} did not hold this run's metrics up to step {found.step}: it restarts with the checkpoint's "
                    f"entries from step {first} on (a checkpoint keeps only those logged since the one before)"
                )
        self.reporter.say(f"resuming from verified checkpoint {found.store.url} (step {found.step})")
        self.resumed_from, self.last_checkpoint = found.step, found.report
        return found.step

    def step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (0-based) on this rank's slice of its global batch; returns the step's metrics entry,
        summed over all ranks."""
        t0 = time.perf_counter()
        batch, features = self._inputs(step)
        out, grad_norm = forward_backward(self.model, self.drafter, self.head, batch, features, self.tc.lm_head_chunk_blocks, self.tc.grad_clip)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        # The next step's target forward is queued before this step's metrics wait for the drafter's device, so a
        # target on its own GPUs runs while the drafter finishes its backward and optimizer step.
        if step + 1 < self.total_steps:
            self._queued = (step + 1, self.inputs_of(step + 1))
        totals = torch.cat([out.weighted_ce.reshape(1), out.slots.correct, out.slots.total,
                            torch.tensor([float(batch.num_tokens)], device=out.weighted_ce.device)])
        if self.place.world_size > 1:
            dist.all_reduce(totals)
        if self.place.drafter_device.type == "cuda":
            torch.cuda.synchronize(self.place.drafter_device)
        return self._entry(step, totals, out, lr, float(grad_norm), time.perf_counter() - t0)

    def maybe_checkpoint(self, done: int) -> VerifyReport | None:
        """After `done` steps, at every train.checkpoint_every-th and the last: check the replicas are bit-equal, then
        (rank 0) save, push and verify the checkpoint. Returns its report, None when none was (successfully) written here."""
        final = done == self.total_steps
        if done % self.tc.checkpoint_every != 0 and not final:
            return None
        if self.place.world_size > 1:
            check_ranks_in_sync(self.drafter, self.place.world_size)
        if not self.place.is_main:
            return None
        if final:  # the curves of the whole run, in the final checkpoint; before, they are redrawn in the background
            self.log.plotter.now()
        report = self.checkpoints.save(done, self.drafter, self._training_state(done), self.log, final, self.place.world_size)
        self.last_checkpoint = report or self.last_checkpoint
        return report

    def inputs_of(self, step: int) -> tuple[BlockBatch, torch.Tensor]:
        """The batch of `step` on the drafter's device, and its target features [b, S, K*H] fp32 (queued, not awaited)."""
        tc, place = self.tc, self.place
        epoch, in_epoch = divmod(step, self.per_epoch)
        idx = self.order.rows(epoch, in_epoch, place.rank)
        batch = build_block_batch(
            [self.rows.row(i) for i in idx],
            num_anchors=self.config.dflash.num_anchors,
            block_size=self.spec.block_size,
            mask_token_id=self.spec.mask_token_id,
            gamma=self.gamma,
            generators=[anchor_generator(tc.seed, epoch, i) for i in idx],
        ).to(place.drafter_device)
        features = self.target.features(
            batch.input_ids.to(place.target_device), batch.attention_mask_context.long().to(place.target_device)
        ).to(place.drafter_device, torch.float32)
        return batch, features

    def _inputs(self, step: int) -> tuple[BlockBatch, torch.Tensor]:
        """Step `step`'s inputs: the ones queued by the step before, else made now."""
        queued, self._queued = self._queued, None
        return queued[1] if queued is not None and queued[0] == step else self.inputs_of(step)

    def _entry(self, step: int, totals: torch.Tensor, out: LossOutput, lr: float, grad_norm: float, seconds: float) -> dict[str, Any]:
        """The metrics of step `step` from the all-reduced totals [1 + 2 * (B - 1) + 1]: weighted CE, per-slot correct
        and counted, tokens."""
        nslots = self.spec.block_size - 1
        correct, counted = totals[1 : 1 + nslots], totals[1 + nslots : 1 + 2 * nslots]
        accuracy = (correct / counted.clamp_min(1)).tolist()
        tokens = int(totals[-1])
        return {
            "step": step + 1,
            "epoch": step // self.per_epoch,
            "loss": float(totals[0] / out.weight_sum.clamp_min(1e-12)),
            "lr": lr,
            "grad_norm": grad_norm,
            "slot_accuracy": accuracy,
            "tau_estimate": expected_acceptance(accuracy),
            "tokens": tokens,
            "step_time_s": seconds,
            "tokens_per_s": tokens / seconds,
        }

    def _training_state(self, done: int) -> dict[str, Any]:
        """What a resumed run needs besides the weights: optimizer, scheduler, RNGs, and where in the data it stood."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "data": {"step": done, "epoch": done // self.per_epoch, "step_in_epoch": done % self.per_epoch},
            "world_size": self.place.world_size,
        }


__all__ = ["DraftForward", "Trainer", "forward_backward", "warmup_cosine"]
