"""Where one training process runs: its rank, its drafter and target devices, and the process group it joins.

One process per drafter device: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; a process started
without them is the only rank. Ranks are data-parallel (DDP: gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockdraft.config import PlacementConfig, check_device
from blockdraft.errors import ConfigError, RankLostError


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


def check_placement_devices(placement: PlacementConfig) -> None:
    """Every listed device exists on this machine (the lists describe one machine; torchrun across machines runs the same
    lists on each): one it lacks is a ConfigError naming the field and what torch sees, not a torch traceback later."""
    for field, devices in (("drafter_devices", placement.drafter_devices), ("target_devices", placement.target_devices)):
        for device in devices:
            check_device(f"placement.{field}", device)


def resolve_placement(placement: PlacementConfig) -> RankPlacement:
    """This process's place (`rank_placement`), after `check_placement_devices`."""
    check_placement_devices(placement)
    return rank_placement(placement)


def rank_placement(placement: PlacementConfig) -> RankPlacement:
    """This process's devices: drafter_devices[local rank], and target_devices[local rank] (one each) or the single
    target device. Whether this machine has them is `check_placement_devices`'s question."""
    drafters = placement.drafter_devices
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if local_world != len(drafters):
        raise ConfigError(
            f"placement.drafter_devices lists {len(drafters)} device(s) but {local_world} process(es) run on this machine; "
            f"launch one process per drafter device (blockdraft train --nproc {len(drafters)})"
        )
    target = target_device_of(placement, local_rank)
    return RankPlacement(rank, world, local_rank, torch.device(drafters[local_rank]), torch.device(target))


def target_device_of(placement: PlacementConfig, local_rank: int) -> str:
    """The device of local rank `local_rank`'s target replica: target_devices[local rank] (one each) or the single
    target device, which then holds one replica per rank (the memory plan counts them)."""
    drafters, targets = placement.drafter_devices, placement.target_devices
    if len(targets) == len(drafters):
        return targets[local_rank]
    if len(targets) == 1:
        return targets[0]
    raise ConfigError(
        f"placement.target_devices lists {len(targets)} devices for {len(drafters)} drafter devices; "
        "give one target device per drafter device, or a single one that every rank uses"
    )


# cuBLAS runs deterministically only with this workspace setting in the environment of the process that runs it.
CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_VALUE = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"


@contextmanager
def rank_session(place: RankPlacement, deterministic: bool, timeout_minutes: float = 60.0) -> Iterator[None]:
    """Join the process group (several ranks, none joined yet; a collective waits `timeout_minutes` for the others, as
    train.dist_timeout_minutes says) and, when `deterministic`, switch torch to deterministic algorithms; both are undone
    on exit, so an in-process caller gets its torch settings back. A collective that fails because another rank went
    away or timed out (`lost_rank`) leaves as one RankLostError line, not gloo's traceback."""
    if deterministic and place.drafter_device.type == "cuda" and CUBLAS_WORKSPACE not in os.environ:  # `launch` sets it for its ranks
        raise ConfigError(f"train.deterministic on CUDA needs {CUBLAS_WORKSPACE}={CUBLAS_WORKSPACE_VALUE} in the environment "
                          "(cuBLAS refuses deterministic mode without it); export it and rerun")
    owns_group = place.world_size > 1 and not dist.is_initialized()
    if owns_group:
        if place.drafter_device.type == "cuda":
            torch.cuda.set_device(place.drafter_device)
        backend = "nccl" if place.drafter_device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as exc:
        if place.world_size > 1 and lost_rank(exc):
            detail = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0]).split(". ")[0][:160]  # gloo: "[file:line] what."
            raise RankLostError(
                f"rank {place.rank} of {place.world_size}: a collective failed ({detail}); another rank stopped or did not answer "
                f"within train.dist_timeout_minutes = {timeout_minutes:g}: check every node, then rerun `blockdraft train` on every "
                "node, which resumes from the newest verified checkpoint"
            ) from None
        raise
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if owns_group:
            dist.destroy_process_group()


def lost_rank(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed for want of another rank: torch's DistError (a timeout, a closed store
    or communicator), or gloo's RuntimeError (a peer's connection reset or closed, a timed-out receive), which names
    gloo's transport in its message."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def bf16_allreduce_hook(group: dist.ProcessGroup | None, bucket):
    """A DDP comm hook for gloo: the bucket's mean over ranks computed in bf16 (half the bytes sent), written back in
    the gradients' dtype; returns a Future of the bucket's tensor. torch's `bf16_compress_hook` does the same but refuses
    anything but NCCL. `bucket` is DDP's GradBucket (unannotated: DDP checks the annotation's object, and this module's
    annotations are strings)."""
    world = dist.get_world_size(group)
    compressed = bucket.buffer().to(torch.bfloat16).div_(world)
    work = dist.all_reduce(compressed, group=group, async_op=True)
    assert work is not None  # async_op returns the pending work
    future = work.get_future()

    def write_back(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(done.value()[0])
        return out

    return future.then(write_back)


def allreduce_hook_for(backend: str, dtype: str) -> Callable[..., Any] | None:
    """The comm hook for train.grad_allreduce_dtype on a process group of `backend`: None (DDP's own fp32 all-reduce),
    torch's `bf16_compress_hook` on NCCL, `bf16_allreduce_hook` elsewhere (gloo)."""
    if dtype == "float32":
        return None
    if backend == "nccl":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        return bf16_compress_hook
    return bf16_allreduce_hook


def register_grad_allreduce(model: nn.parallel.DistributedDataParallel, dtype: str) -> None:
    """Make `model`'s gradient all-reduce run in `dtype` (train.grad_allreduce_dtype); float32 leaves DDP as it is."""
    hook = allreduce_hook_for(str(dist.get_backend()), dtype)
    if hook is not None:
        model.register_comm_hook(None, hook)


def barrier(place: RankPlacement) -> None:
    """Wait for every rank (nothing to wait for when this is the only one)."""
    if place.world_size > 1:
        dist.barrier()


__all__ = [
    "RankPlacement",
    "allreduce_hook_for",
    "barrier",
    "bf16_allreduce_hook",
    "check_placement_devices",
    "lost_rank",
    "rank_placement",
    "rank_session",
    "register_grad_allreduce",
    "resolve_placement",
    "target_device_of",
]
