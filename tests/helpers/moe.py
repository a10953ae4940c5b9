"""A tiny random Qwen3-MoE target (6 layers, 4 experts with 2 a token) with the tiny target's vocabulary, tokenizer and
chat template: the mixture-of-experts case of a target split over devices or served by vLLM (whose CPU attention takes
this head dim, 32)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from blockdraft.fixtures.tiny import TINY_TARGET_DIR


def build_moe_target(folder: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, eos_token_id=445,
                            pad_token_id=443, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY_TARGET_DIR / name, folder / name)
    return folder
