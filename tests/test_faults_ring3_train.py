"""Issue 28, training side: no run trains garbage and calls it verified, writes its log where it does not belong, or
ends in a traceback where one line was due.

Settings that validate and then overflow are bounded at load; a diverging run stops at its first non-finite step before
checkpointing it, and export refuses non-finite weights; train.log_dir is checked like train.output and belongs to one
run; a resumed run says which changed settings it uses; W&B records no secret of the command line; several nodes
compare their config and data at start; a rendezvous that cannot happen is one line, not a hang.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

import blockdraft
from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import ConfigError, DivergedError, ExportError
from blockdraft.model import DFlashDrafter
from blockdraft.model.formats import checkpoint_key
from blockdraft.reporter import Reporter
from blockdraft.stages import export as export_stage
from blockdraft.stages.train import run

pytestmark = pytest.mark.fault


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(4, prompt_len=6, new_tokens=24, seed=3)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:3], rows[3:])


# ---- case 10, and case 6's settings: values that validate and then overflow are bounded at load ----


@pytest.mark.parametrize(("setting", "bound"), [
    ("train.lr=inf", "finite"), ("train.lr=nan", "finite"), ("train.lr=-inf", "finite"),
    ("train.seed=100000000000000000000000", "< 18446744073709551616"),
    ("train.device_memory_gb=inf", "finite"), ("train.device_memory_gb=1e300", "<= 1000000"),
    ("train.dist_timeout_minutes=inf", "finite"), ("train.dist_timeout_minutes=1e300", "<= 10080"),
    ("generate.timeout_s=inf", "finite"),
])
def test_a_setting_that_would_overflow_is_refused_at_load_naming_the_field(setting, bound):
    field = setting.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, sets=[setting])
    message = one_line(err)
    assert f"--set {setting}" in message and f"(it sets {field})" in message and bound in message


def test_the_largest_seed_torch_takes_trains_and_the_plan_runs_with_a_finite_memory_size(tmp_path):
    cfg = load_config(None, sets=["train.seed=18446744073709551615", "train.device_memory_gb=64",
                                  "train.dist_timeout_minutes=10080"])
    torch.manual_seed(cfg.train.seed)
    result = CliRunner().invoke(app, ["train", "--plan", "--set", "train.device_memory_gb=inf"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "train.device_memory_gb" in result.output and "finite" in result.output


# ---- case 6: a run that diverges stops before its checkpoint; export refuses non-finite weights ----


def test_a_diverging_run_stops_at_the_first_non_finite_step_before_checkpointing_it(tmp_path, data_url):
    """lr = 1e12 trains to a NaN loss at step 2: the run stops there in one line naming the step, no checkpoint holds
    it, and the metrics log holds only valid JSON (step 1)."""
    cfg = load_config(config_file(tmp_path, data_url, max_steps=6, checkpoint_every=2, lr=1e12, warmup_ratio=0.0))
    with pytest.raises(DivergedError) as err:
        run(cfg)
    message = one_line(err)
    assert "training diverged at step 2: loss nan" in message and "before checkpointing it" in message
    assert "lower train.lr" in message
    assert not (tmp_path / "ckpt" / checkpoint_key(2)).exists()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    entries = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl")) for line in lines]
    assert [e["step"] for e in entries] == [1] and math.isfinite(entries[0]["loss"])


def test_export_refuses_a_checkpoint_with_non_finite_weights(tmp_path):
    """A checkpoint that verifies but holds NaN weights (as a diverged run would have written) exports nothing."""
    from helpers.paths import GOLDEN

    from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
    from blockdraft.stages.train import save_checkpoint
    from blockdraft.store import open_store
    from blockdraft.store.inputs import open_input

    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.txt").write_text("rows\n")
    from blockdraft.store.artifact import commit_artifact, entry_for_local_file

    commit_artifact(open_store(data), "tokenized", [entry_for_local_file(data, data / "rows.txt")], config={},
                    counts={})
    cfg = BlockdraftConfig(target=TargetConfig(path=str(GOLDEN / "target")),
                           dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511,
                                               target_layer_ids=[1, 3, 5], num_draft_layers=3, gamma=3.0))
    save_checkpoint(open_store(tmp_path / "run"), 10, drafter, {"step": 10}, cfg.resolved(),
                    [open_input(open_store(data)).ref], {"step": 10})
    with pytest.raises(ExportError) as err:
        export_stage.run(BlockdraftConfig(), str(tmp_path / "run"), str(tmp_path / "export"))
    assert "not finite" in one_line(err) and "fc.weight" in str(err.value)
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


# ---- case 12 (training): a resumed run says which changed settings it uses ----


def test_a_resumed_run_says_the_checkpoints_learning_rate_goes_on_and_what_it_takes_from_the_config(tmp_path, data_url):
    """A run of 6 steps whose checkpoints after step 2 are gone resumes at step 2 with another train.lr (not used: the
    optimizer's state holds the rate) and another train.checkpoint_every (used): one warning names both."""
    import shutil

    run(load_config(config_file(tmp_path, data_url, max_steps=6, checkpoint_every=2, lr=3e-3)))
    uninterrupted = [json.loads(x)["lr"] for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    for step in (4, 6):
        shutil.rmtree(tmp_path / "ckpt" / checkpoint_key(step))
    resumed = load_config(config_file(tmp_path, data_url, max_steps=6, checkpoint_every=4, lr=1e-1))
    run(resumed, reporter=(reporter := Reporter()))
    (line,) = reporter.warnings
    assert line.startswith("resuming at step 2 with settings that changed since its checkpoint")
    assert "NOT used: train.lr = 0.1 (the checkpoint's: 0.003)" in line and "train.checkpoint_every = 4 (was 2)" in line
    entries = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [e["lr"] for e in entries] == pytest.approx(uninterrupted)  # the checkpoint's rate went on


def test_no_warning_when_a_run_resumes_with_its_own_config(tmp_path, data_url):
    cfg = load_config(config_file(tmp_path, data_url, max_steps=2, checkpoint_every=1))
    run(cfg)
    again = run(cfg, reporter=(reporter := Reporter()))  # resumes at step 2, its final checkpoint
    assert again.details.resumed_from == 2 and reporter.warnings == []
    assert not [line for line in reporter.lines if "changed since its checkpoint" in line]


# ---- case 4: train.log_dir is checked like train.output and belongs to one run ----


@pytest.mark.parametrize(("where", "says"), [
    ("data", "is train.data"), ("data/train", "lies inside train.data"), ("ckpt", "is train.output"),
    ("ckpt/step-00000004", "lies inside train.output"), ("artifact/logs", "lies inside the artifact at"),
    ("a-file", "is a file, not a folder"), ("a-file/logs", "cannot be written"),
])
def test_a_log_dir_inside_the_runs_input_output_or_an_artifact_or_unwritable_is_one_line(tmp_path, data_url, where,
                                                                                         says):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_url, data)
    shutil.copytree(data_url, tmp_path / "artifact")
    (tmp_path / "a-file").write_text("a user's file\n")
    cfg = load_config(config_file(tmp_path, str(data), max_steps=4), sets=[f"train.log_dir={tmp_path / where}"])
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "blockdraft.toml"), "--set",
                                      f"train.log_dir={tmp_path / where}"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]  # after the memory plan's lines
    assert (
        line.startswith(f"error: train.log_dir {tmp_path / where}")
        and says in line
        and "train.log_dir to a folder" in line
    )
    assert cfg.train.log_dir == str(tmp_path / where)
    assert (tmp_path / "a-file").read_text() == "a user's file\n" and not (tmp_path / "ckpt").exists()


