"""The drafter against the reference implementation's golden vectors, and the conventions docs/DFLASH.md pins."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import FIXTURES, GOLDEN
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from blockdraft.config import DFlashConfig
from blockdraft.errors import ConfigError, SpecError
from blockdraft.model import (
    DFlashDrafter,
    DraftCache,
    DrafterSpec,
    TargetHead,
    TargetModel,
    default_gamma,
    default_layer_ids,
    draft_step,
    load_target,
)

# fp32, but SDPA vs the reference's eager attention and a different summation order: ~1e-6 relative.
TOL = {"rtol": 1e-5, "atol": 5e-5}


@pytest.fixture(scope="module")
def golden():
    return load_file(str(GOLDEN / "golden.safetensors"))


@pytest.fixture(scope="module")
def target():
    return load_target(str(GOLDEN / "target"), attn_implementation="eager")


@pytest.fixture(scope="module")
def drafter():
    return DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()


def _block(golden, head, mask_id, size):
    ids = torch.tensor([[int(golden["anchor_id"].item())] + [mask_id] * (size - 1)])
    return head.embed(ids)


def test_golden_target_features(golden, target, drafter):
    features = TargetModel(target, drafter.spec.target_layer_ids).features(golden["context_ids"])
    # the golden features are ~40 in magnitude; 1e-4 absolute is ~2e-6 relative
    torch.testing.assert_close(features, golden["target_features"], rtol=1e-5, atol=1e-4)


def test_layer_id_means_hidden_states_i_plus_1(golden, target):
    ids = golden["context_ids"]
    states = target(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(states) == target.config.num_hidden_layers + 1
    for layer_id in (0, 3, target.config.num_hidden_layers - 2):
        features = TargetModel(target, [layer_id]).features(ids)
        assert torch.equal(features, states[layer_id + 1])
        assert not torch.allclose(features, states[layer_id])


def test_golden_forward_without_mask(golden, target, drafter):
    head = TargetHead.from_target(target)
    spec = drafter.spec
    block = _block(golden, head, spec.mask_token_id, spec.block_size)
    context = drafter.project_context(golden["target_features"])
    with torch.no_grad():
        hidden = drafter(block, context, torch.arange(11, 11 + spec.block_size)[None], torch.arange(11)[None])
        full = torch.ones(1, 1, spec.block_size, 11 + spec.block_size, dtype=torch.bool)
        masked = drafter(block, context, torch.arange(11, 11 + spec.block_size)[None], torch.arange(11)[None], full)
    torch.testing.assert_close(hidden, golden["draft_hidden"], **TOL)
    torch.testing.assert_close(head.logits(hidden[:, 1:]), golden["draft_logits"], **TOL)
    assert torch.equal(hidden, masked)


def test_golden_draft_step_with_cache(golden, target, drafter):
    head = TargetHead.from_target(target)
    spec = drafter.spec
    block = _block(golden, head, spec.mask_token_id, spec.block_size)
    cache = DraftCache()
    hidden = draft_step(drafter, cache, golden["target_features"], block, start=11)
    assert cache.length == 11
    torch.testing.assert_close(hidden, golden["draft_hidden"], **TOL)
    torch.testing.assert_close(head.logits(hidden[:, 1:]), golden["draft_logits"], **TOL)

    # The same context fed in two steps (as the decode loop does) gives the same block output.
    cache = DraftCache()
    draft_step(drafter, cache, golden["target_features"][:, :7], block, start=7)
    assert cache.length == 7
    again = draft_step(drafter, cache, golden["target_features"][:, 7:], block, start=11)
    torch.testing.assert_close(again, hidden, **TOL)
    with pytest.raises(ValueError, match="start"):
        draft_step(drafter, cache, golden["target_features"][:, :2], block, start=11)


def test_golden_end_to_end_from_token_ids(golden, target, drafter):
    """Features from the wrapper, embeddings from the frozen head, the cached draft step: the golden logits."""
    head = TargetHead.from_target(target)
    features = TargetModel(target, drafter.spec.target_layer_ids).features(golden["context_ids"])
    hidden = draft_step(drafter, DraftCache(), features, _block(golden, head, 511, 4), start=11)
    torch.testing.assert_close(head.logits(hidden[:, 1:]), golden["draft_logits"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("num_layers", "expected"),
    [
        (28, [1, 7, 13, 19, 25]),
        (36, [1, 9, 17, 25, 33]),
        (40, [1, 10, 19, 28, 37]),
        (48, [1, 12, 23, 34, 45]),
        (64, [1, 16, 31, 46, 61]),
        (94, [1, 24, 46, 68, 91]),  # 23.5 -> 24 and 68.5 -> 68: Python's half-to-even round
    ],
)
def test_default_layer_ids(num_layers, expected):
    assert default_layer_ids(num_layers, 5) == expected
    assert default_layer_ids(num_layers, 5) == [round(1 + i * (num_layers - 4) / 4) for i in range(5)]
    assert default_layer_ids(num_layers, 1) == [num_layers // 2]


def test_one_default_layer_id_is_a_valid_id_of_every_target_from_two_layers():
    # A 2-layer target (a tiny test model) reads layer 0: layer 1's output is what its own head reads.
    assert default_layer_ids(2, 1) == [0]
    assert all(0 <= default_layer_ids(n, 1)[0] <= n - 2 for n in range(2, 80))


def test_hybrid_targets_get_the_even_spread_too():
    # Qwen3.5/3.6-27B: 64 layers, full attention every fourth; z-lab's drafters for them read the even spread.
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
    config = Qwen3_5TextConfig(num_hidden_layers=64, layer_types=types, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    spec = DrafterSpec.from_target_config(config, DFlashConfig(architecture="dflash", mask_token_id=500))
    assert spec.target_layer_ids == default_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_gamma_defaults():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(SpecError, match="dflash.gamma"):
        default_gamma(4)


def test_spec_from_target_config_matches_golden(target, drafter):
    cfg = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                       num_draft_layers=3, gamma=3.0, intermediate_size=96)
    spec = DrafterSpec.from_target_config(target.config, cfg)
    golden = drafter.spec
    assert spec.to_export_config() == golden.to_export_config()
    assert spec.gamma == 3.0
    spec.check_target(target.config)
    defaulted = DrafterSpec.from_target_config(target.config,
                                               DFlashConfig(architecture="dflash", block_size=16, mask_token_id=511))
    assert defaulted.target_layer_ids == [1, 2, 3, 4, 5]  # 8 layers: spread over 1..5
    assert (defaulted.num_layers, defaulted.gamma, defaulted.intermediate_size) == (5, 7.0, 128)


def test_refusals_name_the_field(target, drafter):
    with pytest.raises(SpecError, match=r"mask_token_id 512 .*vocab_size 512"):
        DrafterSpec.from_target_config(target.config, DFlashConfig(architecture="dflash", mask_token_id=512))
    with pytest.raises(SpecError, match="dflash.mask_token_id is not set and this target"):
        DrafterSpec.from_target_config(target.config, DFlashConfig())
    with pytest.raises(SpecError, match=r"target_layer_ids \[7\] outside .* 0\.\.6"):
        DrafterSpec.from_target_config(target.config,
                                       DFlashConfig(architecture="dflash", mask_token_id=511, target_layer_ids=[1, 7]))
    with pytest.raises(SpecError, match=r"target layer ids \[8\]"):
        TargetModel(target, [8])

    other = DrafterSpec(**{**drafter.spec.to_dict(), "hidden_size": 128})
    with pytest.raises(SpecError, match="hidden_size 128 differs from the target's 64"):
        other.check_target(target.config)
    bigger_vocab = DrafterSpec(**{**drafter.spec.to_dict(), "vocab_size": 1024, "mask_token_id": 700})
    with pytest.raises(SpecError, match=r"mask_token_id 700 >= the target's embedding rows 512"):
        bigger_vocab.check_target(target.config)
    deeper = DrafterSpec(**{**drafter.spec.to_dict(), "num_target_layers": 40, "target_layer_ids": [1, 20, 37]})
    with pytest.raises(SpecError, match=r"target_layer_ids \[20, 37\] outside .* 0\.\.6"):
        deeper.check_target(target.config)


@pytest.mark.parametrize(("ids", "why"), [([5, 1, 3], "5 before 1"), ([3, 3], "3 repeated")])
def test_unsorted_or_repeated_layer_ids_are_refused_wherever_they_enter(target, drafter, ids, why):
    """The engines feed `fc` the target's layers in layer order, once each: a spec, a drafter config.json and the
    target's feature reader all refuse other ids with one line naming target_layer_ids."""
    message = rf"target_layer_ids \[{ids[0]}, .*\] must be strictly ascending and unique \({why}\)"
    with pytest.raises(SpecError, match=message) as refused:
        DrafterSpec(**{**drafter.spec.to_dict(), "target_layer_ids": ids})
    assert "\n" not in str(refused.value) and "dflash.target_layer_ids" in str(refused.value)
    config = drafter.spec.to_export_config()
    with pytest.raises(SpecError, match="drafter config.json dflash_config." + message):
        DrafterSpec.from_export_config({**config,
                                        "dflash_config": {**config["dflash_config"], "target_layer_ids": ids}})
    with pytest.raises(SpecError, match=message):
        TargetModel(target, ids)
    ordered = DrafterSpec(**{**drafter.spec.to_dict(), "target_layer_ids": sorted(set(ids))})
    assert ordered.target_layer_ids == sorted(set(ids))


