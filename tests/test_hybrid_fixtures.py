"""The tiny hybrid targets of `helpers.hybrid`: they load like Qwen3.5/Qwen3.6 and Qwen3-Next checkpoints, the
composite's text model is what `AutoModelForCausalLM` loads (same weights, same logits), and greedy decoding of random
prompts is varied."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.hybrid import VOCAB_SIZE, save_qwen3_5_composite, save_qwen3_next
from helpers.paths import TEMPLATES
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForConditionalGeneration

PATTERN = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


@pytest.fixture(scope="module")
def composite_dir(tmp_path_factory):
    return save_qwen3_5_composite(tmp_path_factory.mktemp("hybrid") / "qwen3_5")


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return save_qwen3_next(tmp_path_factory.mktemp("hybrid") / "qwen3_next")


def _ids(seed: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_composite_checkpoint_is_multimodal_with_m_rope(composite_dir):
    config = AutoConfig.from_pretrained(composite_dir)
    assert config.model_type == "qwen3_5" and config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert config.vision_config.depth == 1 and config.vision_config.out_hidden_size == config.text_config.hidden_size
    rope = config.text_config.rope_parameters
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) * 2 == int(16 * rope["partial_rotary_factor"])
    assert config.text_config.layer_types == PATTERN


def test_auto_causal_lm_loads_the_composite_text_model_with_its_weights_and_logits(composite_dir):
    text = AutoModelForCausalLM.from_pretrained(composite_dir).eval()
    composite = Qwen3_5ForConditionalGeneration.from_pretrained(composite_dir).eval()
    assert type(text).__name__ == "Qwen3_5ForCausalLM" and text.dtype == torch.float32
    assert text.config.layer_types == PATTERN
    assert not any("visual" in name for name in text.state_dict())
    mine = composite.model.language_model.state_dict()
    for name, weight in text.model.state_dict().items():
        assert torch.equal(weight, mine[name]), name
    assert torch.equal(text.lm_head.weight, composite.lm_head.weight)
    ids = _ids(1)
    with torch.no_grad():
        expected = composite(input_ids=ids).logits
        torch.testing.assert_close(text(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        # Negative control: another seed's target gives other logits, so the comparison above can fail.
        other = save_qwen3_5_composite(composite_dir.parent / "other", seed=1)
        assert (AutoModelForCausalLM.from_pretrained(other)(input_ids=ids).logits - expected).abs().max() > 1e-2


def test_qwen3_next_is_hybrid_with_a_tiny_moe(next_dir):
    model = AutoModelForCausalLM.from_pretrained(next_dir).eval()
    assert type(model).__name__ == "Qwen3NextForCausalLM" and model.config.layer_types == PATTERN
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds[0] == "Qwen3NextMLP" and set(kinds[1:]) == {"Qwen3NextSparseMoeBlock"}
    assert [hasattr(layer, "linear_attn") for layer in model.model.layers] == [t == "linear_attention" for t in PATTERN]


@pytest.mark.parametrize("which", ["composite", "next"])
def test_checkpoints_carry_the_qwen3_6_chat_template_and_a_tokenizer_below_the_vocab(which, composite_dir, next_dir):
    folder = composite_dir if which == "composite" else next_dir
    tok = AutoTokenizer.from_pretrained(folder)
    assert (folder / "chat_template.jinja").read_text() == (TEMPLATES / "trl_qwen3_6.jinja").read_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 3 to 6."}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    model = AutoModelForCausalLM.from_pretrained(folder)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == model.config.eos_token_id
    assert max(tok(prompt)["input_ids"]) < len(tok) < VOCAB_SIZE == model.config.vocab_size


@pytest.mark.parametrize("which", ["composite", "next"])
def test_greedy_decoding_of_random_prompts_is_varied(which, composite_dir, next_dir):
    model: Any = AutoModelForCausalLM.from_pretrained(composite_dir if which == "composite" else next_dir).eval()
    ids = _ids(2, batch=3, length=16)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 16:]
    assert out.shape[1] == 40
    for row in out.tolist():
        assert len(set(row)) >= 10, row
