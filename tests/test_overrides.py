"""`--set section.key=value`: one override mechanism for every command, typed by the config model, pinned in the
artifacts, and carried to the training ranks torchrun starts; `--force` travels as a parameter, never through the
environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import TEMPLATES, TOKENIZER_DIR
from helpers.tokenize_data import write_jsonl
from helpers.train_data import config_file, logged_losses, make_rows, write_tokenized
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import ConfigError
from blockdraft.model.formats import checkpoint_key
from blockdraft.overrides import as_set_items, flag_overrides
from blockdraft.stages.train.launch import torchrun_command
from blockdraft.store import open_store
from blockdraft.store.artifact import State, read_manifest, verify_artifact
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.lease import LeaseRecord


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def test_set_values_are_typed_by_the_config_model():
    cfg = load_config(None, sets=[
        "train.max_steps=3", "train.lr=1e-3", "train.deterministic=true", "train.init_from=none",
        "train.global_batch_size=4",
        "placement.drafter_devices=cpu,cpu", "dflash.target_layer_ids=[1, 5]", "eval.engine_args=--max-model-len,4096",
    ])
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.deterministic, cfg.train.init_from) == (3, 0.001, True, None)
    assert cfg.placement.drafter_devices == ["cpu", "cpu"] and cfg.dflash.target_layer_ids == [1, 5]
    assert cfg.eval.engine_args == ["--max-model-len", "4096"]
    assert cfg.resolved()["train"]["max_steps"] == 3  # what every artifact pins


@pytest.mark.parametrize("item, says", [
    ("train.max_stepz=3",
     "--set train.max_stepz=3: [train] has no key 'max_stepz' (did you mean 'max_steps'?); keys: data, output"),
    ("trian.max_steps=3",
     "--set trian.max_steps=3: the config has no section 'trian' (did you mean 'train'?); sections: target"),
    ("train.max_steps", "--set train.max_steps: write it as section.key=value"),
    ("train.max_steps=0", "--set train.max_steps=0: must be >= 1 (it sets train.max_steps); pass a valid value"),
    ("train.deterministic=maybe", "--set train.deterministic=maybe: Input should be a valid boolean"),
    ("placement.drafter_devices=gpu",
     "--set placement.drafter_devices=gpu: 'gpu' is not a device; use cpu, cuda, cuda:N or mps"),
], ids=["unknown key", "unknown section", "no value", "out of bounds", "not a bool", "field validator"])
def test_a_bad_set_is_refused_with_one_line_naming_it(tmp_path, item, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets=[item])
    assert str(err.value).startswith(says) and "\n" not in str(err.value)
    # The same line from any command, before it touches anything.
    line = _one_line(CliRunner().invoke(app, ["status", str(tmp_path), "--set", item]))
    assert says in line


def test_a_stage_flag_is_a_spelling_of_set():
    flagged = load_config(None, {"tokenize": {"workers": 3, "max_length": None}})
    assert flagged.resolved() == load_config(None, sets=["tokenize.workers=3"]).resolved()
    # the same value twice
    assert load_config(None, {"tokenize": {"workers": 3}}, ["tokenize.workers=3"]).tokenize.workers == 3
    with pytest.raises(ConfigError, match=r"^--workers 3 and --set tokenize.workers=4 both set tokenize.workers; pass "
                                          r"only one of them$"):
        load_config(None, {"tokenize": {"workers": 3}}, ["tokenize.workers=4"])
    # Flags travel on as --set items (to the training ranks) and read back as the same values.
    overrides = flag_overrides({"placement": {"drafter_devices": ["cpu", "cpu"]},
                                "train": {"max_steps": 3, "deterministic": False}})
    items = as_set_items(overrides)
    assert items == ['placement.drafter_devices=["cpu", "cpu"]', "train.max_steps=3", "train.deterministic=false"]
    assert load_config(None, sets=items).resolved() == load_config(None, overrides.values).resolved()


def test_the_target_flags_of_tokenize_and_export_spell_the_target_section(tmp_path):
    """`tokenize --tokenizer/--chat-template` and `export --target` are target.tokenizer/chat_template/path: typed,
    checked against a --set of the same field, and pinned like any override."""
    own = TEMPLATES / "trl_qwen3_6.jinja"
    rows = [{"id": "r0", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    result = CliRunner().invoke(app,
                                ["tokenize", str(data), str(out), "--tokenizer", str(TOKENIZER_DIR), "--chat-template",
                                 str(own)])
    assert result.exit_code == 0, result.output
    pinned = read_manifest(open_store(out))[0].config["target"]
    assert (pinned["tokenizer"], pinned["chat_template"]) == (str(TOKENIZER_DIR), str(own))
    line = _one_line(CliRunner().invoke(app,
                                        ["tokenize", str(data), str(out), "--tokenizer", "a", "--set",
                                         "target.tokenizer=b"]))
    assert line == "error: --tokenizer a and --set target.tokenizer=b both set target.tokenizer; pass only one of them"
    line = _one_line(CliRunner().invoke(app,
                                        ["export", str(out), str(tmp_path / "x"), "--target", "a", "--set",
                                         "target.path=b"]))
    assert line == "error: --target a and --set target.path=b both set target.path; pass only one of them"


def test_torchrun_ranks_get_the_overrides_and_force_on_their_command_line():
    command = torchrun_command("c.toml", 2, True, ["train.max_steps=3", "train.output=s3://b/run"])
    assert command[command.index("train"):] == [
        "train", "--config", "c.toml", "--force", "--set", "train.max_steps=3", "--set", "train.output=s3://b/run",
    ]
    assert "--force" not in torchrun_command("c.toml", 2)


def test_tokenize_pins_a_set_value_and_takes_force_as_a_parameter(tmp_path):
    rows = [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(4)
    ]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    base = ["tokenize", str(data), "--tokenizer", str(TOKENIZER_DIR), "--held-out-fraction", "0"]
    result = CliRunner().invoke(app,
                                [*base, str(tmp_path / "out"), "--set", "tokenize.max_length=64", "--set",
                                 "tokenize.thinking=off"])
    assert result.exit_code == 0, result.output
    manifest, _ = read_manifest(open_store(tmp_path / "out"))
    assert (manifest.config["tokenize"]["max_length"], manifest.config["tokenize"]["thinking"]) == (64, "off")

    # Another host's writer holds the second output's lease: refused without --force, taken over with it, and nothing
    # of --force is left in this process's environment for a later command to inherit.
    now = time.time()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / LEASE_NAME).write_bytes(LeaseRecord("node-7:4242:abc", "node-7", 4242, "blockdraft tokenize", now,
                                                 now + 600).to_bytes())
    environment = dict(os.environ)
    refused = CliRunner().invoke(app, [*base, str(taken)])
    assert (
        refused.exit_code == 2
        and "error: " + f"{open_store(taken).url} is being written by pid 4242 on node-7" in refused.output
    )
    forced = CliRunner().invoke(app, [*base, str(taken), "--force"])
    assert forced.exit_code == 0, forced.output
    assert verify_artifact(open_store(taken)).state is State.VERIFIED
    assert dict(os.environ) == environment


@pytest.mark.slow
def test_train_set_max_steps_on_two_ranks_is_pinned_and_trained(tmp_path):
    """The acceptance check: `train --config C --set train.max_steps=3` on two gloo ranks trains 3 steps, not the file's
    12, and the checkpoint pins max_steps = 3."""
    rows = make_rows(6, prompt_len=6, new_tokens=40, seed=0)
    data = write_tokenized(tmp_path / "tokenized", rows[:4], rows[4:])
    cfg = config_file(tmp_path, data, max_steps=12, checkpoint_every=4, batch_size=1, drafters=["cpu", "cpu"])
    blockdraft = str(Path(sys.executable).with_name("blockdraft"))
    proc = subprocess.run([blockdraft, "train", "--config", str(cfg), "--set", "train.max_steps=3"], cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = verify_artifact(open_store(tmp_path / "ckpt").child(checkpoint_key(3)))
    assert final.state is State.VERIFIED and final.manifest.counts["ranks_in_sync"] == 2
    pinned = json.loads((tmp_path / "ckpt" / checkpoint_key(3) / "blockdraft-config.json").read_text())
    assert pinned["train"]["max_steps"] == 3 and final.manifest.config["train"]["max_steps"] == 3
    assert sorted(logged_losses(tmp_path / "logs")) == [1, 2, 3]
    assert not (tmp_path / "ckpt" / checkpoint_key(4)).exists()
    assert proc.stdout.splitlines().count(final.url) == 1


def test_deterministic_cuda_training_asks_for_the_cublas_setting_instead_of_writing_it(monkeypatch):
    """cuBLAS's workspace setting is read from the environment, never written there: `launch` puts it into the
    environment of the ranks it starts; a process started otherwise without it stops with one line before it joins any
    group."""
    import torch

    from blockdraft.stages.train.ranks import RankPlacement, rank_session

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    place = RankPlacement(0, 1, 0, torch.device("cuda:0"), torch.device("cuda:0"))
    with pytest.raises(ConfigError, match=r"^train.deterministic on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the "
                                          r"environment"):
        with rank_session(place, deterministic=True):
            pass
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.are_deterministic_algorithms_enabled()