def test_target_head_frozen_bit_equal_copies(golden, target, drafter):
    head = TargetHead.from_target(target)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert torch.equal(head.embed_weight, embed) and torch.equal(head.lm_head_weight, lm_head)
    assert head.embed_weight.data_ptr() != embed.data_ptr()  # a copy, not a view of the target's storage
    assert not head.embed_weight.requires_grad and not head.lm_head_weight.requires_grad
    assert list(head.parameters()) == []  # nothing for an optimizer or DDP to pick up

    train_drafter = DFlashDrafter(drafter.spec)
    train_drafter.load_state_dict(drafter.state_dict())
    optimizer = torch.optim.AdamW(train_drafter.parameters(), lr=1e-2)
    block = _block(golden, head, 511, 4)
    for _ in range(3):
        hidden = train_drafter(block, train_drafter.project_context(golden["target_features"]),
                               torch.arange(11, 15)[None], torch.arange(11)[None])
        loss = torch.nn.functional.cross_entropy(head.logits(hidden[0, 1:]), golden["context_ids"][0, :3])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not torch.equal(train_drafter.fc.weight, drafter.fc.weight)
    assert torch.equal(head.embed_weight, embed) and torch.equal(head.lm_head_weight, lm_head)


def test_state_dict_is_the_export_tensor_set(drafter):
    names = set(drafter.state_dict())
    assert len(names) == 11 * drafter.spec.num_layers + 3
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_target_features_stop_after_deepest_layer(golden, target):
    wrapper = TargetModel(target, [1, 3])
    ran = []
    handles = [layer.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, layer in enumerate(wrapper.layers)]
    handles.append(target.get_output_embeddings().register_forward_hook(lambda *_: ran.append("lm_head")))
    try:
        features = wrapper.features(golden["context_ids"])
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [0, 1, 2, 3]  # layers 4..7 and the LM head are skipped
    states = target(input_ids=golden["context_ids"], output_hidden_states=True).hidden_states
    assert torch.equal(features, torch.cat([states[2], states[4]], dim=-1))  # in layer order, as the engines read them
    assert not features.requires_grad


