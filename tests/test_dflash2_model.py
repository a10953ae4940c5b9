"""DFlash2 (docs/DFLASH.md, "DFlash2"): its config, its modules in the one drafter forward, and parity with the
reference implementation's golden vectors (one draft step, six greedy decodes), fp32 on CPU.

Negative controls run beside the checks they back: a decode that ignores the selector, and a convolution whose taps
cross a block boundary, must not reproduce what the reference computes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.decode import speculative_generate
from helpers.paths import GOLDEN, GOLDEN2
from safetensors.torch import load_file

from blockdraft.config import DFlashConfig, load_config
from blockdraft.decode.speculative import DFlashProposer, run_speculative
from blockdraft.errors import ConfigError, SpecError
from blockdraft.model import DFlashDrafter, DraftCache, DrafterSpec, TargetHead, TargetModel, draft_step, load_target
from blockdraft.model.dflash2 import GroupedDynamicCausalConv, greedy_walk, unary_logits
from blockdraft.model.spec import DFlash2Spec
from blockdraft.model.weight_init import init_drafter
from blockdraft.stages.train.data import anchor_generator, build_block_batch
from blockdraft.stages.train.step import DraftForward


@pytest.fixture(scope="module")
def golden2():
    hf = load_target(str(GOLDEN2 / "target"), "cpu", torch.float32, attn_implementation="eager")
    drafter = DFlashDrafter.from_pretrained(GOLDEN2 / "drafter").eval()
    return hf, drafter, TargetHead.from_target(hf)


def _draft_slots(drafter, head, gold):
    block = torch.tensor([[int(gold["anchor_id"][0])] + [drafter.spec.mask_token_id] * (drafter.spec.block_size - 1)])
    hidden = draft_step(drafter, DraftCache(), gold["target_features"], head.embed(block),
                        start=gold["context_ids"].shape[1])
    return block, hidden


# --- item 1: config ---------------------------------------------------------------------------------------------------


def test_dflash2_is_the_default_with_the_published_drafters_settings():
    two = DFlashConfig()
    assert two.architecture == "dflash2"  # docs/PERFORMANCE.md, "DFlash2 against DFlash"
    assert (two.conv_kernel_size, two.conv_group_size, two.selector_rank, two.selector_top_k) == (2, 16, 256, 16)
    assert (two.input_embedding_scale, two.output_multiplier, two.final_logit_softcapping) == (1.0, 1.0, None)
    # a resolved config (every default written out) loads again, DFlash's too: the checkpoint's pinned config
    for cfg in (two, DFlashConfig(architecture="dflash")):
        assert DFlashConfig.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize("sets,named", [
    (["dflash.architecture=dflash", "dflash.selector_top_k=8"], "dflash.selector_top_k is a DFlash2 setting"),
    (["dflash.architecture=dflash2", "dflash.block_size=4", "dflash.conv_kernel_size=5"],
     "dflash.conv_kernel_size 5 is more taps"),
])
def test_config_refuses_dflash2_settings_that_cannot_hold_in_one_line(sets, named):
    with pytest.raises(ConfigError, match=named) as info:
        load_config(None, sets=sets)
    assert "\n" not in str(info.value)


def test_spec_refuses_a_group_that_does_not_divide_the_hidden_size_and_a_top_k_over_the_vocabulary(golden2):
    _, drafter, _ = golden2
    for change, named in (({"conv_group_size": 24}, "dflash.conv_group_size 24 does not divide the hidden size 64"),
                          ({"selector_top_k": 513}, "dflash.selector_top_k 513 must be 1..the vocabulary 512")):
        with pytest.raises(SpecError, match=named):
            dataclasses.replace(drafter.spec, dflash2=dataclasses.replace(drafter.spec.dflash2, **change))


def test_export_config_round_trips_the_dflash2_fields(golden2):
    _, drafter, _ = golden2
    spec = dataclasses.replace(
        drafter.spec,
        dflash2=dataclasses.replace(drafter.spec.dflash2, input_embedding_scale=2.0, final_logit_softcapping=30.0)
    )
    config = spec.to_export_config()
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert (
        config["dflash_config"]["input_embedding_scale"] == 2.0 and "output_multiplier" not in config["dflash_config"]
    )
    assert DrafterSpec.from_export_config(config).dflash2 == spec.dflash2
    plain = drafter.spec.to_export_config()
    assert {"input_embedding_scale", "output_multiplier", "final_logit_softcapping"}.isdisjoint(plain["dflash_config"])
    with pytest.raises(SpecError, match="architectures says DFlashDraftModel"):
        DrafterSpec.from_export_config({**config, "architectures": ["DFlashDraftModel"]})


# --- item 2: the model ------------------------------------------------------------------------------------------------


def test_draft_step_reproduces_the_reference_hidden_unary_logits_top_k_and_walk(golden2):
    _, drafter, head = golden2
    gold = load_file(str(GOLDEN2 / "golden.safetensors"))
    block, hidden = _draft_slots(drafter, head, gold)
    torch.testing.assert_close(hidden, gold["draft_hidden"], atol=1e-5, rtol=1e-5)
    unary = unary_logits(head.logits(hidden[:, 1:]), drafter.spec.dflash2)
    torch.testing.assert_close(unary, gold["unary_logits"], atol=1e-5, rtol=1e-5)
    walk = greedy_walk(drafter.candidate_selector, hidden[:, 1:], unary, block[:, 0])
    assert [set(c.tolist()) for c in walk.candidates[0]] == [set(c.tolist()) for c in gold["candidates"][0]]
    assert walk.path.tolist() == gold["selector_path"].tolist()
    assert walk.unary_argmax.tolist() == gold["unary_argmax"].tolist()
    assert walk.path.tolist() != walk.unary_argmax.tolist()  # the selector changes this block: the check sees it


def test_training_forward_of_many_blocks_equals_the_draft_step_and_taps_stay_inside_each_block(golden2):
    """Several blocks back to back in one training forward give each block's cached draft step; the same forward with
    taps allowed across block boundaries (the negative control) does not."""
    hf, drafter, head = golden2
    spec = drafter.spec
    target = TargetModel(hf, spec.target_layer_ids)
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(1))
    batch = build_block_batch([(ids, torch.ones(40, dtype=torch.long))], num_anchors=6, block_size=spec.block_size,
                              mask_token_id=spec.mask_token_id, gamma=3.0, generators=[anchor_generator(0, 0, 0)])
    features = target.features(batch.input_ids)

    def training_hidden(model):
        with torch.no_grad():
            return DraftForward(model)(features, head.embed(batch.block_ids), batch.block_positions,
                                       batch.context_positions, batch.attention_mask)

    trained = training_hidden(drafter)
    b = spec.block_size
    for n, p in enumerate(batch.anchors[0].tolist()):
        block = torch.tensor([[int(ids[p])] + [spec.mask_token_id] * (b - 1)])
        step = draft_step(drafter, DraftCache(), features[:, :p], head.embed(block), start=p)
        torch.testing.assert_close(trained[0, n * b : (n + 1) * b], step[0], atol=2e-5, rtol=1e-5)

    crossing = DFlashDrafter(spec).eval()
    crossing.load_state_dict(drafter.state_dict())
    for conv in crossing.modules():
        if isinstance(conv, GroupedDynamicCausalConv):
            conv.block_size = batch.block_ids.shape[1]  # one block over all slots: taps reach into the block before
    assert not torch.allclose(training_hidden(crossing), trained, atol=1e-3)


def test_identity_initialised_dflash2_computes_exactly_the_dflash_drafter():
    """A DFlash2 drafter built from a DFlash drafter's weights (convolutions at identity) gives the DFlash forward,
    under either train.init; its selector then walks from its own initialisation."""
    dflash = DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()
    spec2 = dataclasses.replace(dflash.spec, dflash2=DFlash2Spec(selector_rank=16, selector_top_k=8))
    gold = load_file(str(GOLDEN / "golden.safetensors"))
    hf = load_target(str(GOLDEN / "target"), "cpu", torch.float32, attn_implementation="eager")
    head = TargetHead.from_target(hf)
    _, expected = _draft_slots(dflash, head, gold)
    for init in ("pytorch", "hf_normal"):
        two = DFlashDrafter(spec2)
        init_drafter(two, init, hf.config)
        missing, unexpected = two.load_state_dict(dflash.state_dict(), strict=False)
        assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
        _, hidden = _draft_slots(two.eval(), head, gold)
        torch.testing.assert_close(hidden, expected, atol=1e-6, rtol=0)
        assert two.candidate_selector is not None and two.candidate_selector.predecessor_codebook.std() < 0.05


def test_non_identity_convolution_changes_the_forward(golden2):
    """The converse of the identity check: the golden drafter's convolutions matter (so the checks above can fail)."""
    _, drafter, head = golden2
    gold = load_file(str(GOLDEN2 / "golden.safetensors"))
    plain = DFlashDrafter(drafter.spec).eval()
    plain.load_state_dict(drafter.state_dict())
    for conv in plain.modules():
        if isinstance(conv, GroupedDynamicCausalConv):
            conv.reset_to_identity()
    assert not torch.allclose(_draft_slots(plain, head, gold)[1], gold["draft_hidden"], atol=1e-3)


