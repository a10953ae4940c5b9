"""The committed tiny target fixture: it loads like any HF target, its tokenizer is what the builder makes, its chat
template behaves like Qwen3's, a mask row exists, and its greedy outputs follow the corpus without looping."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockdraft.data.chat import Prompt
from blockdraft.decode.batch_generate import generate_completions
from blockdraft.fixtures.corpus import synthetic_conversations
from blockdraft.fixtures.tiny import (
    CI_SIZE,
    TINY_TARGET_DIR,
    TinySize,
    bpe_training_texts,
    build_tiny_target,
    build_tokenizer,
    distinct_ngram_ratio,
)

TINY = TINY_TARGET_DIR


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def built():
    return json.loads((TINY / "fixture.json").read_text())


def test_loads_as_a_qwen3_target_with_im_end_as_eos(target, built):
    model, tok = target
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == CI_SIZE.num_hidden_layers
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == tok.eos_token_id
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1, token
    # Like Qwen3: <think> survives skip_special_tokens, <|im_end|> does not.
    ids = tok("<think>\nx\n</think>\n\ny<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\ny"


def test_mask_row_exists_below_vocab_size_and_no_text_encodes_to_it(target, built):
    model, tok = target
    mask = built["mask_token_id"]
    assert mask == len(tok) < model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
    assert tok.convert_ids_to_tokens(mask) is None
    sample = "".join(
        json.loads(x)["messages"][-1]["content"] for x in (TINY / "completions.jsonl").read_text().splitlines()[:50]
    )
    assert max(tok(sample, add_special_tokens=False)["input_ids"]) < mask


def test_chat_template_thinking_on_and_off_like_qwen3(target):
    _, tok = target
    history = [
        {"role": "user", "content": "Count from 3 to 6."},
        {"role": "assistant", "content": "3, 4, 5, 6.", "reasoning_content": "I start at 3."},
        {"role": "user", "content": "What is 10 + 20?"},
    ]
    on = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    assert "I start at 3." not in on  # reasoning before the last user turn is dropped
    full = tok.apply_chat_template(history + [{"role": "assistant", "content": "30.", "reasoning_content": "Add."}],
                                   tokenize=False)
    assert full.startswith(on) and full.endswith("<think>\nAdd.\n</think>\n\n30.<|im_end|>\n")


def test_tokenizer_is_rebuilt_identically_from_the_corpus():
    texts = bpe_training_texts(synthetic_conversations(CI_SIZE.train_conversations, 0))
    rebuilt = build_tokenizer(texts, CI_SIZE.bpe_vocab_size).backend_tokenizer
    committed = json.loads((TINY / "tokenizer.json").read_text())
    assert json.loads(rebuilt.to_str())["model"] == committed["model"]


def test_greedy_outputs_follow_the_corpus_and_do_not_loop(target, built):
    model, tok = target
    rows = [json.loads(x) for x in (TINY / "prompts.jsonl").read_text().splitlines()[:24]]
    prompts = [Prompt(r["id"], r["messages"], r["enable_thinking"]) for r in rows]
    done = generate_completions(model, tok, prompts, max_new_tokens=160)
    ratios = [distinct_ngram_ratio(d.completion_token_ids) for d in done]
    assert sum(ratios) / len(ratios) >= 0.5 and built["distinct_4gram_ratio"] >= 0.5
    assert sum(d.finish_reason == "stop" for d in done) >= 0.9 * len(done)
    thinking = [d for p, d in zip(prompts, done) if p.enable_thinking]
    assert thinking and all(d.reasoning_content for d in thinking)  # the reasoning block is there and closed
    # The answers have the corpus's shapes (one of the task templates' phrasings).
    shapes = ("The reversed list is", "is spelled", "The largest is", "A ripe", " + ", ", ")
    assert sum(any(s in d.content for s in shapes) for d in done) >= 0.8 * len(done)


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert distinct_ngram_ratio([7] * 10) == 1 / 7
    assert distinct_ngram_ratio([1, 2]) == 1.0


@pytest.mark.slow
def test_build_tiny_target_by_time_budget_writes_a_loadable_target(tmp_path):
    size = TinySize(hidden_size=32, intermediate_size=64, num_hidden_layers=2, train_conversations=300, batch_size=8)
    report = build_tiny_target(tmp_path / "t", seconds_budget=3.0, seed=1, size=size, held_out_prompts=3, completions=2)
    assert report.steps >= 6  # fixed from the time of the first steps, then recorded
    recorded = json.loads((tmp_path / "t" / "fixture.json").read_text())
    assert recorded["steps"] == report.steps and recorded["mask_token_id"] == report.tokenizer_size
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(tmp_path / "t")
    assert model.config.num_hidden_layers == 2 and len(tok) == report.mask_token_id < model.config.vocab_size
    assert len((tmp_path / "t" / "prompts.jsonl").read_text().splitlines()) == 3
    assert len((tmp_path / "t" / "completions.jsonl").read_text().splitlines()) == 2
