"""The ranks of a run: where each one runs, what they must agree on before training, and what keeps their replicas
equal.

Where one training process runs: its rank, its drafter and target devices, and the process group it joins.

One process per drafter device: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; a process started
without them is the only rank. Ranks are data-parallel (DDP: gloo on CPU, nccl on GPU).

Every rank of a run trains with rank 0's config on rank 0's data, or none trains: checked once at start.

Nodes are started one by one, each with its own config file and `--set` items, and may hold their own copy of the data;
a node started with another setting or other data would train silently (the checkpoint pins node 0's), or fail at the
first checkpoint with DDP's traceback. So each rank sends its resolved config (URLs redacted) and then its data's
manifest digest to every other rank, and every rank refuses, with the same one line, the first rank that differs from
rank 0, naming its node and the first differing field. Only placement.node_rank may differ between nodes.

What must agree across ranks and across a resume: the replicas' exact parameters, and the random number generators.

`check_ranks_in_sync` runs before each checkpoint; `rng_state`/`set_rng_state` save and restore the RNGs this rank uses.
"""

from __future__ import annotations

import datetime
import os
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockdraft.config import BlockdraftConfig, PlacementConfig, check_device
from blockdraft.errors import ConfigError, RankLostError


@dataclass(frozen=True)
class RankPlacement:
    """This process's place in the run: global `rank` of `world_size`, `local_rank` on this machine, and its devices."""

    rank: int
    world_size: int
    local_rank: int
    drafter_device: torch.device
    target_device: torch.device  # where the target's inputs go: the first of `target_group`
    target_group: tuple[torch.device, ...] = ()  # the devices the target is split over (empty: `target_device` alone)

    @property
    def target_devices(self) -> tuple[torch.device, ...]:
        """The devices this rank's target replica is loaded onto, the input's first."""
        return self.target_group or (self.target_device,)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the metrics log and the checkpoints."""
        return self.rank == 0


def check_placement_devices(placement: PlacementConfig) -> None:
    """Every listed device exists on this machine (the lists describe one machine; torchrun across machines runs the
    same lists on each): one it lacks is a ConfigError naming the field and what torch sees, not a torch traceback
    later."""
    for field, devices in (("drafter_devices", placement.drafter_devices),
                           ("target_devices", [d for group in placement.target_groups for d in group])):
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
            f"placement.drafter_devices lists {len(drafters)} device(s) but {local_world} process(es) run on this "
            f"machine; launch one process per drafter device (blockdraft train --nproc {len(drafters)})"
        )
    group = tuple(torch.device(d) for d in target_group_of(placement, local_rank))
    return RankPlacement(rank, world, local_rank, torch.device(drafters[local_rank]), group[0],
                         group if len(group) > 1 else ())


def target_group_of(placement: PlacementConfig, local_rank: int) -> tuple[str, ...]:
    """The devices of local rank `local_rank`'s target replica: target_devices[local rank] (one entry each) or the
    single entry, which then holds one replica per rank (the memory plan counts them); an entry that is a list splits
    the replica over its devices by layer."""
    drafters, groups = placement.drafter_devices, placement.target_groups
    if len(groups) == len(drafters):
        return groups[local_rank]
    if len(groups) == 1:
        return groups[0]
    raise ConfigError(
        f"placement.target_devices lists {len(groups)} entries for {len(drafters)} drafter devices; "
        "give one target device (or device group) per drafter device, or a single one that every rank uses"
    )


# cuBLAS runs deterministically only with this workspace setting in the environment of the process that runs it.
CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_VALUE = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"


@contextmanager
def rank_session(place: RankPlacement, deterministic: bool, timeout_minutes: float = 60.0) -> Iterator[None]:
    """Join the process group (several ranks, none joined yet; a collective waits `timeout_minutes` for the others, as
    train.dist_timeout_minutes says) and, when `deterministic`, switch torch to deterministic algorithms; both are
    undone on exit, so an in-process caller gets its torch settings back. A collective that fails because another rank
    went away or timed out (`lost_rank`) leaves as one RankLostError line, not gloo's traceback."""
    # `launch` sets it for its ranks
    if deterministic and place.drafter_device.type == "cuda" and CUBLAS_WORKSPACE not in os.environ:
        raise ConfigError(f"train.deterministic on CUDA needs {CUBLAS_WORKSPACE}={CUBLAS_WORKSPACE_VALUE} in the "
                          "environment (cuBLAS refuses deterministic mode without it); export it and rerun")
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
            # gloo: "[file:line] what."
            detail = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0]).split(". ")[0][:160]
            raise RankLostError(
                f"rank {place.rank} of {place.world_size}: a collective failed ({detail}); another rank stopped or did "
                f"not answer within train.dist_timeout_minutes = {timeout_minutes:g}: check every node, then rerun "
                "`blockdraft train` on every node, which resumes from the newest verified checkpoint"
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
    the gradients' dtype; returns a Future of the bucket's tensor. torch's `bf16_compress_hook` does the same but
    refuses anything but NCCL. `bucket` is DDP's GradBucket (unannotated: DDP checks the annotation's object, and this
    module's annotations are strings)."""
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


PER_NODE = ("placement.node_rank",)  # what is meant to differ between nodes


def config_leaves(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field, value) of every leaf of a resolved config (nested dicts), in sorted key order; also what a resume
    compares against its checkpoint's config (`checkpoint.changed_settings`)."""
    if isinstance(data, dict):
        for key in sorted(data):
            yield from config_leaves(data[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), data


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(dotted field, `mine`'s value, `theirs`') of the first field in sorted order where the two resolved configs
    differ, the per-node fields left out; None when they agree."""
    a, b = dict(config_leaves(mine)), dict(config_leaves(theirs))
    for key in sorted(a.keys() | b.keys()):
        if key not in PER_NODE and a.get(key) != b.get(key):
            return key, a.get(key), b.get(key)
    return None


def _gather(place: RankPlacement, value: Any) -> list[Any]:
    """`value` of every rank, in rank order (this rank's alone without a process group)."""
    if place.world_size == 1:
        return [value]
    gathered: list[Any] = [None] * place.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def check_same_config(config: BlockdraftConfig, place: RankPlacement) -> None:
    """ConfigError on every rank when a rank's resolved config differs from rank 0's (see the module)."""
    sent = _gather(place, (config.placement.node_rank, config.resolved()))
    node0, reference = sent[0]
    for rank, (node, resolved) in enumerate(sent[1:], start=1):
        if (found := first_difference(reference, resolved)) is not None:
            field, ours, theirs = found
            raise ConfigError(
                f"node {node} (rank {rank}) was started with {field} = {theirs!r}, node {node0} (rank 0) with "
                f"{ours!r}; every node must train with the same settings (only placement.node_rank differs): start "
                "each node with the same config file and --set items"
            )


def check_same_data(config: BlockdraftConfig, data_sha256: str, place: RankPlacement,
                    eval_sha256: str | None = None) -> None:
    """ConfigError on every rank when a rank's train.data, or its train.eval_data (`eval_sha256`, None when unset), is
    not rank 0's (its manifest digest differs)."""
    sent = _gather(place, (config.placement.node_rank, data_sha256, eval_sha256))
    node0, *reference = sent[0]
    for rank, (node, *digests) in enumerate(sent[1:], start=1):
        for field, url, digest, theirs in zip(("train.data", "train.eval_data"),
                                              (config.train.data, config.train.eval_data), digests, reference):
            if digest != theirs:
                raise ConfigError(
                    f"node {node} (rank {rank}) reads other data at {field} {url} (manifest sha256 "
                    f"{(digest or '')[:12]}..., node {node0}'s {(theirs or '')[:12]}...); every node must read the "
                    "same tokenized artifact: copy node 0's to each node (blockdraft push / pull)"
                )


def parameter_fingerprint(module: nn.Module) -> torch.Tensor:
    """[2] int64 over the exact bits of every parameter: equal on two ranks iff (practically) their parameters are
    bit-equal.

    Integer arithmetic (wrapping on overflow) so that no rounding can hide a one-ulp difference.
    """
    total = torch.zeros(2, dtype=torch.long)
    for i, p in enumerate(module.parameters()):
        bits = p.detach().float().flatten().view(torch.int32).long()
        weights = torch.arange(1, bits.numel() + 1, device=bits.device) * (2 * i + 1)
        total = total.to(bits.device) + torch.stack([bits.sum(), (bits * weights).sum()])
    return total


def check_ranks_in_sync(drafter: nn.Module, world_size: int) -> None:
    """Refuse to checkpoint replicas that drifted apart (a DDP bug would otherwise train world_size different
    models)."""
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


__all__ = [
    "PER_NODE", "RankPlacement", "allreduce_hook_for", "barrier", "bf16_allreduce_hook", "check_placement_devices",
    "check_ranks_in_sync", "check_same_config", "check_same_data", "config_leaves", "first_difference", "lost_rank",
    "parameter_fingerprint", "rank_placement", "rank_session", "register_grad_allreduce", "resolve_placement",
    "rng_state", "set_rng_state", "target_group_of",
]
