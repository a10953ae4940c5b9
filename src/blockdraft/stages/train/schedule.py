"""The learning-rate schedule, and saying which limit sets its length (docs/TRAINING-SIGNAL.md, "Schedule").

The schedule is linear warmup then cosine decay to 0 at the run's last step. Its plan (warmup, total, and where a new
cosine restarted it) rides in the scheduler's state in every checkpoint, so a resumed run knows the plan it continues.
A resume whose config plans another length (train.max_steps raised, train.epochs changed) is refused in one line unless
`--force`, which continues with a new cosine: the full learning rate at the resumed step, decaying to 0 at the new end.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from blockdraft.config import TrainConfig
from blockdraft.errors import ConfigError


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class WarmupCosine:
    """The LR multiplier of step `step`: `warmup_cosine`, or from `restart_at` on a cosine from 1 to 0 at `total`.
    Its attributes are its plan: `torch.optim.lr_scheduler.LambdaLR` saves and loads them with its state."""

    def __init__(self, warmup: int, total: int, restart_at: int | None = None) -> None:
        self.warmup, self.total, self.restart_at = warmup, total, restart_at

    def __call__(self, step: int) -> float:
        if self.restart_at is not None and step >= self.restart_at:
            return 0.5 * (1.0 + math.cos(math.pi * (step - self.restart_at) / max(1, self.total - self.restart_at)))
        return warmup_cosine(step, self.warmup, self.total)


def planned_steps(tc: TrainConfig, per_epoch: int) -> int:
    """train.max_steps when set (train.epochs is then not used), else train.epochs x the steps of one epoch."""
    return tc.max_steps or tc.epochs * per_epoch


def describe_limit(tc: TrainConfig, per_epoch: int, rows: int) -> str:
    """One line saying which limit sets the run's length, and what it is in the other unit."""
    total = planned_steps(tc, per_epoch)
    if tc.max_steps:
        return (f"schedule: {total:,} steps from train.max_steps ({total / per_epoch:.1f} epochs of {rows:,} rows; "
                f"train.epochs = {tc.epochs} is not used while train.max_steps is set)")
    return f"schedule: {total:,} steps = train.epochs {tc.epochs} x {per_epoch:,} steps per epoch ({rows:,} rows; train.max_steps unset)"


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, planned: dict[str, Any], step: int, force: bool) -> str | None:
    """After a checkpoint's scheduler state was loaded into `scheduler` (its plan now the recorded one), compare it with
    `planned` (this config's, `vars` of its `WarmupCosine` before the load). The same length and warmup, or a restarted
    cosine to the same total, go on as recorded; another plan raises ConfigError unless `force`, which restarts a cosine
    at `step` to the new total. Returns the line to say about a restart, else None."""
    fn = scheduler.lr_lambdas[0]
    assert isinstance(fn, WarmupCosine)
    recorded = dict(vars(fn))
    total, warmup = planned["total"], planned["warmup"]
    if recorded["total"] == total and (recorded["warmup"] == warmup or recorded["restart_at"] is not None):
        return None
    base = scheduler.base_lrs[0]
    if not force:
        raise ConfigError(
            f"the learning-rate schedule changed since the checkpoint of step {step}: it was planned for {recorded['total']:,} "
            f"steps ({recorded['warmup']:,} of warmup), this config plans {total:,} ({warmup:,}); resuming would move the "
            f"learning rate from {base * fn(step):.3g} to {base * WarmupCosine(warmup, total)(step):.3g} at once. Restore "
            f"train.max_steps / train.epochs / train.warmup_ratio, or rerun with --force to continue with a new cosine from "
            f"step {step} to {total:,}"
        )
    if step >= total:
        raise ConfigError(f"the checkpoint of step {step} is past this config's {total:,} steps; raise train.max_steps or train.epochs")
    fn.warmup, fn.total, fn.restart_at = warmup, total, step
    lrs = [b * fn(step) for b in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reads: the learning rate of step `step`
    return (f"--force: a new cosine from step {step} (learning rate {lrs[0]:.3g}) to 0 at step {total:,} replaces the "
            f"schedule planned for {recorded['total']:,} steps")


def new_scheduler(optimizer: torch.optim.Optimizer, tc: TrainConfig, per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's LambdaLR over `optimizer`: warmup over train.warmup_ratio of the planned steps, then cosine."""
    total = planned_steps(tc, per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(round(tc.warmup_ratio * total), total))


__all__ = ["WarmupCosine", "describe_limit", "new_scheduler", "planned_steps", "resume_schedule", "warmup_cosine"]
