"""Issue 29's acceptance on the tiny target: training on text the target would not write (its own completions with each
answer's words reversed) warns at start (target agreement) and during training (held-out far below training), and the
target's own completions warn of nothing; the decoded tau training reports is the eval's on the same prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.pipeline import SIZES, demo_config, write_toml
from blockdraft.reporter import Reporter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train as train_stage

ROWS = 60  # conversations: the measurement size
CI = SIZES["ci"]


def _reverse_words(text: str) -> str:
    return " ".join(reversed(text.split(" ")))


def _completions(folder: Path, reverse: bool) -> Path:
    folder.mkdir(parents=True)
    out = folder / "completions.jsonl"
    with open(TINY_TARGET_DIR / "completions.jsonl") as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            if i >= ROWS:
                break
            row = json.loads(line)
            if reverse:
                turn = row["messages"][-1]
                turn["content"] = _reverse_words(turn["content"])
                turn["reasoning_content"] = _reverse_words(turn.get("reasoning_content") or "")
            dst.write(json.dumps(row) + "\n")
    return folder


def train_and_eval(tmp: Path, reverse: bool) -> tuple[object, Reporter, object]:
    """Tokenize ROWS of the tiny target's completions (held out: a fifth), train the ci demo's size on them with the
    training signal on, then eval the final checkpoint on the held-out prompts the training decoded."""
    tmp.mkdir(parents=True, exist_ok=True)
    sections = demo_config(tmp, str(tmp / "store"), CI)
    sections["tokenize"]["held_out_fraction"] = 0.2
    sections["train"].update(data=str(tmp / "tokenized"), eval_every=20, eval_rows=12,
                             decode_eval_prompts=CI.eval_prompts, checkpoint_every=30)
    write_toml(tmp / "blockdraft.toml", sections)
    cfg = load_config(tmp / "blockdraft.toml")
    tokenize_stage.run(cfg, str(_completions(tmp / "completions", reverse)), str(tmp / "tokenized"))
    reporter = Reporter()
    trained = train_stage.run(cfg, reporter=reporter)
    evaluated = eval_stage.run(cfg, trained.url, str(tmp / "eval"), prompts=str(tmp / "tokenized"))
    return trained.details, reporter, evaluated.details


@pytest.mark.slow
@pytest.mark.parametrize("reverse", [False, True], ids=["own-completions", "words-reversed"])
def test_agreement_warns_on_text_the_target_would_not_write_and_decoded_tau_is_the_evals(tmp_path, reverse):
    result, reporter, report = train_and_eval(tmp_path, reverse)
    agreement = result.signal["target_agreement"]
    low = [w for w in reporter.warnings if w.startswith("target agreement")]
    if reverse:
        assert agreement < 0.6 and len(low) == 1 and "blockdraft generate" in low[0]  # measured 0.48
    else:
        assert agreement > 0.9 and reporter.warnings == []  # measured 0.97
    # The same weights on the same prompts with the same loop: the figure eval gives (measured: equal).
    assert result.signal["decoded_tau"] == pytest.approx(report.drafters["dflash"].tau, abs=0.01)
    assert result.signal["decoded_lossless"] and report.lossless.ok
    assert abs(result.signal["held_out_tau"] - report.drafters["dflash"].tau) < 0.25  # measured 0.03 and 0.01
    # The same figure before any training: `tokenize --check-target` (its output already done) and `train --plan`.
    config = str(tmp_path / "blockdraft.toml")
    for args in (["tokenize", str(tmp_path / "completions"), str(tmp_path / "tokenized"), "--check-target"],
                 ["train", "--plan"]):
        out = CliRunner().invoke(app, [*args, "--config", config])
        assert out.exit_code == 0, out.output
        said = out.stderr.replace("\n", " ")
        assert f"target agreement {agreement:.2f}:" in said
        assert ("WARNING: target agreement" in said) == reverse


@pytest.mark.slow
def test_text_the_target_would_not_write_warns_at_start_and_again_when_the_drafter_learns_its_rows(tmp_path):
    """The target's completions with each answer's words reversed, trained 400 steps: the low target agreement before
    step 1, then held-out far below training once the drafter has learned its rows (measured: held-out 1.99 against a
    training estimate of 4.67 at step 300)."""
    sections = demo_config(tmp_path, str(tmp_path / "store"), CI)
    sections["tokenize"]["held_out_fraction"] = 0.2
    sections["train"].update(data=str(tmp_path / "tokenized"), eval_every=100, eval_rows=12, decode_eval_prompts=0,
                             checkpoint_every=400, max_steps=400)
    write_toml(tmp_path / "blockdraft.toml", sections)
    cfg = load_config(tmp_path / "blockdraft.toml")
    tokenize_stage.run(cfg, str(_completions(tmp_path / "completions", reverse=True)), str(tmp_path / "tokenized"))
    reporter = Reporter()
    result = train_stage.run(cfg, reporter=reporter).details
    said = [w.split(" ")[0:3] for w in reporter.warnings]
    assert said == [["target", "agreement", "0.48"], ["held-out", "tau", "estimate"]], reporter.warnings
    assert re.search(
        r"far below the training one .* the drafter learns its \d+ training rows \(\d+\.\d epochs so far\)",
        reporter.warnings[1],
    )
    assert result.signal["signal_warnings"] == "overfitting"
    assert result.signal["held_out_tau"] < 0.6 * result.signal["train_tau"]
