"""`train` end to end on CPU: a tokenized artifact, the golden tiny target, checkpoints as verified artifacts.

Every test goes through the stage's public seams: `run` (what the pipeline calls), the `blockdraft train` command
(in-process or as torchrun ranks), and the artifacts left at the destination.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import GOLDEN_TARGET
from helpers.reporters import ProgressLog
from helpers.train_data import assert_same_training, config_file, logged_losses, make_rows, write_tokenized
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.data.formats import TOKENIZED_KIND
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.model import load_target
from blockdraft.model.formats import CHECKPOINT_KIND, checkpoint_key, find_resumable
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run
from blockdraft.stages.train.data import load_train_rows
from blockdraft.stages.train.ranks import rank_placement
from blockdraft.store import open_store
from blockdraft.store.artifact import State, uncommit, verify_artifact
from blockdraft.store.inputs import open_input


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(6, prompt_len=6, new_tokens=40, seed=0)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:4], rows[4:])


@pytest.mark.slow
def test_learns_rows_keeps_frozen_copies_and_commits_checkpoints(tmp_path, data_url):
    cfg = load_config(config_file(tmp_path, data_url, max_steps=60, checkpoint_every=30, batch_size=4, lr=5e-3,
                                  # the default: each checkpoint decoded for real on two prompts
                                  decode_eval_prompts=2))
    reporter = ProgressLog()
    done = run(cfg, reporter=reporter)
    result = done.details
    losses = [e["loss"] for e in result.metrics]
    assert losses[-1] < 0.15 * losses[0]
    assert sum(losses[-5:]) < 0.2 * sum(losses[:5])
    last = result.metrics[-5:]
    assert sum(e["slot_accuracy"][0] for e in last) / 5 >= 0.85  # slot 1: the first draft token
    assert last[-1]["tau_estimate"] > 3.0  # of at most B = 4

    # The drafter-side embedding and LM head stayed bit-equal to the target's.
    target = load_target(str(GOLDEN_TARGET), "cpu", torch.float32)
    assert torch.equal(result.head.embed_weight, target.get_input_embeddings().weight)
    assert torch.equal(result.head.lm_head_weight, target.get_output_embeddings().weight)

    store = open_store(tmp_path / "ckpt")
    for step in (30, 60):
        report = verify_artifact(store.child(checkpoint_key(step)), check_inputs=True)
        assert report.state is State.VERIFIED, report.summary()
        assert report.manifest.kind == CHECKPOINT_KIND
        names = {f.path for f in report.manifest.files}
        assert {"config.json", "model.safetensors", "training-state.pt", "blockdraft-config.json",
                "metrics.jsonl"} <= names
        assert ("training-curves.png" in names) == (step == 60)  # drawn at the end (and every train.plot_every_minutes)
    exported = json.loads((tmp_path / "ckpt" / checkpoint_key(60) / "config.json").read_text())
    assert exported["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 5], "block_size": 4}
    pinned = json.loads((tmp_path / "ckpt" / checkpoint_key(60) / "blockdraft-config.json").read_text())
    assert pinned["dflash"]["gamma"] == 4.0 and pinned["dflash"]["target_layer_ids"] == [1, 5]
    assert (tmp_path / "logs" / "training-curves.png").stat().st_size > 1000

    # The stage's result is what the destination holds; the reporter heard every step and both checkpoints.
    final = store.child(checkpoint_key(60)).url
    assert (done.stage, done.url, done.report.state, done.already_done) == ("train", final, State.VERIFIED, False)
    assert (result.steps, result.resumed_from, result.checkpoint_url) == (60, None, final)
    assert [c[1] for c in reporter.calls] == list(range(61)) and {c[2] for c in reporter.calls} == {60}
    assert reporter.calls[-1][3] == {"loss": round(losses[-1], 4), "tau": round(last[-1]["tau_estimate"], 2),
                                     "held-out tau": round(result.signal["held_out_tau"], 2)}
    logged_at = f"metrics log: {tmp_path / 'logs' / 'metrics.jsonl'}"  # said before step 1
    assert reporter.lines[0] == logged_at
    pushed = [
        line.split(":")[0]
        for line in reporter.lines
        if line.startswith("checkpoint step") and " decoded on " not in line
    ]
    assert pushed == ["checkpoint step 30", "checkpoint step 60"]
    assert len([line for line in reporter.lines if line.startswith("checkpoint step") and " decoded on " in line]) == 2

    # A rerun finds every step in the newest verified checkpoint: nothing to do, the same checkpoint reported.
    again = run(cfg, reporter=(rerun := Reporter()))
    assert (again.already_done, again.url, again.details.resumed_from, again.details.metrics) == (True, final, 60, [])
    assert rerun.lines == [logged_at, f"resuming from verified checkpoint {final} (step 60)"]


BLOCKDRAFT = str(Path(sys.executable).with_name("blockdraft"))  # the installed console script


def _run(args: list[str], tmp: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run `args` (the blockdraft CLI when args[0] is "train", else a Python script) in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [BLOCKDRAFT, *args] if args[0] == "train" else [sys.executable, *args]
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.slow
def test_two_gloo_ranks_stay_in_sync_and_match_one_process(tmp_path, data_url):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    steps = 6
    run(load_config(config_file(one, data_url, max_steps=steps, batch_size=2)))
    # Two drafter devices -> `train` starts torchrun with two processes, one row per rank: the same global batch.
    cfg2 = config_file(two, data_url, max_steps=steps, batch_size=1, drafters=["cpu", "cpu"])
    proc = _run(["train", "--config", str(cfg2), "--nproc", "2"], two)

    store1, store2 = open_store(one / "ckpt"), open_store(two / "ckpt")
    final1 = verify_artifact(store1.child(checkpoint_key(steps)))
    final2 = verify_artifact(store2.child(checkpoint_key(steps)))
    assert final1.state is State.VERIFIED and final2.state is State.VERIFIED
    assert final2.manifest.counts["ranks_in_sync"] == 2  # both replicas' parameters were compared bit for bit
    assert proc.stdout.splitlines().count(final2.url) == 1  # rank 0 alone prints the final checkpoint
    assert_same_training(one, two, steps, rtol=1e-4, atol=2e-5)


KILLER = """
import os, signal, sys
from blockdraft.config import load_config
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run

