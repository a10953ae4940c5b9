"""The training signal (issue 29): held-out figures in the log, the trackers and the checkpoint, the schedule's limit
and a changed schedule on resume, plain progress lines without a terminal, the verified line when it verifies,
Ctrl-C."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch
from helpers.train_data import config_file, make_rows, write_tokenized
from rich.console import Console
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.console import ConsoleReporter
from blockdraft.errors import ConfigError, TrainingInterrupted
from blockdraft.model.formats import checkpoint_key
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run
from blockdraft.stages.train.metrics import tracked_scalars
from blockdraft.stages.train.setup import WarmupCosine, resume_schedule
from blockdraft.stages.train.signal import TrainingSignal
from blockdraft.stages.train.trainer import ProgressLines


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(6, prompt_len=6, new_tokens=40, seed=0)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:4], rows[4:])


class Ordered(Reporter):
    """Keeps lines, warnings and progress in the order they came: ("say" | "warn" | "progress", what)."""

    def __init__(self, stop_at: int | None = None, pause_at: int | None = None) -> None:
        super().__init__()
        self.events: list[tuple[str, object]] = []
        self.stop_at, self.pause_at = stop_at, pause_at

    def say(self, line: str) -> None:
        super().say(line)
        self.events.append(("say", line))

    def warn(self, line: str) -> None:
        super().warn(line)
        self.events.append(("warn", line))

    def progress(self, task, completed, total=None, **fields) -> None:
        self.events.append(("progress", completed))
        if completed == self.stop_at:
            raise KeyboardInterrupt
        if completed == self.pause_at:
            time.sleep(2.0)  # time for the checkpoint before to finish its push in the background


def test_held_out_figures_are_logged_tracked_and_recorded_and_each_verified_line_comes_when_it_verifies(
    tmp_path, data_url
):
    cfg = load_config(config_file(tmp_path, data_url, max_steps=12, checkpoint_every=4, eval_every=3,
                                  decode_eval_prompts=1, log_every=5))
    reporter = Ordered(pause_at=6)
    result = run(cfg, reporter=reporter).details
    entries = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    # Every eval_every steps and at each checkpoint, whatever log_every says; the same sample each time (2 held-out
    # rows).
    assert [e["step"] for e in entries if "eval" in e] == [3, 4, 6, 8, 9, 12]
    held = entries[-1]["eval"]
    assert held["rows"] == 2 and len(held["slot_accuracy"]) == 3 and held["tau_estimate"] >= 1.0
    scalars = tracked_scalars(entries[-1])
    assert scalars["eval/tau_estimate"] == held["tau_estimate"] and "eval/slot_accuracy/3" in scalars
    counts = json.loads((tmp_path / "ckpt" / checkpoint_key(12) / "blockdraft-manifest.json").read_text())["counts"]
    assert counts["held_out_tau"] == round(held["tau_estimate"], 3)
    assert counts["decoded_tau"] >= 1.0 and counts["decoded_lossless"] is True and "target_agreement" in counts
    assert "held-out" in result.summary and "decoded" in result.summary
    # The checkpoint of step 4, pushed by step 6, is said verified before step 8 (taken in only by the next checkpoint's
    # save, it would come after step 8's progress).
    said = next(
        i
        for i, (kind, what) in enumerate(reporter.events)
        if kind == "say" and str(what).startswith("checkpoint step 4: ")
    )
    assert said < reporter.events.index(("progress", 8))
    assert any(str(w).startswith("schedule: 12 steps from train.max_steps") for k, w in reporter.events if k == "say")


def test_ctrl_c_names_the_last_verified_checkpoint_and_the_command_that_resumes(tmp_path, data_url, monkeypatch):
    cfg = load_config(config_file(tmp_path, data_url, max_steps=12, checkpoint_every=4, decode_eval_prompts=0))
    with pytest.raises(TrainingInterrupted) as caught:
        run(cfg, reporter=Ordered(stop_at=7))
    assert f"{checkpoint_key(4)} (step 4): rerun the same command to resume from it" in str(caught.value)
    # The command line prints it as one line with the command, and exits 130.
    (tmp_path / "cli").mkdir()
    path = config_file(tmp_path / "cli", data_url, max_steps=12, checkpoint_every=4, decode_eval_prompts=0)
    monkeypatch.setattr(ConsoleReporter, "progress", Ordered(stop_at=2).progress)
    monkeypatch.setattr("sys.argv", ["blockdraft", "train", "--config", str(path)])
    out = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert out.exit_code == 130, out.output
    assert (
        "no checkpoint of this run verified yet: a rerun starts at step 0: blockdraft train --config "
        in out.stderr.replace("\n", "")
    )


def test_a_raised_max_steps_on_resume_is_refused_naming_force_which_starts_a_new_cosine(tmp_path, data_url):
    run(load_config(config_file(tmp_path, data_url, max_steps=4, checkpoint_every=4, decode_eval_prompts=0)))
    longer = load_config(config_file(tmp_path, data_url, max_steps=8, checkpoint_every=4, decode_eval_prompts=0))
    with pytest.raises(ConfigError, match="planned for 4 steps .* rerun with --force to continue with a new cosine "
                                          "from step 4 to 8"):
        run(longer)
    reporter = Reporter()
    result = run(longer, reporter=reporter, force=True).details
    assert any("a new cosine from step 4" in w for w in reporter.warnings)
    lrs = [e["lr"] for e in result.metrics]
    assert lrs[0] == pytest.approx(3e-3) and lrs == sorted(lrs, reverse=True)  # the full rate at step 5, then decaying


def test_the_schedule_plan_rides_in_the_scheduler_state():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(1, 10))
    state = first.state_dict()
    same = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(1, 10))
    same.load_state_dict(state)
    assert resume_schedule(same, {"warmup": 1, "total": 10, "restart_at": None}, 5, force=False) is None
    other = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(2, 20))
    planned = dict(vars(other.lr_lambdas[0]))
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match="--force"):
        resume_schedule(other, planned, 5, force=False)
    assert "new cosine" in (resume_schedule(other, planned, 5, force=True) or "")
    assert other.get_last_lr() == [1.0] and vars(other.lr_lambdas[0]) == {"warmup": 2, "total": 20, "restart_at": 5}


def test_without_a_terminal_one_plain_line_every_interval_with_the_held_out_tau_and_eta():
    out = io.StringIO()
    reporter = ConsoleReporter(Console(file=out, width=200))  # a file: no terminal
    clock = [0.0]
    lines = ProgressLines(reporter, 30.0, start=0, total=100, clock=lambda: clock[0])
    entry = {"step": 10, "loss": 1.5, "tokens_per_s": 1234.0, "supervised_tokens_per_s": 456.0, "padding_share": 0.25}
    assert lines.step(entry, 2.5) is None  # not yet 30 s
    clock[0] = 30.0
    said = "train step 10/100  loss 1.5000  held-out tau 2.50  1,234 tokens/s  456 supervised/s  padding 25%  ETA 4m30s"
    assert lines.step(entry, 2.5) == said
    clock[0] = 45.0
    assert lines.step({**entry, "step": 15}, None) is None
    assert out.getvalue().splitlines() == [said]
    terminal = io.StringIO()
    ConsoleReporter(Console(file=terminal, force_terminal=True)).status_line("x")
    assert terminal.getvalue() == ""  # a terminal has the bar


def test_held_out_far_below_training_warns_once_naming_rows_and_epochs_and_a_low_decoded_tau_warns():
    warned: list[str] = []
    signal = TrainingSignal(warned.append, rows=40, per_epoch=10)
    for _ in range(5):
        signal.trained({"tau_estimate": 6.0})
    signal.measured({"tau_estimate": 3.7, "loss": 1.0}, step=50)
    assert warned == []  # within 60 %
    signal.measured({"tau_estimate": 2.0, "loss": 3.0}, step=240)
    signal.measured({"tau_estimate": 3.0, "loss": 3.5}, step=250)
    assert len(warned) == 1 and "its 40 training rows (24.0 epochs so far)" in warned[0]
    signal.decoded_at({"tau": 1.02, "speedup": 0.3, "lossless": True, "prompts": 2}, step=250)
    assert len(warned) == 2 and "decoded for real gives tau 1.02" in warned[1]
    assert signal.counts()["signal_warnings"] == "overfitting,decoded"
