"""Which keys a drafter layer's queries see, per layer kind (docs/DFLASH.md, "Attention pattern").

A full-attention layer sees what its base mask allows (inference: all cached context and the whole block, both ways).
A sliding-attention layer with window W is causal: a query at position q sees keys at positions k with q - W < k <= q,
context and block alike, which is what SGLang (`window_left` = W - 1, causal) and vLLM (per-layer window W, causal)
compute. A DFlash2 drafter's sliding layer is not causal (its config says `is_causal` false): the window bounds the keys
on both sides, |q - k| < W, so inside a block (W >= B) it sees every slot, as its full layers do.
Shapes: b = batch, Q = queries, K = keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


def sliding_window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int, causal: bool = True
) -> torch.Tensor:
    """[b, 1, Q, K] bool, True where q - window < k <= q (causal) or |q - k| < window (not), for positions [b, Q] and
    [b, K]."""
    q = query_positions[:, None, :, None]
    k = key_positions[:, None, None, :]
    upper = k <= q if causal else k < q + window
    return upper & (k > q - window)


def layer_masks(
    layer_types: Sequence[str],
    base_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    causal_sliding: bool = True,
) -> dict[str, torch.Tensor | None]:
    """One mask per distinct layer kind (not per layer): full = `base_mask` ([b, 1, Q, K] bool or None: see everything),
    sliding = `base_mask` AND the window over positions [b, Q] / [b, K] (causal unless `causal_sliding` is False)."""
    masks: dict[str, torch.Tensor | None] = {}
    for kind in set(layer_types):
        if kind == FULL_ATTENTION:
            masks[kind] = base_mask
        else:
            assert kind == SLIDING_ATTENTION and window is not None, (f"{kind} (window {window}) is refused by "
                                                                      "DrafterSpec")
            windowed = sliding_window_mask(query_positions, key_positions, window, causal_sliding)
            masks[kind] = windowed if base_mask is None else windowed & base_mask
    return masks


__all__ = ["FULL_ATTENTION", "LAYER_KINDS", "SLIDING_ATTENTION", "layer_masks", "sliding_window_mask"]
