"""`blockdraft train` on several nodes, played by several processes on this machine: each node is one `blockdraft train
--nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT` with one gloo rank, meeting on the loopback interface only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.train_data import assert_same_training, config_file, make_rows, write_tokenized
from typer.testing import CliRunner

import blockdraft
from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.model.formats import checkpoint_key, find_resumable
from blockdraft.stages.train import run
from blockdraft.stages.train.launch import PLAN_CHECKED, rendezvous_args
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact

BLOCKDRAFT = str(Path(sys.executable).with_name("blockdraft"))  # the installed console script
# The nodes run the code this test imports (a relative PYTHONPATH would not hold in the nodes' folders).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(blockdraft.__file__).parents[1])}


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(6, prompt_len=6, new_tokens=40, seed=0)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:4], rows[4:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(cfg: Path, rank: int, port: int) -> subprocess.Popen:
    """Node `rank` of 2: its own session (so the test can kill the whole node), output in cfg's folder."""
    folder = cfg.parent
    args = ["train", "--config", str(cfg), "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
            f"127.0.0.1:{port}"]
    with open(folder / f"node{rank}.out", "w") as out, open(folder / f"node{rank}.err", "w") as err:
        return subprocess.Popen([BLOCKDRAFT, *args], cwd=folder, env=ENV, stdout=out, stderr=err,
                                start_new_session=True)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def test_rendezvous_arguments_and_refusals(tmp_path, data_url):
    one = load_config(config_file(tmp_path, data_url)).placement
    assert rendezvous_args(one) == ["--standalone"]
    two = one.model_copy(update={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.0.0.5:29500"})
    assert rendezvous_args(two) == [
        "--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.5:29500", "--max-restarts=0",
    ]
    cfg = str(config_file(tmp_path, data_url, batch_size=1, global_batch_size=2))
    for flags, line in [
        (["--nnodes", "2"], "placement.nnodes 2 needs placement.rdzv_endpoint as HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0"], "not 'node0'; pass --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
         "placement.node_rank 2 but placement.nnodes is 2"),
        (["--nnodes", "3", "--rdzv-endpoint", "h:1"],
         "train.global_batch_size 2 is not a multiple of train.batch_size 1 x 3"),
    ]:
        result = CliRunner().invoke(app, ["train", "--config", cfg, *flags])
        assert result.exit_code == 2 and line in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output  # one line, no traceback


def test_node_flags_are_named_as_typed_and_reach_the_ranks_command_line(tmp_path, data_url, monkeypatch):
    cfg = str(config_file(tmp_path, data_url, batch_size=1, global_batch_size=4, drafters=["cpu", "cpu"]))
    result = CliRunner().invoke(app, ["train", "--config", cfg, "--nnodes", "0"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: --nnodes 0: must be >= 1 (it sets placement.nnodes); pass a valid value"], result.output

    started: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda command, env: started.append(command) or 0)  # torchrun, not started
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(PLAN_CHECKED, raising=False)
    flags = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--set", "train.max_steps=2"]
    result = CliRunner().invoke(app, ["train", "--config", cfg, *flags])
    assert result.exit_code == 0, result.output
    (command,) = started
    assert command[command.index("train"):] == [
        "train", "--config", cfg, "--set", "placement.nnodes=2", "--set", "placement.node_rank=1",
        "--set", "placement.rdzv_endpoint=h:1", "--set", "train.max_steps=2",
    ]


def test_plan_of_two_nodes_names_the_inter_node_gradient_bytes(tmp_path, data_url):
    cfg = str(config_file(tmp_path, data_url, batch_size=1, global_batch_size=4, drafters=["cpu", "cpu"]))
    result = CliRunner().invoke(app, ["train", "--config", cfg, "--plan", "--nnodes", "2", "--rdzv-endpoint", "h:1"])
    assert result.exit_code == 0, result.output
    assert "2 rank(s) on this machine, world size 4, 1 micro-batch(es) per rank per step" in result.output
    # 70,080 drafter parameters in fp32: 0.28 MB, of which a ring over 4 ranks sends 2 x 3/4 out of each node.
    assert "inter-node gradient all-reduce per step: 0.3 MB of gradients (float32" in result.output
    assert "about 0.4 MB out of each node (ring over 4 ranks)" in result.output


@pytest.mark.slow
def test_two_nodes_match_one_node_with_two_ranks(tmp_path, data_url):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    steps, settings = 4, {"batch_size": 1, "checkpoint_every": 2}
    cfg1 = config_file(one, data_url, max_steps=steps, drafters=["cpu", "cpu"], **settings)
    single = subprocess.run([BLOCKDRAFT, "train", "--config", str(cfg1)], cwd=one, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    cfg2 = config_file(two, data_url, max_steps=steps, global_batch_size=2, **settings)  # one drafter device per node
    port = free_port()
    nodes = [start_node(cfg2, rank, port) for rank in (0, 1)]
    assert [node.wait(timeout=300) for node in nodes] == [0, 0], (two / "node0.err").read_text()[-3000:]

    final = verify_artifact(open_store(two / "ckpt").child(checkpoint_key(steps)))
    assert final.state is State.VERIFIED and final.manifest.counts["ranks_in_sync"] == 2
    # Rank 0 is on node 0: it alone prints the final checkpoint.
    assert (two / "node0.out").read_text().splitlines() == [final.url] and (two / "node1.out").read_text() == ""
    assert_same_training(one, two, steps, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.fault
def test_a_killed_node_fails_the_other_in_one_line_and_one_node_resumes(tmp_path, data_url):
    timeout_minutes = 0.25
    cfg = config_file(tmp_path, data_url, max_steps=24, checkpoint_every=2, batch_size=1, global_batch_size=2,
                      dist_timeout_minutes=timeout_minutes)
    port = free_port()
    node0, node1 = (start_node(cfg, rank, port) for rank in (0, 1))
    first = tmp_path / "ckpt" / checkpoint_key(2) / "blockdraft-manifest.json"
    deadline = time.monotonic() + 300
    while not first.exists() and node0.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.02)
    for pid in process_tree(node1.pid):  # the whole node: its launcher, torchrun and its rank
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    status = node0.wait(timeout=timeout_minutes * 60 + 120)
    waited = time.monotonic() - killed
    node1.wait()
    err = (tmp_path / "node0.err").read_text()
    # + the processes' teardown on a busy machine
    assert status != 0 and waited < timeout_minutes * 60 + 60, (status, waited)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 of 2: a collective failed"), err[-3000:]
    assert "rerun `blockdraft train` on every node" in errors[0] and "[rank0]: Traceback" not in err

    # The node count may change between runs when the global batch still splits: one process resumes it alone.
    stopped_at = find_resumable(open_store(tmp_path / "ckpt")).step
    assert 2 <= stopped_at < 24
    resumed = run(load_config(cfg))
    assert resumed.details.resumed_from == stopped_at and resumed.details.steps == 24
    assert verify_artifact(open_store(tmp_path / "ckpt").child(checkpoint_key(24))).state is State.VERIFIED
