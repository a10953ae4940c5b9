"""Tiny hybrid-attention targets built from config alone (no downloads), random fp32 weights, saved like real
checkpoints.

- `save_qwen3_5_composite(path)`: a `Qwen3_5ForConditionalGeneration` (tiny vision tower, interleaved M-RoPE) whose text
  model has 8 layers, Gated DeltaNet linear attention with full attention every 4th layer;
  `AutoModelForCausalLM.from_pretrained(path)` loads its text model alone as `Qwen3_5ForCausalLM` (the vision weights
  are skipped), as it does for Qwen3.5/Qwen3.6.
- `save_qwen3_next(path)`: a `Qwen3NextForCausalLM`, the same layer pattern, a tiny sparse MoE (4 experts, top 2, a
  shared expert) on most layers and a dense MLP on layer 0.

Both write a small byte-level BPE tokenizer (the one `blockdraft.fixtures.tiny` builds, 448 ids) with the real Qwen3.6
chat template (`chat_template.jinja`), so `AutoTokenizer.from_pretrained(path)` works; every token id is < `VOCAB_SIZE`
(512). Like a real checkpoint, eos (config and generation config) is `<|im_end|>` and pad is `<|endoftext|>`; a random
prompt emits eos about once in 512 greedy tokens. The vision placeholder ids sit at 508..511, above every id the
tokenizer makes.

The init std (`INIT_STD`) is larger than the library's 0.02 so that greedy decoding of random prompts does not collapse
into a one-token loop: speculative-decoding tests need varied acceptance lengths.
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.paths import TEMPLATES

VOCAB_SIZE = 512
HIDDEN = 64
INIT_STD = 0.15
CHAT_TEMPLATE = TEMPLATES / "trl_qwen3_6.jinja"
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 508, 509, 510, 511

# Interleaved M-RoPE like Qwen3.5's text config (rotary on a fraction of head_dim, sections over the rotary half):
# head_dim 16 * partial_rotary_factor 0.5 = 8 rotary dims = 4 frequencies, split 2/1/1 over (t, h, w).
ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def _text_fields(num_layers: int, tokenizer) -> dict:
    """Dimensions shared by both targets: hidden 64, 4 heads / 2 KV heads of 16, linear 2 key / 4 value heads of 16."""
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=2048,
        initializer_range=INIT_STD, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
    )


def _tokenizer():
    """The tiny byte-level BPE (trained on the synthetic corpus) with the Qwen3.6 chat template; eos = <|im_end|>."""
    from blockdraft.fixtures.corpus import synthetic_conversations
    from blockdraft.fixtures.tiny import CI_SIZE, bpe_training_texts, build_tokenizer

    tokenizer = build_tokenizer(bpe_training_texts(synthetic_conversations(400, 0)), CI_SIZE.bpe_vocab_size)
    assert len(tokenizer) < IMAGE_TOKEN_ID, "the tiny tokenizer must stay below the vision placeholder ids"
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    return tokenizer


def _save(path: Path, model, tokenizer) -> Path:
    """Weights, config, greedy generation config (eos = <|im_end|>) and tokenizer, as a real checkpoint folder has
    them."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=model.config.get_text_config().eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_qwen3_5_composite(path: str | Path, seed: int = 0) -> Path:
    """A random composite Qwen3.5 checkpoint (vision tower + 8-layer hybrid text model) in `path`; returns `path`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out = Path(path)
    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    text = dict(_text_fields(8, tokenizer), rope_parameters=dict(ROPE))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16, initializer_range=INIT_STD)
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID, tie_word_embeddings=False,
    )
    return _save(out, Qwen3_5ForConditionalGeneration(config).float().eval(), tokenizer)


def save_qwen3_next(path: str | Path, seed: int = 0) -> Path:
    """A random 8-layer Qwen3-Next checkpoint (hybrid attention, tiny MoE, layer 0 dense) in `path`; returns `path`."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(path)
    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = Qwen3NextConfig(
        **_text_fields(8, tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
    )
    return _save(out, Qwen3NextForCausalLM(config).float().eval(), tokenizer)
