"""Trust, fourth ring (issue 47): a stage refuses, in one line and before it changes anything, what would make its
figures or its advice false: train.eval_data tokenized from an input train.data was tokenized from too (its held-out
figures would be training figures), and a demo over an earlier demo's workdir that trained the other drafter. The
target agreement `tokenize --check-target` measures is bound to the manifest whose rows it read, never to one another
run wrote meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.inotify import ReadWatch
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
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import AGREEMENT_NAME, manifest_sha256, read_manifest, record_agreement

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


def _manifest_sha256(folder: Path) -> str:
    found = read_manifest(LocalStore(folder))
    assert found is not None
    return manifest_sha256(found[1])


def test_a_tokenize_into_the_folder_while_check_target_measures_it_leaves_no_share_bound_to_its_manifest(tmp_path):
    """`tokenize --check-target` is stopped (SIGSTOP) once it loads the target to measure the rows, a second tokenize
    writes other rows into the same folder, and the first goes on: the share it measured is of the first rows, so it
    is not noted beside the second manifest (it says so), and `status` shows none."""
    target = tmp_path / "target"  # a copy of its own: another process reading the package's target is no signal here
    shutil.copytree(TINY_TARGET_DIR, target)
    config = tmp_path / "blockdraft.toml"
    config.write_text(f'[target]\npath = "{target}"\n[tokenize]\nheld_out_fraction = 0.0\n'
                      "[train]\ntarget_agreement_rows = 6\n")
    tokenized = tmp_path / "work" / "tokenized"
    first_rows, other_rows = _completions(tmp_path / "first.jsonl", 0, 8), _completions(tmp_path / "other.jsonl", 8, 12)
    watch = ReadWatch(target)
    command = [sys.executable, "-m", "blockdraft", "tokenize", first_rows, str(tokenized), "--config", str(config),
               "--check-target"]
    measuring = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "generation_config.json" not in watch.names_read():  # read when the target's model loads: measuring
            assert measuring.poll() is None and time.monotonic() < deadline, measuring.communicate()
            time.sleep(0.001)
        os.kill(measuring.pid, signal.SIGSTOP)
        measured = _manifest_sha256(tokenized)
        remade = CliRunner().invoke(app, ["tokenize", other_rows, str(tokenized), "--config", str(config), "--force"])
        assert remade.exit_code == 0, remade.output
    finally:
        if measuring.returncode is None:  # not reaped yet: stopped or running
            os.kill(measuring.pid, signal.SIGCONT)
        _, err = measuring.communicate(timeout=120)
        watch.close()
    assert measuring.returncode == 0, err
    assert not (tokenized / AGREEMENT_NAME).exists()
    assert "no longer holds the artifact whose rows were measured" in " ".join(err.split()), err
    surveyed = CliRunner().invoke(app, ["status", str(tmp_path / "work")])
    assert surveyed.exit_code == 0 and "target_agreement" not in surveyed.stdout, surveyed.output

    # Bound to the manifest it measured, a share is noted only while the folder holds that manifest.
    share = {"agreement": 0.5, "positions": 10, "rows": 2, "by_thinking": {}}
    assert not record_agreement(LocalStore(tokenized), measured, "target", share)
    assert record_agreement(LocalStore(tokenized), _manifest_sha256(tokenized), "target", share)
    shown = CliRunner().invoke(app, ["status", str(tmp_path / "work")]).stdout
    assert "target_agreement=0.500 (target, 2 rows)" in shown


def test_check_target_on_an_artifact_without_training_rows_records_and_shows_no_rows_to_measure(tmp_path):
    """Every conversation held out: the train split holds no row, so there is no share to measure. The command, the
    record and `status` say so; none of them gives a share of 0."""
    config = tmp_path / "blockdraft.toml"
    config.write_text(f'[target]\npath = "{TINY_TARGET_DIR}"\n[tokenize]\nheld_out_fraction = 0.99\n'
                      "[train]\ntarget_agreement_rows = 6\n")
    tokenized = tmp_path / "work" / "tokenized"
    made = CliRunner().invoke(app, ["tokenize", _completions(tmp_path / "c.jsonl", 0, 3), str(tokenized), "--config",
                                    str(config), "--check-target"])
    assert made.exit_code == 0, made.output
    assert "target agreement: no rows to measure" in " ".join(made.stderr.split())
    found = read_manifest(LocalStore(tokenized))
    assert found is not None and found[0].counts["train_rows"] == 0
    record = json.loads((tokenized / AGREEMENT_NAME).read_text())
    assert (record["agreement"], record["positions"], record["rows"]) == (None, 0, 0)
    surveyed = CliRunner().invoke(app, ["status", str(tmp_path / "work")])
    assert surveyed.exit_code == 0, surveyed.output
    assert f"target_agreement=no rows to measure ({TINY_TARGET_DIR.name})" in surveyed.stdout, surveyed.stdout
    assert "target_agreement=0" not in surveyed.stdout
