"""Trust, fourth ring (issue 47): a stage refuses, in one line and before it changes anything, what would make its
figures or its advice false: train.eval_data tokenized from an input train.data was tokenized from too (its held-out
figures would be training figures), and a demo over an earlier demo's workdir that trained the other drafter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.tiny_run import tiny_config
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import ConfigError
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.pipeline import SIZES, claim_workdir, demo_config, run_demo, write_toml
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train
from blockdraft.store import open_store

pytestmark = pytest.mark.fault


def _completions(path: Path, first: int, last: int) -> str:
    lines = (TINY_TARGET_DIR / "completions.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[first:last]))
    return str(path)


def test_eval_data_tokenized_from_an_input_of_train_data_is_refused_naming_it(tmp_path):
    """The same completions tokenized twice, with and without held-out rows: most rows of the second are training rows
    of the first, so train refuses before its first step, naming the shared file."""
    shared = _completions(tmp_path / "completions.jsonl", 0, 8)
    cfg = load_config(None, tiny_config(tmp_path, tokenize={"held_out_fraction": 0.25}))
    tokenize_stage.run(cfg, shared, str(tmp_path / "data"))
    tokenize_stage.run(load_config(None, tiny_config(tmp_path)), shared, str(tmp_path / "eval-data"))
    settings = {"data": str(tmp_path / "data"), "eval_data": str(tmp_path / "eval-data"),
                "output": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"), "max_steps": 1,
                "checkpoint_every": 1, "target_agreement_rows": 0}
    run_cfg = load_config(None, tiny_config(tmp_path, train=settings))
    url = open_store(shared).url
    with pytest.raises(ConfigError, match=rf"^train.eval_data .*eval-data was tokenized from {re.escape(url)}, as "
                                          r"train.data .*data was: its rows are training rows"):
        train.run(run_cfg)
    assert not any((tmp_path / "run").glob("step-*"))


def _earlier_demo(workdir: Path, drafter: str) -> bytes:
    """A workdir as a demo of `drafter` leaves it (its mark and its config); the config's bytes."""
    claim_workdir(workdir)
    sections = demo_config(workdir, f"file://{workdir / 'store'}", SIZES["ci"], drafter=drafter)
    write_toml(workdir / "blockdraft.toml", sections)
    return (workdir / "blockdraft.toml").read_bytes()


@pytest.mark.parametrize("earlier,drafter", [("dflash", "dflash2"), ("dflash2", "dflash")])
def test_a_demo_of_the_other_drafter_over_an_earlier_demos_workdir_is_refused_before_rewriting_it(
    tmp_path, earlier, drafter
):
    workdir = tmp_path / "demo-work"
    config = _earlier_demo(workdir, earlier)
    with pytest.raises(ConfigError, match=rf"^--workdir {re.escape(str(workdir))} holds an earlier demo of a {earlier} "
                                          rf"drafter, .* give the {drafter} demo its own --workdir"):
        run_demo(workdir, profile="ci", drafter=drafter)
    assert (workdir / "blockdraft.toml").read_bytes() == config and not (workdir / "store").exists()
    said = CliRunner().invoke(app, ["demo", "--workdir", str(workdir), "--profile", "ci", "--drafter", drafter])
    assert said.exit_code != 0 and "Traceback" not in said.output
    assert "holds an earlier demo" in said.stderr.replace("\n", " ")
    assert (workdir / "blockdraft.toml").read_bytes() == config
