"""DFlash2 export (docs/DFLASH.md, "DFlash2"): the format the engines and the reference load, and the reference
implementation (`dflash` 0.1.0, installed by `make setup` as a test oracle) as the judge of a blockdraft export: it
loads with no missing or unexpected keys, computes the same draft step and decodes the same tokens with the same
acceptance."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers.paths import GOLDEN2
from safetensors.torch import load_file
from test_dflash2_model import reference_counting
from transformers import AutoConfig

from blockdraft.decode.speculative import DFlashProposer, run_speculative
from blockdraft.model import DFlashDrafter, DraftCache, TargetHead, draft_step, load_target
from blockdraft.model.formats import EXPORT_KIND
from blockdraft.stages.export.stage import export_drafter
from blockdraft.store import open_store
from blockdraft.store.output import StageOutput, stage_key

reference = pytest.importorskip("dflash.model", reason="the reference implementation: `make setup` installs "
                                                       "dflash==0.1.0")


@pytest.fixture(scope="module")
def golden2():
    hf = load_target(str(GOLDEN2 / "target"), "cpu", torch.float32, attn_implementation="eager")
    return hf, DFlashDrafter.from_pretrained(GOLDEN2 / "drafter").eval(), TargetHead.from_target(hf)


def _export(drafter: DFlashDrafter, folder, dtype: str | None = None):
    out = StageOutput(open_store(folder), EXPORT_KIND, stage_key({"test": "in-memory DFlash2 drafter"}))
    return export_drafter(drafter, AutoConfig.from_pretrained(GOLDEN2 / "target"), out, location=str(folder),
                          dtype=dtype)


def _perturbed(drafter: DFlashDrafter) -> DFlashDrafter:
    """The golden drafter with every DFlash2 tensor moved, so what the reference computes from our export is ours."""
    other = DFlashDrafter(drafter.spec).eval()
    other.load_state_dict(drafter.state_dict())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.add_(0.3 * param.std() * torch.randn(param.shape, generator=g))
    return other


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_is_the_dflash2_format(tmp_path, golden2, dtype):
    _, drafter, _ = golden2
    _export(drafter, tmp_path / "out", dtype)
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(stored) == set(load_file(str(GOLDEN2 / "drafter" / "model.safetensors")))  # the reference's 51 names
    assert (
        "candidate_selector.predecessor_codebook" in stored and "layers.2.mlp_conv.kernel_projection.weight" in stored
    )
    assert {str(t.dtype) for t in stored.values()} == {f"torch.{dtype or 'float32'}"}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 3, 5], "block_size": 4,
                                       "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                                       "selector_top_k": 8}
    serving = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert (
        serving["vllm_speculative_config"]["method"] == "dflash"
        and serving["vllm_speculative_config"]["num_speculative_tokens"] == 3
    )
    assert "--speculative-algorithm DFLASH" in serving["sglang_command"]
    provenance = json.loads((tmp_path / "out" / "blockdraft-export.json").read_text())["dflash"]
    assert provenance["architecture"] == "dflash2" and provenance["selector_top_k"] == 8


def test_a_blockdraft_export_loads_in_the_reference_and_computes_the_same(tmp_path, golden2, monkeypatch):
    hf, golden_drafter, head = golden2
    ours = _perturbed(golden_drafter)
    _export(ours, tmp_path / "out")
    theirs, info = reference.DFlash2DraftModel.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()

    gold = load_file(str(GOLDEN2 / "golden.safetensors"))
    start = gold["context_ids"].shape[1]
    block = torch.tensor([[int(gold["anchor_id"][0]), 511, 511, 511]])
    ours_hidden = draft_step(ours, DraftCache(), gold["target_features"], head.embed(block), start)
    with torch.no_grad():
        their_hidden = theirs(
            target_hidden=gold["target_features"], noise_embedding=head.embed(block),
            position_ids=torch.arange(start + 4)[None]
        )
    torch.testing.assert_close(ours_hidden, their_hidden, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours_hidden, gold["draft_hidden"], atol=1e-3)  # the perturbation reached the forward

    # the reference times its stats with a CUDA synchronise; on the CPU its clock is the plain one
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    golden = json.loads((GOLDEN2 / "golden.json").read_text())
    accepted = []
    for case in golden["decode"][:3]:
        new = len(case["spec_output"]) - len(case["prompt"])
        mine = run_speculative(hf, DFlashProposer(ours, head), case["prompt"], new, [])
        stats = reference.dflash_generate(theirs, hf, torch.tensor([case["prompt"]]), new, None, return_stats=True)
        assert mine.tokens == stats.output_ids[0].tolist()
        assert reference_counting(mine.acceptance_lengths, new) == stats.acceptance_lengths
        accepted += stats.acceptance_lengths
    assert max(accepted) > 1  # the perturbed drafter still drafts tokens the target accepts
