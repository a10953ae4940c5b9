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

import pytest
import torch
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

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
    from blockdraft.store.stage_io import open_input

    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.txt").write_text("rows\n")
    from blockdraft.store.artifact import commit_artifact, entry_for_local_file

    commit_artifact(open_store(data), "tokenized", [entry_for_local_file(data, data / "rows.txt")], config={}, counts={})
    cfg = BlockdraftConfig(target=TargetConfig(path=str(GOLDEN / "target")),
                           dflash=DFlashConfig(block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5], num_draft_layers=3, gamma=3.0))
    save_checkpoint(open_store(tmp_path / "run"), 10, drafter, {"step": 10}, cfg.resolved(), [open_input(open_store(data)).ref], {"step": 10})
    with pytest.raises(ExportError) as err:
        export_stage.run(BlockdraftConfig(), str(tmp_path / "run"), str(tmp_path / "export"))
    assert "not finite" in one_line(err) and "fc.weight" in str(err.value)
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


# ---- case 12 (training): a resumed run says which changed settings it uses ----


def test_a_resumed_run_says_the_checkpoints_learning_rate_goes_on_and_what_it_takes_from_the_config(tmp_path, data_url):
    first = load_config(config_file(tmp_path, data_url, max_steps=4, checkpoint_every=4, lr=3e-3))
    run(first)
    lr_at_4 = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[-1])["lr"]
    resumed = load_config(config_file(tmp_path, data_url, max_steps=6, checkpoint_every=2, lr=1e-1))
    run(resumed, reporter=(reporter := Reporter()))
    (line,) = reporter.warnings
    assert "NOT used: train.lr = 0.1 (the checkpoint's: 0.003)" in line
    assert "train.max_steps = 6 (was 4)" in line and "train.checkpoint_every = 2 (was 4)" in line
    entries = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert entries[4]["step"] == 5 and entries[4]["lr"] <= 3e-3 and lr_at_4 <= 3e-3  # the checkpoint's rate went on


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
def test_a_log_dir_inside_the_runs_input_output_or_an_artifact_or_unwritable_is_one_line(tmp_path, data_url, where, says):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_url, data)
    shutil.copytree(data_url, tmp_path / "artifact")
    (tmp_path / "a-file").write_text("a user's file\n")
    cfg = load_config(config_file(tmp_path, str(data), max_steps=4), sets=[f"train.log_dir={tmp_path / where}"])
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "blockdraft.toml"), "--set", f"train.log_dir={tmp_path / where}"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]  # after the memory plan's lines
    assert line.startswith(f"error: train.log_dir {tmp_path / where}") and says in line and "train.log_dir to a folder" in line
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
    monkeypatch.setattr("sys.argv", ["blockdraft", "train", "--set", f"store.endpoint_url=http://user:{secret}@127.0.0.1:9"])
    path = config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2, report_to=["wandb"])
    path.write_text(path.read_text() + 'wandb = { mode = "offline", project = "blockdraft-tests" }\n')
    cfg = load_config(path, sets=[f"store.endpoint_url=http://user:{secret}@127.0.0.1:9"])
    run(cfg, reporter=(reporter := Reporter()))
    assert reporter.warnings == []
    files = [p for p in (tmp_path / "logs" / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)  # the run was recorded
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
