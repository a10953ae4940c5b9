"""Which keys a drafter layer's queries see, per layer kind (docs/DFLASH.md, "Attention pattern").

A full-attention layer sees what its base mask allows (inference: all cached context and the whole block, both ways).
A sliding-attention layer with window W is causal: a query at position q sees keys at positions k with q - W < k <= q,
context and block alike, which is what SGLang (`window_left` = W - 1, causal) and vLLM (per-layer window W, causal)
compute. Shapes: b = batch, Q = queries, K = keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[b, 1, Q, K] bool, True where q - window < k <= q, for positions [b, Q] and [b, K]."""
    q = query_positions[:, None, :, None]
    k = key_positions[:, None, None, :]
    return (k <= q) & (k > q - window)


def layer_masks(
    layer_types: Sequence[str],
    base_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
) -> dict[str, torch.Tensor | None]:
    """One mask per distinct layer kind (not per layer): full = `base_mask` ([b, 1, Q, K] bool or None: see everything),
    sliding = `base_mask` AND the causal window over positions [b, Q] / [b, K]."""
    masks: dict[str, torch.Tensor | None] = {}
    for kind in set(layer_types):
        if kind == FULL_ATTENTION:
            masks[kind] = base_mask
        else:
            assert kind == SLIDING_ATTENTION and window is not None, f"{kind} (window {window}) is refused by DrafterSpec"
            windowed = sliding_window_mask(query_positions, key_positions, window)
            masks[kind] = windowed if base_mask is None else windowed & base_mask
    return masks


__all__ = ["FULL_ATTENTION", "LAYER_KINDS", "SLIDING_ATTENTION", "layer_masks", "sliding_window_mask"]
