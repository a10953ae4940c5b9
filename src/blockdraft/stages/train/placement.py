"""Where one training process runs: its rank, its drafter and target devices, and the process group it joins.

One process per drafter device: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; a process started
without them is the only rank. Ranks are data-parallel (DDP: gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blockdraft.config import BlockdraftConfig, check_device
from blockdraft.errors import ConfigError


@dataclass(frozen=True)
class RankPlacement:
    """This process's place in the run: global `rank` of `world_size`, `local_rank` on this machine, and its devices."""

    rank: int
    world_size: int
    local_rank: int
    drafter_device: torch.device
    target_device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the metrics log and the checkpoints."""
        return self.rank == 0


def check_placement_devices(config: BlockdraftConfig) -> None:
    """Every listed device exists on this machine (the lists describe one machine; torchrun across machines runs the same
    lists on each): one it lacks is a ConfigError naming the field and what torch sees, not a torch traceback later."""
    for field, devices in (("drafter_devices", config.placement.drafter_devices), ("target_devices", config.placement.target_devices)):
        for device in devices:
            check_device(f"placement.{field}", device)


def resolve_placement(config: BlockdraftConfig) -> RankPlacement:
    """This process's place (`rank_placement`), after `check_placement_devices`."""
    check_placement_devices(config)
    return rank_placement(config)


def rank_placement(config: BlockdraftConfig) -> RankPlacement:
    """This process's devices: drafter_devices[local rank], and target_devices[local rank] (one each) or the single
    target device. Whether this machine has them is `check_placement_devices`'s question."""
    drafters, targets = config.placement.drafter_devices, config.placement.target_devices
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if local_world != len(drafters):
        raise ConfigError(
            f"placement.drafter_devices lists {len(drafters)} device(s) but {local_world} process(es) run on this machine; "
            f"launch one process per drafter device (blockdraft train --nproc {len(drafters)})"
        )
    if len(targets) == len(drafters):
        target = targets[local_rank]
    elif len(targets) == 1:
        target = targets[0]
    else:
        raise ConfigError(
            f"placement.target_devices lists {len(targets)} devices for {len(drafters)} drafter devices; "
            "give one target device per drafter device, or a single one that every rank uses"
        )
    return RankPlacement(rank, world, local_rank, torch.device(drafters[local_rank]), torch.device(target))


@contextmanager
def rank_session(place: RankPlacement, deterministic: bool) -> Iterator[None]:
    """Join the process group (several ranks, none joined yet) and, when `deterministic`, switch torch to deterministic
    algorithms; both are undone on exit, so an in-process caller gets its torch settings back."""
    owns_group = place.world_size > 1 and not dist.is_initialized()
    if owns_group:
        if place.drafter_device.type == "cuda":
            torch.cuda.set_device(place.drafter_device)
        dist.init_process_group("nccl" if place.drafter_device.type == "cuda" else "gloo")
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses deterministic mode without it
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if owns_group:
            dist.destroy_process_group()


def barrier(place: RankPlacement) -> None:
    """Wait for every rank (nothing to wait for when this is the only one)."""
    if place.world_size > 1:
        dist.barrier()


__all__ = ["RankPlacement", "barrier", "check_placement_devices", "rank_placement", "rank_session", "resolve_placement"]
