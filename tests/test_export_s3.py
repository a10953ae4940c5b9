"""`export` from a checkpoint on S3 to S3 (a real SeaweedFS server on 127.0.0.1): pulled with checksums, pushed as an artifact."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import GOLDEN
from safetensors.torch import load_file

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
        dflash=DFlashConfig(block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5], num_draft_layers=3, gamma=3.0),
    )
    run = f"s3://{s3_bucket}/runs/r1"
    save_checkpoint(open_store(run, cfg.store), 5, drafter, {"step": 5}, cfg.resolved(), [], {"step": 5})

    out = f"s3://{s3_bucket}/exports/r1"
    result = export_stage.run(cfg, run, out)
    report = verify_artifact(open_store(out, cfg.store))
    assert report.state is State.VERIFIED and report.manifest.kind == EXPORT_KIND
    assert result.details.serving["vllm_speculative_config"]["model"] == out

    local = tmp_path / "pulled"
    pull(out, local, cfg.store)
    written, reference = load_file(str(local / "model.safetensors")), load_file(str(GOLDEN / "drafter" / "model.safetensors"))
    assert sorted(written) == sorted(reference) and all(torch.equal(written[n], t) for n, t in reference.items())
    assert json.loads((local / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert json.loads((local / SERVING_NAME).read_text()) == result.details.serving

    manifest = open_store(out, cfg.store).read_bytes(MANIFEST_NAME)
    again = export_stage.run(cfg, run, out)
    assert again.already_done and again.details == result.details
    assert open_store(out, cfg.store).read_bytes(MANIFEST_NAME) == manifest