class DieAfterCheckpoint(Reporter):
    # Checkpoints are pushed in the background: a checkpoint's line is said once it verified, before the next one
    # starts.
    def say(self, line):
        super().say(line)
        if line.startswith(f"checkpoint step {sys.argv[2]}:"):
            os.kill(os.getpid(), signal.SIGKILL)

run(load_config(sys.argv[1]), reporter=DieAfterCheckpoint())
"""


@pytest.mark.slow
@pytest.mark.fault
def test_kill_9_then_resume_from_last_verified_checkpoint_gives_the_uninterrupted_losses(tmp_path, data_url):
    steady, crashed = tmp_path / "steady", tmp_path / "crashed"
    steady.mkdir(), crashed.mkdir()
    settings = {"max_steps": 10, "checkpoint_every": 2, "batch_size": 1, "keep_checkpoints": 2}
    run(load_config(config_file(steady, data_url, **settings)))

    cfg = config_file(crashed, data_url, **settings)
    (crashed / "killer.py").write_text(KILLER)
    killed = _run(["killer.py", str(cfg), "6"], crashed, check=False)
    assert killed.returncode == -9
    ckpt = open_store(crashed / "ckpt")
    assert find_resumable(ckpt).step == 6
    assert not (crashed / "ckpt" / checkpoint_key(8)).exists()
    assert not list(ckpt.child(checkpoint_key(2)).list())  # keep_checkpoints = 2: only 4 and 6 remain
    # Step 6's push "did not verify": its weights differ from what the manifest lists. Resume must skip it.
    weights = crashed / "ckpt" / checkpoint_key(6) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert verify_artifact(ckpt.child(checkpoint_key(6))).state is State.CORRUPT

    reporter = Reporter()
    resumed = run(load_config(cfg), reporter=reporter)  # the rerun, as `blockdraft train --config` does it
    assert resumed.details.resumed_from == 4
    assert any(w.startswith("not resuming from step-00000006 (corrupt") for w in reporter.warnings), reporter.warnings
    assert f"resuming from verified checkpoint {ckpt.child(checkpoint_key(4)).url} (step 4)" in reporter.lines
    expected, got = logged_losses(steady / "logs"), logged_losses(crashed / "logs")
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(5, 11)] == [expected[s] for s in range(5, 11)]  # deterministic mode: bit-equal
    for step in (8, 10):
        assert verify_artifact(ckpt.child(checkpoint_key(step))).state is State.VERIFIED
    assert sorted(p.name for p in (crashed / "ckpt").iterdir() if any(p.iterdir())) == [checkpoint_key(8),
                                                                                        checkpoint_key(10)]


@pytest.mark.fault
def test_train_refuses_unverified_data_and_mismatched_nproc(tmp_path, data_url):
    broken = tmp_path / "broken"
    shutil.copytree(data_url, broken)
    uncommit(open_store(broken))
    with pytest.raises(ArtifactError, match="incomplete"):
        run(load_config(config_file(tmp_path, str(broken))))
    # A checkpoint of another run (here: another gamma) under train.output is refused, not silently continued.
    done = tmp_path / "done"
    done.mkdir()
    run(load_config(config_file(done, data_url, max_steps=2, checkpoint_every=2)))
    changed = config_file(done, data_url, max_steps=4, checkpoint_every=2)
    changed.write_text(changed.read_text().replace("gamma = 4.0", "gamma = 5.0"))
    with pytest.raises(ConfigError, match="another run .differs in dflash"):
        run(load_config(changed))
    # Training data must be a tokenize output, not any verified artifact.
    with pytest.raises(ArtifactError, match="'drafter-checkpoint' artifact, not 'tokenized'"):
        run(load_config(config_file(tmp_path, str(done / "ckpt" / checkpoint_key(2)))))
    with pytest.raises(ConfigError, match="train.data is not set"):
        run(BlockdraftConfig())

    result = CliRunner().invoke(app, ["train", "--config", str(config_file(tmp_path, data_url)), "--nproc", "2"])
    assert result.exit_code == 2
    assert "--nproc 2 but placement.drafter_devices lists 1" in result.output


def test_cli_prints_the_summary_and_the_final_checkpoint_then_nothing_to_train(tmp_path, data_url):
    cfg = config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2)
    final = open_store(tmp_path / "ckpt").child(checkpoint_key(2)).url
    first = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert first.exit_code == 0, first.output
    assert first.stdout.splitlines() == [final]
    assert "trained 2 steps; loss " in first.stderr and "checkpoint step 2: " in first.stderr
    again = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines() == [final]
    assert "nothing to train: the verified checkpoint already holds all 2 steps" in again.stderr.replace("\n", " ")


def test_input_and_output_arguments_override_the_config(tmp_path, data_url):
    cfg = load_config(config_file(tmp_path, "unused", max_steps=2, checkpoint_every=2))
    elsewhere = tmp_path / "elsewhere"
    done = run(cfg, data_url, str(elsewhere))
    assert done.url == open_store(elsewhere).child(checkpoint_key(2)).url and done.report.state is State.VERIFIED
    assert done.report.manifest.lineage[0].url == open_store(data_url).url
    pinned = json.loads((elsewhere / checkpoint_key(2) / "blockdraft-config.json").read_text())
    assert (pinned["train"]["data"], pinned["train"]["output"]) == (data_url, str(elsewhere))
    assert not (tmp_path / "ckpt").exists()


def test_trains_on_a_hybrid_attention_target(tmp_path, data_url):
    """Qwen3.5-style target (linear attention, full attention every fourth layer): training needs only its hidden
    states."""
    config = Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hybrid")
    cfg_path = config_file(tmp_path, data_url, max_steps=3, checkpoint_every=3)
    cfg_path.write_text(cfg_path.read_text().replace(f'path = "{GOLDEN_TARGET.as_posix()}"',
                                                     f'path = "{(tmp_path / "hybrid").as_posix()}"'))
    result = run(load_config(cfg_path)).details
    assert all(math.isfinite(e["loss"]) for e in result.metrics) and len(result.metrics) == 3
    pinned = json.loads((tmp_path / "ckpt" / checkpoint_key(3) / "blockdraft-config.json").read_text())
    assert pinned["dflash"]["target_layer_ids"] == [1, 9]  # the even spread, as for any target


def test_placement_two_target_and_two_drafter_devices_give_two_ranks(monkeypatch):
    """The rank-to-device mapping alone (`rank_placement`): `resolve_placement` also checks the devices exist here."""
    cfg = BlockdraftConfig.model_validate(
        {"placement": {"target_devices": ["cuda:0", "cuda:1"], "drafter_devices": ["cuda:2", "cuda:3"]}}
    )
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        place = rank_placement(cfg.placement)
        assert (str(place.target_device), str(place.drafter_device)) == (f"cuda:{rank}", f"cuda:{rank + 2}")
    # A second machine running the same lists: global rank 3 is local rank 1 there.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    place = rank_placement(cfg.placement)
    assert (place.rank, place.world_size, str(place.drafter_device), place.is_main) == (3, 4, "cuda:3", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="lists 2 device"):
        rank_placement(cfg.placement)


def test_train_rows_clip_to_max_length_and_need_no_held_out_rows(tmp_path):
    rows = [{"input_ids": list(range(10)), "loss_mask": [0, 0] + [1] * 8, "source_id": "a"}]
    (tmp_path / "tok").mkdir()
    url = write_tokenized(tmp_path / "tok", rows, [])
    loaded = load_train_rows(open_input(url, kinds=[TOKENIZED_KIND]), None, max_length=6, cache_dir=tmp_path / "cache")
    ids, mask = loaded.row(0)
    assert len(loaded) == 1 and ids.tolist() == list(range(6)) and mask.tolist() == [0, 0, 1, 1, 1, 1]
    assert loaded.lineage.sha256 == verify_artifact(open_store(url)).manifest_sha256


def test_init_from_starts_at_the_saved_weights_and_refuses_another_mask_id(tmp_path, data_url):
    """train.init_from a plain export-format folder (a sliding-window drafter): with lr 0 the trained checkpoint holds
    exactly the saved weights (a random start does not); a config whose mask id differs is refused, naming it."""
    from transformers import AutoConfig

    from blockdraft.config import DFlashConfig
    from blockdraft.model import DFlashDrafter, DrafterSpec

    dflash = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=2, gamma=4.0,
                          intermediate_size=96, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    torch.manual_seed(123)
    saved = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash))
    saved.save_pretrained(tmp_path / "published")
    sliding = 'intermediate_size = 96\nlayer_types = ["sliding_attention", "full_attention"]\nsliding_window = 8'

    def configured(folder: str, init: bool, mask: int = 511) -> Path:
        path = config_file(tmp_path / folder, data_url, max_steps=1, checkpoint_every=1, lr=0.0)
        text = path.read_text().replace("intermediate_size = 96", sliding).replace("mask_token_id = 511",
                                                                                   f"mask_token_id = {mask}")
        if init:
            text += f'init_from = "{(tmp_path / "published").as_posix()}"\n'
        path.write_text(text)
        return path

    (tmp_path / "warm").mkdir()
    (tmp_path / "cold").mkdir()
    (tmp_path / "wrong").mkdir()
    run(load_config(configured("warm", init=True)))
    start = load_file(tmp_path / "warm" / "ckpt" / checkpoint_key(1) / "model.safetensors")
    assert start.keys() == saved.state_dict().keys()
    assert all(torch.equal(start[name], tensor) for name, tensor in saved.state_dict().items())
    run(load_config(configured("cold", init=False)))
    cold = load_file(tmp_path / "cold" / "ckpt" / checkpoint_key(1) / "model.safetensors")
    assert not torch.equal(cold["fc.weight"], start["fc.weight"])  # control: without init_from the start is random
    with pytest.raises(ConfigError, match="has mask_token_id 511 but dflash.mask_token_id gives 510"):
        run(load_config(configured("wrong", init=True, mask=510)))
    # a verified artifact works too: the warm run's training output (its newest verified checkpoint)
    (tmp_path / "chained").mkdir()
    path = configured("chained", init=False)
    path.write_text(path.read_text() + f'init_from = "{(tmp_path / "warm" / "ckpt").as_posix()}"\n')
    run(load_config(path))
    chained = load_file(tmp_path / "chained" / "ckpt" / checkpoint_key(1) / "model.safetensors")
    assert all(torch.equal(chained[name], tensor) for name, tensor in start.items())