# --- item 6: decode parity --------------------------------------------------------------------------------------------


def reference_counting(lengths: list[int], new_tokens: int) -> list[int]:
    """Our acceptance lengths as the reference 0.1.0 counts them at the end of the budget: its prefill token is the
    first new token, it stops once the anchor is the last token needed (we run one more cycle there) and counts a last
    cycle only up to the budget. Every cycle before is compared as it is."""
    counted, left = [], new_tokens - 1
    for length in lengths:
        if left <= 0:
            break
        counted.append(min(length, left))
        left -= counted[-1]
    return counted


def test_decode_reproduces_every_golden_decode_and_ignoring_the_selector_does_not(golden2):
    hf, drafter, head = golden2
    golden = json.loads((GOLDEN2 / "golden.json").read_text())
    unary_lengths, walk_lengths = [], []
    for case in golden["decode"]:
        new = len(case["spec_output"]) - len(case["prompt"])
        result = speculative_generate(hf, drafter, head, case["prompt"], new, [])
        assert result.tokens == case["spec_output"] == case["greedy_output"]
        assert reference_counting(result.acceptance_lengths, new) == case["acceptance_lengths"]
        walk_lengths.append(result.acceptance_lengths)
        unary = run_speculative(hf, DFlashProposer(drafter, head, use_selector=False), case["prompt"], new, [])
        assert unary.tokens == case["greedy_output"]  # lossless either way
        unary_lengths.append(unary.acceptance_lengths)
    assert unary_lengths != walk_lengths  # a decode that ignores the selector gives other acceptance lengths
