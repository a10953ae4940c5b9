"""The committed tiny hybrid target: a composite Qwen3.5 checkpoint whose text model `AutoModelForCausalLM` loads (same
logits as the composite), a chat template that renders as Qwen3.6's does, a mask row, and greedy outputs that follow the
corpus without looping."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import TEMPLATES
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForConditionalGeneration

from blockdraft.data.chat import Prompt
from blockdraft.decode.batch_generate import generate_completions
from blockdraft.errors import ConfigError
from blockdraft.fixtures.corpus import synthetic_conversations
from blockdraft.fixtures.hybrid import (
    QWEN3_6_STYLE_TEMPLATE,
    TINY_HYBRID_TARGET_DIR,
    VISION_TOKEN_IDS,
    hybrid_layer_types,
)
from blockdraft.fixtures.tiny import CHAT_TEMPLATE, TINY_TARGET_DIR, TinySize, build_tiny_target, distinct_ngram_ratio

HYBRID = TINY_HYBRID_TARGET_DIR


@pytest.fixture(scope="module")
def target():
    return (AutoModelForCausalLM.from_pretrained(HYBRID, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(HYBRID))


@pytest.fixture(scope="module")
def built():
    return json.loads((HYBRID / "fixture.json").read_text())


def test_a_composite_qwen3_5_checkpoint_whose_text_model_auto_loads(target, built):
    config = AutoConfig.from_pretrained(HYBRID)
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"] and config.vision_config.depth == 1
    rope = config.text_config.rope_parameters
    assert rope["mrope_interleaved"] and rope["partial_rotary_factor"] == 0.25 and sum(rope["mrope_section"]) == 4
    model, tok = target
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and built["arch"] == "qwen3_5"
    assert model.config.layer_types == hybrid_layer_types(8) and model.config.layer_types[3] == "full_attention"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == tok.eos_token_id


def test_text_logits_equal_the_composite_models(target):
    model, tok = target
    composite = Qwen3_5ForConditionalGeneration.from_pretrained(HYBRID, dtype=torch.float32).eval()
    ids = torch.tensor(
        [tok("<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n<think>\n")["input_ids"]]
    )
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, composite(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_mask_row_and_vision_ids_lie_above_every_text_id(target, built):
    model, tok = target
    mask = built["mask_token_id"]
    assert mask == len(tok) < min(VISION_TOKEN_IDS.values()) <= max(VISION_TOKEN_IDS.values()) < model.config.vocab_size
    sample = "".join(
        json.loads(x)["messages"][-1]["content"] for x in (HYBRID / "completions.jsonl").read_text().splitlines()[:50]
    )
    assert max(tok(sample, add_special_tokens=False)["input_ids"]) < mask


def _conversations() -> list[list[dict]]:
    """Corpus conversations plus a three-turn one mixing thinking and not."""
    rows = [c["messages"] for c in synthetic_conversations(12, 5)]
    rows.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
                 {"role": "assistant", "content": "c-a-t.", "reasoning_content": "Three letters."},
                 {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
                 {"role": "user", "content": "Add 2 and 3."},
                 {"role": "assistant", "content": "5.", "reasoning_content": "2 + 3."}])
    return rows


def test_chat_template_renders_as_the_qwen3_6_template(target):
    _, tok = target
    assert tok.chat_template == QWEN3_6_STYLE_TEMPLATE
    real = (TEMPLATES / "trl_qwen3_6.jinja").read_text()
    for messages in _conversations():
        for k in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
            for thinking in (True, False):
                for history, gen in ((messages[:k], True), (messages[: k + 1], False)):
                    ours = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=gen,
                                                   enable_thinking=thinking)
                    theirs = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=gen,
                                                     enable_thinking=thinking, chat_template=real)
                    assert ours == theirs
    # Negative control: the Qwen3 tiny target's template renders otherwise (the model opens the think block itself).
    history = _conversations()[0][:-1]
    prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                   chat_template=CHAT_TEMPLATE) != prompt


def test_greedy_outputs_follow_the_corpus_and_end(target, built):
    model, tok = target
    rows = [json.loads(x) for x in (HYBRID / "prompts.jsonl").read_text().splitlines()[:16]]
    prompts = [Prompt(r["id"], r["messages"], r["enable_thinking"]) for r in rows]
    done = generate_completions(model, tok, prompts, max_new_tokens=160)
    ratios = [distinct_ngram_ratio(d.completion_token_ids or []) for d in done]
    assert sum(ratios) / len(ratios) >= 0.5 and built["distinct_4gram_ratio"] >= 0.5
    assert sum(d.finish_reason == "stop" for d in done) >= 0.9 * len(done) and built["completions_ended"] >= 0.9
    thinking = [d for p, d in zip(prompts, done) if p.enable_thinking]
    assert thinking and all(d.reasoning_content for d in thinking)
    shapes = ("The reversed list is", "is spelled", "The largest is", "A ripe", " + ", ", ")
    assert sum(any(s in d.content for s in shapes) for d in done) >= 0.8 * len(done)


def test_an_unknown_arch_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown tiny target arch 'mamba'"):
        build_tiny_target(tmp_path / "t", steps=1, arch="mamba")


@pytest.mark.slow
def test_build_a_small_hybrid_target_writes_a_loadable_composite(tmp_path):
    size = TinySize(hidden_size=64, intermediate_size=64, num_hidden_layers=4, train_conversations=200, batch_size=4)
    report = build_tiny_target(tmp_path / "t", steps=3, seed=1, size=size, held_out_prompts=2, completions=2,
                               arch="qwen3_5")
    assert report.arch == "qwen3_5" and json.loads((tmp_path / "t" / "fixture.json").read_text())["arch"] == "qwen3_5"
    assert AutoConfig.from_pretrained(tmp_path / "t").architectures == ["Qwen3_5ForConditionalGeneration"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.config.layer_types == hybrid_layer_types(4)


@pytest.mark.parametrize("folder", [HYBRID, TINY_TARGET_DIR], ids=["hybrid", "tiny"])
def test_committed_completions_are_the_targets_own_greedy_answers_as_users_load_it(folder):
    """completions.jsonl must be what the target, loaded with AutoTokenizer/AutoModelForCausalLM from its folder,
    answers: a drafter trained on anything else learns text the target never produces. (AutoTokenizer picks the
    tokenizer class from the model's config: for qwen3_5 it splits digits one by one, which a build must train and
    sample with.)"""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(x) for x in (folder / "completions.jsonl").read_text().splitlines()[:16]]
    prompts = [Prompt(r["id"], r["messages"][:-1], bool(r["messages"][-1].get("reasoning_content"))) for r in rows]
    done = generate_completions(model, tok, prompts, max_new_tokens=160)
    same = [d.content == r["messages"][-1]["content"] and d.reasoning_content == r["messages"][-1]["reasoning_content"]
            for d, r in zip(done, rows, strict=True)]
    assert sum(same) >= 0.75 * len(rows), same  # greedy near-ties may flip a few; a tokenizer mismatch flips most
