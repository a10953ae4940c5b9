"""Whether a module's weights are all finite: training checks before each checkpoint and export before it writes, so
NaN or infinite weights are never stored as a drafter that verifies."""

from __future__ import annotations

import torch
from torch import nn


def nonfinite_weights(module: nn.Module) -> list[str]:
    """The names of `module`'s parameters that hold a NaN or an infinity, in order; [] when all are finite. One
    device-to-host read for the whole module (one flag per parameter), not one per tensor."""
    named = list(module.named_parameters())
    if not named:
        return []
    flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu().tolist()
    return [name for (name, _), finite in zip(named, flags, strict=True) if not finite]


def describe_nonfinite(names: list[str]) -> str:
    """`names` (from `nonfinite_weights`) as a short phrase: the count and the first few."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} weight tensor(s) hold NaN or infinite values ({shown})"


__all__ = ["describe_nonfinite", "nonfinite_weights"]
