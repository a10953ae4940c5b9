"""One gloo rank of two, spawned by the tests of `check_same_config` and `check_same_data` (`stages/train/ranks.py`): it
imports only what the check needs, so a spawned process starts in a few seconds."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from blockdraft.config import BlockdraftConfig
from blockdraft.errors import ConfigError
from blockdraft.stages.train.ranks import RankPlacement, check_same_config, check_same_data


def compare_data(rank: int, port: int, folder: str, rounds: list[list], out: str,
                 eval_folder: str | None = None) -> None:
    """Join the group, check the config (the same on both), then for each round of data digests ([rank 0's, rank 1's],
    each a train.data digest or a [train.data, train.eval_data] pair when `eval_folder` is train.eval_data) check the
    data; what each round said ("agreed" or the error line) goes to `out`/rank{rank}-{round}."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    place = RankPlacement(rank, 2, 0, torch.device("cpu"), torch.device("cpu"))
    train = {"data": folder, "eval_data": eval_folder}
    config = BlockdraftConfig.model_validate({"train": train, "placement": {"nnodes": 2, "node_rank": rank}})
    try:
        check_same_config(config, place)
        for index, digests in enumerate(rounds):
            data, evaluated = (digests[rank], None) if isinstance(digests[rank], str) else digests[rank]
            try:
                check_same_data(config, data, place, evaluated)
                said = "agreed"
            except ConfigError as exc:
                said = str(exc)
            Path(out, f"rank{rank}-{index}").write_text(said)
    finally:
        dist.destroy_process_group()
