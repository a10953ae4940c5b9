"""Initial weights of a fresh drafter (`train.init`): PyTorch's per-layer defaults, or HF's normal(0,
initializer_range).

PyTorch initialises an `nn.Linear` uniformly in +-1/sqrt(fan_in) (std 1/sqrt(3 * fan_in): about 0.009 at fan-in 4096 and
0.004 for `fc`'s 5 * 4096 inputs), while HF's models draw every linear and embedding weight from normal(0, std) with std
the config's `initializer_range` (0.02 for Qwen3): 2-5x larger at those sizes, and the same for every layer whatever its
fan-in. "hf_normal" gives the drafter the latter, from the target's own config, with biases at 0 and RMSNorm scales
at 1. Both draw from torch's global generator, so `train.seed` fixes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from blockdraft.model.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from blockdraft.model.drafter import RMSNorm

INIT_CHOICES = ("pytorch", "hf_normal")
DEFAULT_INITIALIZER_RANGE = 0.02


def initializer_range(hf_config: Any) -> float:
    """The target config's `initializer_range` (a composite config's text part when only it has one), else 0.02."""
    for cfg in (hf_config, getattr(hf_config, "get_text_config", lambda: hf_config)()):
        value = getattr(cfg, "initializer_range", None)
        if value is not None:
            return float(value)
    return DEFAULT_INITIALIZER_RANGE


@torch.no_grad()
def hf_normal_(module: nn.Module, std: float) -> None:
    """In place: every Linear and Embedding weight ~ normal(0, std), their biases 0, every RMSNorm/LayerNorm scale 1."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear | nn.Embedding):
            sub.weight.normal_(0.0, std)
            bias = getattr(sub, "bias", None)
            if bias is not None:
                bias.zero_()
        elif isinstance(sub, RMSNorm | nn.LayerNorm):
            if sub.weight is not None:
                sub.weight.fill_(1.0)
            bias = getattr(sub, "bias", None)
            if bias is not None:
                bias.zero_()


def init_drafter(drafter: nn.Module, how: str, hf_target_config: Any) -> None:
    """Apply `train.init` to a freshly built drafter: "pytorch" leaves it as constructed, "hf_normal" redraws it. Either
    way a DFlash2 drafter's convolutions stay at the identity and its codebooks at their own initialisation."""
    if how == "hf_normal":
        hf_normal_(drafter, initializer_range(hf_target_config))
        for sub in drafter.modules():
            if isinstance(sub, GroupedDynamicCausalConv):
                sub.reset_to_identity()
            elif isinstance(sub, CandidateSelector):
                sub.reset_codebooks()
    elif how != "pytorch":
        raise ValueError(f"train.init {how!r} is not one of {', '.join(INIT_CHOICES)}")


__all__ = ["DEFAULT_INITIALIZER_RANGE", "INIT_CHOICES", "hf_normal_", "init_drafter", "initializer_range"]
