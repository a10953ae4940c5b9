"""Bit rot under a checksum cache that vouches for the old bytes: every consumer of a checkpoint (export, pull, eval,
train's resume) checksums the bytes it reads and refuses with one line naming the file; only a listing trusts the cache,
and says so."""

from __future__ import annotations

import os
import time

import pytest
from helpers.artifacts import rot_under_cache
from helpers.paths import GOLDEN
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
from blockdraft.errors import ArtifactError
from blockdraft.model import DFlashDrafter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store

GOLDEN_DFLASH = {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5], "num_draft_layers": 3}


@pytest.fixture
def rotten_checkpoint(tmp_path):
    """A committed checkpoint of the golden drafter whose model.safetensors rotted after the cache read it."""
    cfg = BlockdraftConfig(target=TargetConfig(path=str(GOLDEN / "target")),
                           dflash=DFlashConfig(architecture="dflash", **GOLDEN_DFLASH))
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    ckpt = tmp_path / "run" / "step-00000010"
    save_checkpoint(open_store(ckpt.parent), 10, drafter, {"step": 10}, cfg.resolved(), [], {"step": 10})
    then = time.time() - 60
    for path in ckpt.iterdir():
        os.utime(path, (then, then))
    rot_under_cache(ckpt / "model.safetensors", offset=4000)
    return ckpt


def _one_line_naming_the_weights(result) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert "model.safetensors" in result.output and "crc64nvme" in result.output


def test_a_listing_trusts_the_cache_and_says_so(rotten_checkpoint):
    listed = CliRunner().invoke(app, ["verify", str(rotten_checkpoint)])
    assert listed.exit_code == 0 and "checksums cached for unchanged files" in " ".join(listed.output.split())
    deep = CliRunner().invoke(app, ["verify", str(rotten_checkpoint), "--deep"])
    assert deep.exit_code != 0 and "model.safetensors" in deep.output


def test_export_refuses_the_rotten_weights(rotten_checkpoint, tmp_path):
    _one_line_naming_the_weights(CliRunner().invoke(app, ["export", str(rotten_checkpoint), str(tmp_path / "export")]))
    assert not (tmp_path / "export" / "model.safetensors").exists()


def test_pull_refuses_the_rotten_weights(rotten_checkpoint, tmp_path):
    _one_line_naming_the_weights(
        CliRunner().invoke(app, ["pull", f"file://{rotten_checkpoint}", str(tmp_path / "pulled")]))
    assert not (tmp_path / "pulled" / "model.safetensors").exists()


def test_eval_refuses_the_rotten_weights(rotten_checkpoint, tmp_path):
    cfg = BlockdraftConfig(target=TargetConfig(path=str(GOLDEN / "target")),
                           dflash=DFlashConfig(architecture="dflash", **GOLDEN_DFLASH))
    with pytest.raises(ArtifactError, match=r"model\.safetensors: crc64nvme"):
        eval_stage.run(cfg, str(rotten_checkpoint), str(tmp_path / "eval"))


def test_a_resumed_run_refuses_the_rotten_weights(tmp_path):
    rows = make_rows(3, prompt_len=5, new_tokens=16, seed=3)
    data = write_tokenized(tmp_path / "tokenized", rows[:2], rows[2:])
    config = config_file(tmp_path, data, max_steps=2, checkpoint_every=2, batch_size=1)
    assert CliRunner().invoke(app, ["train", "--config", str(config)]).exit_code == 0
    ckpt = tmp_path / "ckpt" / "step-00000002"
    then = time.time() - 60
    for path in ckpt.iterdir():
        os.utime(path, (then, then))
    rot_under_cache(ckpt / "model.safetensors", offset=4000)
    rotten = (ckpt / "model.safetensors").read_bytes()

    resumed = CliRunner().invoke(app, ["train", "--config", str(config)])
    errors = [line for line in resumed.output.splitlines() if "error:" in line]
    assert resumed.exit_code == 2 and len(errors) == 1 and "Traceback" not in resumed.output, resumed.output
    assert "step-00000002" in errors[0] and "model.safetensors: crc64nvme" in errors[0]
    assert (ckpt / "model.safetensors").read_bytes() == rotten  # nothing overwritten