def test_a_log_dir_belongs_to_one_run_a_rerun_continues_it_and_another_run_is_refused(tmp_path, data_url):
    """The first run records itself in its log folder and says where the log is; its rerun continues the log; a run
    with another output (or identity) sharing the folder is refused before it replaces metrics.jsonl."""
    cfg = load_config(config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2))
    run(cfg, reporter=(reporter := Reporter()))
    logs = tmp_path / "logs"
    assert f"metrics log: {logs / 'metrics.jsonl'}" in reporter.lines
    owner = json.loads((logs / "blockdraft-log.json").read_text())
    assert owner["format"] == "blockdraft-log/1" and owner["output"] == str(tmp_path / "ckpt")
    before = (logs / "metrics.jsonl").read_text()
    assert run(cfg).already_done and (logs / "metrics.jsonl").read_text() == before

    other = load_config(config_file(tmp_path, data_url, output=str(tmp_path / "other"), max_steps=2, seed=5))
    with pytest.raises(ConfigError) as err:
        run(other)
    assert f"train.log_dir {logs} holds the metrics of another run (train.output {tmp_path / 'ckpt'})" in one_line(err)
    assert (logs / "metrics.jsonl").read_text() == before and not list((tmp_path / "other").glob("step-*"))

    (logs / "blockdraft-log.json").unlink()  # a log no run recorded as its own is not taken over either
    with pytest.raises(ConfigError, match="holds a metrics.jsonl that no run recorded as its own"):
        run(other)
    assert (logs / "metrics.jsonl").read_text() == before


# ---- case 11: W&B records no command line, which may carry a secret ----


def test_wandb_run_files_hold_no_secret_of_the_command_line(tmp_path, data_url, monkeypatch):
    secret = "SECRETpw4711"
    monkeypatch.setattr("sys.argv",
                        ["blockdraft", "train", "--set", f"store.endpoint_url=http://user:{secret}@127.0.0.1:9"])
    path = config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2, report_to=["wandb"])
    path.write_text(path.read_text() + 'wandb = { mode = "offline", project = "blockdraft-tests" }\n')
    cfg = load_config(path, sets=[f"store.endpoint_url=http://user:{secret}@127.0.0.1:9"])
    run(cfg, reporter=(reporter := Reporter()))
    assert reporter.warnings == []
    files = [p for p in (tmp_path / "logs" / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)  # the run was recorded
    assert [p for p in files if secret.encode() in p.read_bytes()] == []


# ---- cases 7 and 8: several nodes (processes on this machine, one gloo rank each, meeting on the loopback) ----

BLOCKDRAFT = str(Path(sys.executable).with_name("blockdraft"))  # the installed console script
NODE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(blockdraft.__file__).parents[1])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(cfg: Path, rank: int, port: int, cwd: Path, *sets: str) -> subprocess.Popen:
    """Node `rank` of 2 started in `cwd` with `--set` items `sets`; its output in cwd/node{rank}.out and .err."""
    args = ["train", "--config", str(cfg), "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
            f"127.0.0.1:{port}"]
    args += [arg for item in sets for arg in ("--set", item)]
    with open(cwd / f"node{rank}.out", "w") as out, open(cwd / f"node{rank}.err", "w") as err:
        return subprocess.Popen([BLOCKDRAFT, *args], cwd=cwd, env=NODE_ENV, stdout=out, stderr=err)


