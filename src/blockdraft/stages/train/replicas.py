"""What must agree across ranks and across a resume: the replicas' exact parameters, and the random number generators.

`check_ranks_in_sync` runs before each checkpoint; `rng_state`/`set_rng_state` save and restore the RNGs this rank uses.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def parameter_fingerprint(module: nn.Module) -> torch.Tensor:
    """[2] int64 over the exact bits of every parameter: equal on two ranks iff (practically) their parameters are bit-equal.

    Integer arithmetic (wrapping on overflow) so that no rounding can hide a one-ulp difference.
    """
    total = torch.zeros(2, dtype=torch.long)
    for i, p in enumerate(module.parameters()):
        bits = p.detach().float().flatten().view(torch.int32).long()
        weights = torch.arange(1, bits.numel() + 1, device=bits.device) * (2 * i + 1)
        total = total.to(bits.device) + torch.stack([bits.sum(), (bits * weights).sum()])
    return total


def check_ranks_in_sync(drafter: nn.Module, world_size: int) -> None:
    """Refuse to checkpoint replicas that drifted apart (a DDP bug would otherwise train world_size different models)."""
    mine = parameter_fingerprint(drafter)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(everyone[0], other) for other in everyone[1:]):
        raise RuntimeError("drafter replicas differ across ranks after the optimizer step; DDP lost synchronisation")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's CPU and Python RNG states, and the CUDA one of `device` (the drafter's) when it is a GPU: asking
    for every GPU's (`get_rng_state_all`) would create a CUDA context on each GPU of the machine, in every rank."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` saved; its CUDA state, when it holds one, goes to `device`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


__all__ = ["check_ranks_in_sync", "parameter_fingerprint", "rng_state", "set_rng_state"]
