"""A Llama-family target, as SmolLM2 is (tied embeddings, a vocabulary whose every row is a token, ChatML without a
thinking mode): a small random Llama target with the real SmolLM2 tokenizer goes through generate, tokenize, train,
eval and export; the export loads in the reference implementation (`dflash` 0.1.0) and computes our draft step, and
vLLM's CPU build serves it beside the target with our acceptance, position by position."""

from __future__ import annotations

import json
import shutil
from itertools import islice

import pytest
import torch
from helpers.engine import ENGINE_PYTHON, needs_engine, write_config
from helpers.paths import FIXTURES
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.fixtures.smollm2 import MASK_TOKEN_ID
from blockdraft.model import DFlashDrafter, DraftCache, TargetHead, draft_step, load_target
from blockdraft.pipeline import REAL_PROMPTS_DIR
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export, generate, tokenize, train
from blockdraft.stages.eval.report import EvalReport

SMOLLM2_TOKENIZER = FIXTURES / "smollm2-tokenizer"
MASK = MASK_TOKEN_ID  # SmolLM2's: its last id, an ordinary token; tokenize and train check the data never holds it
STEPS = 80


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    """A random 4-layer Llama target (hidden 128, 4 heads, 2 KV heads) with SmolLM2's vocabulary, tied embeddings and
    its tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama-target")
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2_TOKENIZER / name, folder / name)
    return folder


def _sections(tmp, target) -> dict:
    return {
        "target": {"path": str(target)},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.0},
        # vLLM's CPU build serves DFlash drafters only
        "dflash": {"architecture": "dflash", "block_size": 8, "mask_token_id": MASK, "num_draft_layers": 1,
                   "num_anchors": 16},
        "generate": {"engine": "hf", "max_new_tokens": 48, "batch_size": 32},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / "run"), "log_dir": str(tmp / "logs"),
                  "max_steps": STEPS, "batch_size": 4, "global_batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05,
                  "checkpoint_every": STEPS, "seed": 0, "decode_eval_prompts": 0},
        "eval": {"num_prompts": 6, "max_new_tokens": 32, "prompts": str(REAL_PROMPTS_DIR / "held-out.jsonl"),
                 "engine_python": str(ENGINE_PYTHON)},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_target):
    """The target's greedy answers to 32 of the shipped real prompts, tokenized with its ChatML template, and a DFlash
    drafter trained on them: (folder, config)."""
    tmp = tmp_path_factory.mktemp("llama-run")
    cfg = load_config(None, _sections(tmp, llama_target))
    prompts = tmp / "prompts.jsonl"
    with open(REAL_PROMPTS_DIR / "train.jsonl") as src:
        prompts.write_text("".join(islice(src, 32)))
    generate.run(cfg, str(prompts), str(tmp / "store" / "completions"))
    tokenize.run(cfg, str(tmp / "store" / "completions"), str(tmp / "tokenized"))
    train.run(cfg)
    return tmp, cfg


@pytest.mark.slow
def test_a_llama_target_trains_evaluates_and_exports(trained, llama_target):
    tmp, cfg = trained
    report = eval_stage.run(cfg, str(tmp / "run"), str(tmp / "eval")).details
    assert report.lossless.ok and report.num_prompts == 6
    # the drafter learned the target: it beats the untrained drafter and n-gram lookup on unseen prompts
    taus = {name: round(d.tau, 3) for name, d in report.drafters.items()}
    assert taus["dflash"] > max(taus["untrained"], taus["ngram"], 1.5), taus
    export.run(cfg, str(tmp / "run"), str(tmp / "export"))
    config = json.loads((tmp / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["vocab_size"] == 49152
    assert config["dflash_config"]["mask_token_id"] == MASK and config["tie_word_embeddings"] is False


@pytest.mark.slow
def test_the_export_loads_in_the_reference_and_computes_our_draft_step(trained, llama_target):
    reference = pytest.importorskip("dflash.model", reason="the reference implementation: `make setup` installs "
                                                           "dflash==0.1.0")
    tmp, cfg = trained
    out = tmp / "export-reference"
    export.run(cfg, str(tmp / "run"), str(out))
    theirs, info = reference.DFlashDraftModel.from_pretrained(out, output_loading_info=True,
                                                              attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = DFlashDrafter.from_pretrained(out).eval()
    head = TargetHead.from_target(load_target(str(llama_target), "cpu", torch.float32, attn_implementation="eager"))
    g = torch.Generator().manual_seed(3)
    layers = len(json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"])
    features = torch.randn(1, 20, layers * 128, generator=g)
    block = torch.tensor([[42] + [MASK] * 7])
    mine = draft_step(ours, DraftCache(), features, head.embed(block), 20)
    with torch.no_grad():
        their = theirs.eval()(target_hidden=features, noise_embedding=head.embed(block),
                              position_ids=torch.arange(28)[None])
    torch.testing.assert_close(mine, their, atol=1e-5, rtol=1e-5)


@needs_engine
@pytest.mark.slow
@pytest.mark.engine
def test_vllm_serves_the_export_with_our_acceptance(trained):
    tmp, cfg = trained
    sections = _sections(tmp, cfg.target.path)
    sections["eval"]["untrained_baseline"] = False  # the engine is compared with the trained drafter's decode only
    config = write_config(tmp, sections, "engine.toml")
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(tmp / "run"), "--engine",
                                      "vllm", "--output", str(tmp / "eval-engine")])
    assert result.exit_code == 0, result.output
    engine = EvalReport.from_json((tmp / "eval-engine" / "report.json").read_text()).engine
    assert engine is not None and engine.rule == "exact" and engine.disagreement is None
    assert engine.outputs_equal_target_only == engine.num_prompts == 6  # lossless in the engine
    assert engine.drafts == engine.ours_cycles > 0
    assert engine.accepted_per_position == engine.ours_accepted_per_position
    assert engine.accepted_per_position[1] > 0, "no draft accepted past the first position: the check would cover one"