def test_hybrid_attention_target_features():
    """Qwen3.5-style target (linear-attention layers, full attention every fourth): hidden states only, same
    convention."""
    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = DrafterSpec.from_target_config(
        model.config, DFlashConfig(architecture="dflash", mask_token_id=255, num_draft_layers=2, block_size=8))
    assert spec.target_layer_ids == [1, 9]  # the even spread: layer 1 is linear attention, 9 is not
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    features = TargetModel(model, spec.target_layer_ids).features(ids)
    assert torch.equal(features, torch.cat([states[2], states[10]], dim=-1))


def test_bf16_drafter_with_packed_mask(drafter, golden):
    """bf16 weights and a bool mask that hides part of the context: finite, bf16 out, and the hidden keys do not
    matter."""
    model = DFlashDrafter(drafter.spec)
    model.load_state_dict(drafter.state_dict())
    model = model.to(torch.bfloat16)
    block = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    features = golden["target_features"].to(torch.bfloat16)
    mask = torch.ones(1, 1, 4, 15, dtype=torch.bool)
    mask[..., 5:11] = False  # context positions 5..10 hidden
    changed = features.clone()
    changed[:, 5:] += 1.0
    with torch.no_grad():
        out = model(block, model.project_context(features), torch.arange(11, 15)[None], torch.arange(11)[None], mask)
        same = model(block, model.project_context(changed), torch.arange(11, 15)[None], torch.arange(11)[None], mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out, same)