def stop(*nodes: subprocess.Popen) -> None:
    """Kill the nodes still running (a failed test leaves none behind: a node 0 that no node joins waits)."""
    for started in nodes:
        if started.poll() is None:
            started.kill()
            started.wait()


def errors_of(folder: Path, rank: int) -> list[str]:
    text = (folder / f"node{rank}.err").read_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_node_started_with_another_setting_is_refused_at_start_naming_the_field_and_the_node(tmp_path, data_url):
    """Node 1 with another train.lr: both nodes stop before any data or model loads, each with one line naming train.lr
    and node 1."""
    cfg = config_file(tmp_path, data_url, max_steps=2, batch_size=1, global_batch_size=2, dist_timeout_minutes=1.0)
    port = free_port()
    nodes = [node(cfg, 0, port, tmp_path), node(cfg, 1, port, tmp_path, "train.lr=0.001")]
    try:
        assert [n.wait(timeout=240) for n in nodes] == [2, 2]
    finally:
        stop(*nodes)
    for rank in (0, 1):
        (line,) = errors_of(tmp_path, rank)
        assert line.startswith(
            "error: node 1 (rank 1) was started with train.lr = 0.001, node 0 (rank 0) with 0.003"
        ), line
    assert not list((tmp_path / "ckpt").glob("step-*"))  # nothing trained


def test_ranks_reading_other_data_at_the_same_path_are_refused_naming_the_node(tmp_path):
    """Two real gloo ranks whose train.data has the same path: with the same manifest digest they agree; with another
    (each node's own copy) every rank stops with the same line naming node 1."""
    import torch.multiprocessing as mp
    from helpers.agree_rank import compare_data

    rounds = [["c" * 64] * 2, ["a" * 64, "b" * 64]]
    mp.spawn(compare_data, args=(free_port(), "tok", rounds, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}-0").read_text() for r in (0, 1)] == ["agreed", "agreed"]
    said = [(tmp_path / f"rank{r}-1").read_text() for r in (0, 1)]
    assert said[0] == said[1] and said[0].startswith("node 1 (rank 1) reads other data at train.data tok"), said
    assert (
        "manifest sha256 bbbbbbbbbbbb..., node 0's aaaaaaaaaaaa..." in said[0] and "same tokenized artifact" in said[0]
    )


def test_a_rendezvous_endpoint_out_of_range_or_a_taken_port_is_one_line(tmp_path, data_url):
    cfg = str(config_file(tmp_path, data_url, batch_size=1, global_batch_size=2))
    result = CliRunner().invoke(app, ["train", "--config", cfg, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:99999"])
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output and "a free port from 1 to 65535" in line
    assert "not '127.0.0.1:99999'" in line

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["train", "--config", cfg, "--nnodes", "2", "--rdzv-endpoint",
                                          f"127.0.0.1:{port}"])
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"port {port} is in use on this machine" in line and "its own --node-rank" in line


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET6) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


@pytest.mark.slow
def test_two_nodes_both_started_as_node_0_each_end_in_one_line_within_the_timeout(tmp_path, data_url):
    """The second node 0 finds the rendezvous port taken; the first, whose node 1 never comes, gives up after
    train.dist_timeout_minutes with one line, not torchrun's traceback and not its default 15 minutes."""
    timeout_minutes = 0.1
    cfg = config_file(tmp_path, data_url, max_steps=2, batch_size=1, global_batch_size=2,
                      dist_timeout_minutes=timeout_minutes)
    port = free_port()
    first = node(cfg, 0, port, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "node0.err").read_text()[-3000:]
            time.sleep(0.05)
        started = time.monotonic()
        args = ["train", "--config", str(cfg), "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                f"127.0.0.1:{port}"]
        second = CliRunner().invoke(app, args)
        (line,) = [x for x in second.output.splitlines() if x.startswith("error:")]
        assert second.exit_code == 2 and f"port {port} is in use" in line and "Traceback" not in second.output
        status = first.wait(timeout=timeout_minutes * 60 + 120)
    finally:
        stop(first)
    waited = time.monotonic() - started
    assert status == 2 and waited < timeout_minutes * 60 + 60, (status, waited)
    (line,) = errors_of(tmp_path, 0)
    assert f"the nodes did not meet at 127.0.0.1:{port}" in line and "train.dist_timeout_minutes (6 s)" in line
