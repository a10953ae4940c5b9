"""`blockdraft train`: train in this process when it is a torchrun rank or the only rank, else start torchrun.

torchrun starts one process per drafter device, each running `python -m blockdraft train --config FILE`
(`blockdraft/__main__.py`), which lands here again as a rank and calls `run`. With placement.nnodes > 1 every node
runs `blockdraft train` with its placement.node_rank, and the torchruns meet at placement.rdzv_endpoint
(`rendezvous_args`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blockdraft.config import BlockdraftConfig, PlacementConfig, load_config
from blockdraft.errors import ConfigError
from blockdraft.overrides import as_set_items, flag_overrides
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.train.memory import MemoryPlan, memory_plan
from blockdraft.stages.train.ranks import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_VALUE, resolve_placement
from blockdraft.stages.train.stage import run

PLAN_CHECKED = "BLOCKDRAFT_PLAN_CHECKED"  # set for the ranks torchrun starts from here
TORCHRUN = "blockdraft.stages.train.torchrun"  # torchrun, with a rendezvous that fails as one line


@dataclass
class Launched:
    """What `launch` did: trained in this process as `rank` (`result`), or ran torchrun (`result` None, its
    `exit_status`)."""

    result: StageResult | None
    rank: int = 0
    exit_status: int = 0


def launch(
    config_path: str | None, nproc: int | None = None, reporter: Reporter | None = None, force: bool = False,
    sets: Sequence[str] = (), flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> Launched:
    """Train per the config at `config_path` (None: the defaults) with `flags` (the node flags, {"placement": {...}}, as
    `load_config` takes them) and `sets` (`--set section.key=value`) laid over it, with one process per
    placement.drafter_devices entry (on each of placement.nnodes nodes). `force`: take over a dead writer's lease and
    start over when checkpoints are there but none verifies (`run`), on every rank: the ranks get `--force`, the flags
    as `--set` items (`as_set_items`) and `sets` on their command line.

    `nproc`, when given, must equal that count (a check, not a setting). The memory plan is printed and checked first
    (`check_plan`). In a torchrun rank, or with a single drafter device, `run` trains here; otherwise torchrun starts
    the ranks and this waits for it.
    """
    config = load_config(config_path, dict(flags or {}), sets)
    rendezvous = rendezvous_args(config.placement)
    if config.placement.nnodes > 1:  # torchrun waits 15 minutes for the nodes by default: as long as a collective here
        rendezvous.append(f"--rdzv-conf=timeout={max(1, round(config.train.dist_timeout_minutes * 60))}")
    wanted = len(config.placement.drafter_devices)
    if nproc is not None and nproc != wanted:
        raise ConfigError(
            f"--nproc {nproc} but placement.drafter_devices lists {wanted} device(s); one process runs per drafter "
            "device, so list the devices in the config (or --set placement.drafter_devices=cpu,cpu)"
        )
    in_rank = "LOCAL_RANK" in os.environ
    if not os.environ.get(PLAN_CHECKED):  # ranks this launcher starts skip it: the plan was printed and checked here
        check_plan(config, reporter or Reporter(), show=not in_rank or os.environ.get("RANK", "0") == "0")
    if in_rank or (wanted == 1 and config.placement.nnodes == 1):
        return Launched(run(config, None, None, reporter, force=force), rank=resolve_placement(config.placement).rank)
    if config_path is None:
        raise ConfigError("training on several drafter devices or nodes needs the config as a file; pass --config FILE")
    if config.placement.nnodes > 1 and config.placement.node_rank == 0:
        refuse_taken_port(config.placement)
    # the ranks' environment, not ours
    env = {CUBLAS_WORKSPACE: CUBLAS_WORKSPACE_VALUE, **os.environ, PLAN_CHECKED: "1"}
    rank_sets = [*as_set_items(flag_overrides(flags or {})), *sets]
    return Launched(None,
                    exit_status=subprocess.call(torchrun_command(config_path, wanted, force, rank_sets, rendezvous),
                                                env=env))


def check_plan(config: BlockdraftConfig, reporter: Reporter, show: bool = True) -> MemoryPlan:
    """The placement and memory plan, printed through `reporter` when `show`, before any weights load; a plan that does
    not fit a device is a ConfigError naming the device and the numbers (see `blockdraft.stages.train.memory`)."""
    planned = memory_plan(config)
    if show:
        for line in planned.lines():
            reporter.say(line)
    if problem := planned.problem():
        raise ConfigError(problem)
    return planned


_ENDPOINT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(\d{1,5})")  # HOST:PORT, an IPv6 host in brackets


def rendezvous_args(placement: PlacementConfig) -> list[str]:
    """torchrun's arguments for where this node's ranks meet the others: `--standalone` on one node; else a static
    rendezvous at placement.rdzv_endpoint, which node 0's torchrun serves and the others join. Static, not c10d: c10d
    orders nodes by host name and ignores --node-rank, and rank 0 (checkpoints, the output's lease, the metrics log,
    what is printed) belongs on node 0. No restarts: a lost node fails the run, and a rerun resumes from the newest
    verified checkpoint. A missing or malformed endpoint, or a node rank past the node count, is a ConfigError."""
    nodes, rank, endpoint = placement.nnodes, placement.node_rank, placement.rdzv_endpoint
    if rank >= nodes:
        raise ConfigError(f"placement.node_rank {rank} but placement.nnodes is {nodes}; give each node a rank from 0 "
                          f"to {nodes - 1}")
    if nodes == 1:
        return ["--standalone"]
    found = None if endpoint is None else _ENDPOINT.fullmatch(endpoint)
    if endpoint is None or found is None or not 1 <= int(found.group(2)) <= 65535:
        raise ConfigError(
            f"placement.nnodes {nodes} needs placement.rdzv_endpoint as HOST:PORT (node 0's address and a free port "
            f"from 1 to 65535, the same on every node), not {endpoint!r}; pass --rdzv-endpoint HOST:PORT"
        )
    return [f"--nnodes={nodes}", f"--node-rank={rank}", "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}",
            "--max-restarts=0"]


def refuse_taken_port(placement: PlacementConfig) -> None:
    """ConfigError when placement.rdzv_endpoint's port is already taken on this machine, which node 0's torchrun serves
    the rendezvous on (all interfaces): another program holds it, or another process was started as node 0 too."""
    assert placement.rdzv_endpoint is not None  # rendezvous_args checked it
    port = int(placement.rdzv_endpoint.rsplit(":", 1)[1])
    try:
        probe = socket.socket(socket.AF_INET6)  # dual-stack: taken over IPv4 or IPv6
    except OSError:  # IPv6 switched off on this machine
        probe = socket.socket(socket.AF_INET)
    with probe:
        # as torchrun's store: a closed run's TIME_WAIT is no owner
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise ConfigError(
                f"placement.rdzv_endpoint {placement.rdzv_endpoint}: port {port} is in use on this machine "
                f"({exc.strerror}), where node 0 serves the rendezvous: another program holds it, or another node was "
                "started as --node-rank 0; pass a free port (the same on every node) and give each node its own "
                "--node-rank"
            ) from None


def torchrun_command(
    config_path: str, nproc: int, force: bool = False, sets: Sequence[str] = (), rendezvous: list[str] | None = None
) -> list[str]:
    """The command that starts `nproc` training ranks on this machine, each `python -m blockdraft train --config FILE`
    with this run's `--set` overrides (each rank re-reads the file, so they travel on its command line), and `--force`
    when this run was given it; `rendezvous`: `rendezvous_args` (default: one node, `--standalone`)."""
    return [
        sys.executable, "-m", TORCHRUN, *(rendezvous or ["--standalone"]), f"--nproc-per-node={nproc}",
        "-m", "blockdraft", "train", "--config", str(config_path), *(["--force"] if force else []),
        *(arg for item in sets for arg in ("--set", item)),
    ]


__all__ = ["PLAN_CHECKED", "TORCHRUN", "Launched", "check_plan", "launch", "refuse_taken_port", "rendezvous_args",
           "torchrun_command"]
