"""Every rank of a run trains with rank 0's config on rank 0's data, or none trains: checked once at start.

Nodes are started one by one, each with its own config file and `--set` items, and may hold their own copy of the data;
a node started with another setting or other data would train silently (the checkpoint pins node 0's), or fail at the
first checkpoint with DDP's traceback. So each rank sends its resolved config (URLs redacted) and then its data's
manifest digest to every other rank, and every rank refuses, with the same one line, the first rank that differs from
rank 0, naming its node and the first differing field. Only placement.node_rank may differ between nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from blockdraft.config import BlockdraftConfig
from blockdraft.errors import ConfigError
from blockdraft.stages.train.placement import RankPlacement

PER_NODE = ("placement.node_rank",)  # what is meant to differ between nodes


def _leaves(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for key in sorted(data):
            yield from _leaves(data[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), data


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(dotted field, `mine`'s value, `theirs`') of the first field in sorted order where the two resolved configs
    differ, the per-node fields left out; None when they agree."""
    a, b = dict(_leaves(mine)), dict(_leaves(theirs))
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
                f"node {node} (rank {rank}) was started with {field} = {theirs!r}, node {node0} (rank 0) with {ours!r}; "
                "every node must train with the same settings (only placement.node_rank differs): start each node with "
                "the same config file and --set items"
            )


def check_same_data(config: BlockdraftConfig, data_sha256: str, place: RankPlacement, eval_sha256: str | None = None) -> None:
    """ConfigError on every rank when a rank's train.data, or its train.eval_data (`eval_sha256`, None when unset), is not
    rank 0's (its manifest digest differs)."""
    sent = _gather(place, (config.placement.node_rank, data_sha256, eval_sha256))
    node0, *reference = sent[0]
    for rank, (node, *digests) in enumerate(sent[1:], start=1):
        for field, url, digest, theirs in zip(("train.data", "train.eval_data"), (config.train.data, config.train.eval_data),
                                              digests, reference):
            if digest != theirs:
                raise ConfigError(
                    f"node {node} (rank {rank}) reads other data at {field} {url} (manifest sha256 {(digest or '')[:12]}..., "
                    f"node {node0}'s {(theirs or '')[:12]}...); every node must read the same tokenized artifact: copy node 0's "
                    "to each node (blockdraft push / pull)"
                )


__all__ = ["PER_NODE", "check_same_config", "check_same_data", "first_difference"]
