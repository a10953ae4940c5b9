"""Rotary position embedding of the drafter: default RoPE, or YaRN as transformers computes it (docs/DFLASH.md, "RoPE").

A drafter's RoPE is its own (its `rope_theta` and optional `rope_scaling`), never the target's multimodal M-RoPE. For a
scaled type the inverse frequencies and the attention factor come from transformers' `ROPE_INIT_FUNCTIONS`, the
reference SGLang and vLLM follow; the factor multiplies cos and sin, as transformers' rotary embedding does.
Shapes: b = batch, n = positions, d = head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from blockdraft.errors import SpecError

DEFAULT_ROPE = "default"
ROPE_TYPES = (DEFAULT_ROPE, "yarn")
# M-RoPE fields a multimodal target carries; they never describe a (text-only) drafter's RoPE.
MROPE_FIELDS = ("mrope_section", "mrope_interleaved")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The rope type a `rope_scaling` / `rope_parameters` dict names ("default" when it names none)."""
    scaling = scaling or {}
    return str(scaling.get("rope_type") or scaling.get("type") or DEFAULT_ROPE)


def clean_scaling(scaling: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """The scaling fields of a rope dict (no rope_theta, no M-RoPE, no legacy `type`), or None for default RoPE.

    Raises SpecError naming a rope type blockdraft does not compute (`where` says which config it came from)."""
    kind = rope_type_of(scaling)
    if kind not in ROPE_TYPES:
        raise SpecError(
            f"{where} uses rope_type '{kind}'; blockdraft drafters compute {', '.join(ROPE_TYPES)} only, so loading it "
            "would silently change its positions"
        )
    if kind == DEFAULT_ROPE:
        return None
    assert scaling is not None
    skip = {"rope_theta", "type", *MROPE_FIELDS}
    fields = {key: value for key, value in scaling.items() if key not in skip}
    fields["rope_type"] = kind
    if float(fields.get("partial_rotary_factor", 1.0)) != 1.0:
        raise SpecError(f"{where} rotates part of each head (partial_rotary_factor); blockdraft drafters rotate whole "
                        "heads")
    missing = [key for key in ("factor", "original_max_position_embeddings") if fields.get(key) is None]
    if missing:
        raise SpecError(f"{where} has rope_type '{kind}' without {missing[0]}; add it (YaRN needs factor and the "
                        "original length)")
    return fields


def rope_tables(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2] fp32, attention_factor) for default RoPE (`scaling` None) or a scaled type.

    Default RoPE is computed here (1 / theta^(2i/d)); a scaled type through transformers' ROPE_INIT_FUNCTIONS on a
    Qwen3 config holding exactly these fields."""
    if scaling is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(
        head_dim=head_dim,
        hidden_size=head_dim,
        num_attention_heads=1,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    return inv_freq.float(), float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, n, d] for absolute positions [b, n], computed in fp32 and scaled by `attention_factor`."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, n, d] by cos/sin [b, n, d] (rotate-half convention of Qwen3/Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


__all__ = ["DEFAULT_ROPE", "ROPE_TYPES", "apply_rope", "clean_scaling", "rope_cos_sin", "rope_tables", "rope_type_of"]
