"""The run stops at the first step whose numbers are not finite: a NaN or infinite loss or gradient norm (a learning
rate far too high, an overflow) would otherwise go on into NaN weights, checkpoints that verify and an export that
serves garbage. Every rank checks the same all-reduced numbers, so every rank stops at the same step, before that
step's checkpoint is taken; the weights are checked once more right before each checkpoint."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from blockdraft.errors import DivergedError
from blockdraft.model.finite import describe_nonfinite, nonfinite_weights

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
        f"training diverged at step {entry['step']}: loss {loss}, gradient norm {grad_norm} (learning rate {entry['lr']:g}); "
        f"the run stopped before checkpointing it ({newest}); {_ADVICE}"
    )


def check_finite_weights(drafter: nn.Module, step: int) -> None:
    """DivergedError when the drafter's weights after `step` hold a NaN or an infinity (checked before its checkpoint)."""
    if bad := nonfinite_weights(drafter):
        raise DivergedError(f"training diverged at step {step}: {describe_nonfinite(bad)}; the run stopped before "
                            f"checkpointing it; {_ADVICE}")


__all__ = ["check_finite_step", "check_finite_weights"]
