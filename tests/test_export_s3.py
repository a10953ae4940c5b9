"""`export` from a checkpoint on S3 to S3 (a real SeaweedFS server on 127.0.0.1): pulled with checksums, pushed as an
artifact; the serving settings name a local folder that `blockdraft pull` fills first, never the s3:// URL."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import GOLDEN
from safetensors.torch import load_file
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
from blockdraft.model import DFlashDrafter
from blockdraft.model.formats import EXPORT_KIND
from blockdraft.stages import export as export_stage
from blockdraft.stages.export import SERVING_NAME
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.transfer import pull

pytestmark = pytest.mark.s3


def test_export_s3_checkpoint_to_s3(s3_bucket, tmp_path):
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(GOLDEN / "target")),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                            num_draft_layers=3, gamma=3.0),
    )
    run = f"s3://{s3_bucket}/runs/r1"
    save_checkpoint(open_store(run, cfg.store), 5, drafter, {"step": 5}, cfg.resolved(), [], {"step": 5})

    out = f"s3://{s3_bucket}/exports/r1"
    result = export_stage.run(cfg, run, out)
    report = verify_artifact(open_store(out, cfg.store))
    assert report.state is State.VERIFIED and report.manifest.kind == EXPORT_KIND
    serving = result.details.serving
    assert serving["export_url"] == out and serving["drafter_dir"] == "./r1"
    assert serving["pull_command"] == f"blockdraft pull {out} ./r1"
    assert (
        serving["vllm_speculative_config"]["model"] == "./r1"
        and "--speculative-draft-model-path ./r1 " in serving["sglang_command"]
    )

    local = tmp_path / "pulled"
    pull(out, local, cfg.store)
    written, reference = (
        load_file(str(local / "model.safetensors")),
        load_file(str(GOLDEN / "drafter" / "model.safetensors")),
    )
    assert sorted(written) == sorted(reference) and all(torch.equal(written[n], t) for n, t in reference.items())
    assert json.loads((local / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert json.loads((local / SERVING_NAME).read_text()) == result.details.serving

    manifest = open_store(out, cfg.store).read_bytes(MANIFEST_NAME)
    again = export_stage.run(cfg, run, out)
    assert again.already_done and again.details == result.details
    assert open_store(out, cfg.store).read_bytes(MANIFEST_NAME) == manifest


def test_export_cli_to_s3_prints_the_pull_step_and_a_local_folder(s3_bucket, tmp_path):
    """What the user copies: the pull step first, then commands whose model paths are that folder, no URL in them."""
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(GOLDEN / "target")),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                            num_draft_layers=3, gamma=3.0),
    )
    run = f"s3://{s3_bucket}/runs/r2"
    save_checkpoint(open_store(run, cfg.store), 5, drafter, {"step": 5}, cfg.resolved(), [], {"step": 5})
    out = f"s3://{s3_bucket}/exports/qwen-drafter"
    printed = CliRunner().invoke(app, ["export", run, out])
    assert printed.exit_code == 0, printed.output
    lines = [line for line in printed.stdout.splitlines() if line.startswith(("Pull:", "SGLang:", "vLLM:"))]
    assert [line.split(":")[0] for line in lines] == ["Pull", "SGLang", "vLLM"]
    assert lines[0] == f"Pull:   blockdraft pull {out} ./qwen-drafter"
    assert "--speculative-draft-model-path ./qwen-drafter " in lines[1] and "--dtype float32" in lines[1]
    assert '"model": "./qwen-drafter"' in lines[2]
    assert not any("s3://" in line or "file://" in line for line in lines[1:])

    # the printed step works: pulled, the folder is the drafter the commands name
    local = tmp_path / "qwen-drafter"
    pull(out, local, cfg.store)
    assert DFlashDrafter.from_pretrained(local).spec == drafter.spec