def test_from_export_config_refuses_what_is_not_a_dflash_export():
    config = DrafterSpec.from_export_config(
        json.loads((GOLDEN / "drafter" / "config.json").read_text())
    ).to_export_config()
    with pytest.raises(SpecError, match="lacks dflash_config.mask_token_id"):
        DrafterSpec.from_export_config({**config, "dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(SpecError, match="lacks num_target_layers"):
        DrafterSpec.from_export_config({k: v for k, v in config.items() if k != "num_target_layers"})
    with pytest.raises(SpecError, match="sliding_window is None"):  # sliding layers without a window
        DrafterSpec.from_export_config({**config, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(SpecError, match="unknown kind 'chunked_attention'"):
        DrafterSpec.from_export_config({**config, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(SpecError, match="is_causal False"):  # a non-causal sliding drafter (vLLM's override)
        DrafterSpec.from_export_config({**config, "layer_types": ["sliding_attention"] * 3, "sliding_window": 8,
                                        "is_causal": False})
    with pytest.raises(SpecError, match="use_swa"):
        DrafterSpec.from_export_config({**config, "dflash_config": {**config["dflash_config"], "use_swa": True}})
    with pytest.raises(SpecError, match="use_sliding_window without layer_types"):
        DrafterSpec.from_export_config(
            {k: v for k, v in config.items() if k != "layer_types"} | {"use_sliding_window": True}
        )
    with pytest.raises(SpecError, match="rope_type 'yarn' without original_max_position_embeddings"):
        DrafterSpec.from_export_config({**config,
                                        "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(SpecError, match="rope_type 'dynamic'"):
        DrafterSpec.from_export_config({**config,
                                        "rope_parameters": {"rope_theta": 1e6, "rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(SpecError, match="rope_type 'linear'"):
        DrafterSpec.from_export_config({**config, "rope_scaling": {"type": "linear", "factor": 2.0}})
    # transformers 4 configs carry only rope_theta; transformers 5 only rope_parameters: both read the same
    old_style = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    new_style = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")} | {
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    assert (
        DrafterSpec.from_export_config(old_style).rope_theta
        == DrafterSpec.from_export_config(new_style).rope_theta
        == 5e5
    )


def test_yarn_rope_equals_transformers_qwen3_rotary_embedding():
    """YaRN cos/sin (inverse frequencies and attention factor) are transformers' own, at short and long positions."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from blockdraft.model.rope import rope_cos_sin, rope_tables

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 32.0,
               "beta_slow": 1.0}
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=8192,
                         rope_parameters={"rope_theta": 1e6, **scaling})
    positions = torch.tensor([[0, 1, 7, 2047, 2048, 8000]])
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, 6, 16), positions)
    inv_freq, factor = rope_tables(16, 1e6, scaling, 8192)
    ours = rope_cos_sin(positions, inv_freq, factor, torch.float32)
    assert factor > 1.0  # YaRN's attention scaling is applied
    torch.testing.assert_close(ours[0], cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[1], sin, atol=1e-6, rtol=0)
    default_inv, default_factor = rope_tables(16, 1e6, None, 8192)
    assert default_factor == 1.0 and not torch.allclose(default_inv, inv_freq)  # control: YaRN changes the frequencies


def test_yarn_drafter_differs_from_default_rope_with_the_same_weights(drafter, golden):
    import dataclasses

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    yarn = DFlashDrafter(dataclasses.replace(drafter.spec, rope_scaling=scaling)).eval()
    yarn.load_state_dict(drafter.state_dict())
    block = torch.randn(1, 4, drafter.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    ours = draft_step(yarn, DraftCache(), golden["target_features"], block, start=11)
    plain = draft_step(drafter, DraftCache(), golden["target_features"], block, start=11)
    assert yarn.spec.rope_type == "yarn" and (ours - plain).abs().max() > 1e-4


def test_target_mrope_never_reaches_the_drafter():
    """A Qwen3.5-style target with M-RoPE: the drafter takes its rope_theta and default RoPE, not the M-RoPE section."""
    target = Qwen3_5TextConfig(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        intermediate_size=96, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                               "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    )
    spec = DrafterSpec.from_target_config(target, DFlashConfig(architecture="dflash", block_size=16, mask_token_id=500))
    exported = spec.to_export_config()
    assert spec.rope_theta == 5e6 and spec.rope_scaling is None
    assert (
        exported["rope_parameters"] == {"rope_theta": 5e6, "rope_type": "default"} and exported["rope_scaling"] is None
    )


def test_load_target_reads_straight_to_its_device_in_the_asked_dtype(tmp_path):
    """`load_target` reads through `device_map` (no CPU copy moved afterwards): the same weights and features as a plain
    load, every parameter and buffer on the device, in the dtype asked for, frozen."""
    plain = AutoModelForCausalLM.from_pretrained(str(GOLDEN / "target"), dtype=torch.float32).eval()
    loaded = load_target(str(GOLDEN / "target"), "cpu", torch.float32)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    plain_state = plain.state_dict()
    assert all(torch.equal(t, plain_state[name]) for name, t in loaded.state_dict().items())
    ids = torch.arange(1, 40)[None]
    assert torch.equal(TargetModel(loaded, [1, 3]).features(ids), TargetModel(plain, [1, 3]).features(ids))
    half = load_target(str(GOLDEN / "target"), "cpu", "bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {t.device.type for t in [*half.parameters(), *half.buffers()]} == {"cpu"}


def test_the_mask_id_defaults_to_the_known_reserved_id_of_qwen3_and_qwen35_else_one_line_says_how_to_choose(target):
    from transformers import AutoConfig

    from blockdraft.added_tokens import known_mask_token_id, local_text_config, tokenizer_added_tokens
    from blockdraft.data.tokenizer import check_mask_token

    qwen3 = AutoConfig.from_pretrained(FIXTURES / "qwen3-tokenizer")  # Qwen3's config.json (vocab 151936), no weights
    assert DrafterSpec.from_target_config(qwen3, DFlashConfig()).mask_token_id == 151669
    assert 151669 not in tokenizer_added_tokens(FIXTURES / "qwen3-tokenizer")  # a row no text encodes to
    assert known_mask_token_id(local_text_config(str(FIXTURES / "qwen3.6-27b"))) == 248070
    assert DrafterSpec.from_target_config(  # the config wins
        qwen3, DFlashConfig(architecture="dflash", mask_token_id=151670)).mask_token_id == 151670
    with pytest.raises(SpecError) as unknown:  # the tiny target: a Qwen3 shape with its own 512-row vocabulary
        DrafterSpec.from_target_config(target.config, DFlashConfig())
    assert "has no known reserved id; set dflash.mask_token_id to an id the tokenized rows never hold" in str(
        unknown.value
    )
    tokenizer_json = json.dumps({"added_tokens": [{"id": 151669, "content": "<|mine|>"}]})
    with pytest.raises(ConfigError, match=r"151669 is the tokenizer's added token <\|mine\|>"):
        # what tokenize checks the default with
        check_mask_token(known_mask_token_id(local_text_config(str(FIXTURES / "qwen3-tokenizer"))), tokenizer_json)


def test_a_moe_target_without_a_dense_mlp_width_gives_the_drafter_its_routed_experts_width():
    """Qwen3.5-MoE configs name no intermediate_size: the drafter's MLP is num_experts_per_tok x moe_intermediate_size
    wide, as Qwen3-MoE configs name theirs (Qwen3-235B-A22B: 8 x 1536 = its intermediate_size 12288)."""
    from types import SimpleNamespace

    from blockdraft.model.spec import mlp_width
    from blockdraft.model.target import load_target_config

    dflash = DFlashConfig(mask_token_id=248077)
    moe = DrafterSpec.from_target_config(load_target_config(str(FIXTURES / "qwen3.5-122b-a10b")), dflash)
    assert moe.intermediate_size == 8 * 1024
    named = load_target_config(str(FIXTURES / "qwen3-235b-a22b"))
    assert DrafterSpec.from_target_config(named, DFlashConfig(mask_token_id=151669)).intermediate_size == 12288
    assert named.moe_intermediate_size * named.num_experts_per_tok == named.intermediate_size
    with pytest.raises(SpecError, match="set dflash.intermediate_size"):  # a config naming neither
        mlp_width(SimpleNamespace(hidden_size=64, moe_intermediate_size=None))
