"""Block-sparse training attention with FlexAttention: each query tile visits only the key tiles its blocks may see.

The dense training mask ([b, 1, Q, S+Q], `block_attention_mask` in stages/train/data.py) is the reference; this module
builds the same pattern straight from the anchors, never materialising it. In the packed training batch the S context
entries sit at positions 0..S-1 and slot k of block n at position anchors[n] + k, so every query sees exactly two
intervals of key indices: its context prefix [ctx_lo, ctx_hi) and a span of its own block [own_lo, own_hi).
The `BlockMask` lists, per 128 x 128 tile, whether it is skipped, partly allowed (the mask is applied) or fully allowed.
FlexAttention has no backward on the CPU, so training there uses the dense path (`resolve_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from blockdraft.errors import ConfigError

AttentionChoice = Literal["auto", "dense", "flex"]
TILE = 128  # FlexAttention's default sparse block size, queries and keys alike

# False: torch's eager FlexAttention, which materialises every score (a reference for tests; no fused kernel).
COMPILE_FLEX = True


def resolve_attention(choice: AttentionChoice, device: torch.device) -> Literal["dense", "flex"]:
    """The training attention for `train.attention` on the drafter's device: auto = flex on CUDA, dense elsewhere."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if choice == "flex" and device.type != "cuda":
        raise ConfigError(f"train.attention = 'flex' needs a CUDA drafter device, not {device} (FlexAttention has no "
                          "backward there); set train.attention to 'auto' or 'dense'")
    return choice


@dataclass(frozen=True)
class AnchorLayout:
    """Where the packed training batch's blocks sit: anchors [b, N] long, keep [b, N] bool (False: a padded block, which
    sees its own block only), S = context_len, B = block_size. Q = N*B queries; keys are the S context entries, then Q
    slots."""

    anchors: torch.Tensor
    keep: torch.Tensor
    context_len: int
    block_size: int

    def key_intervals(
        self, sliding_window: int | None, causal: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query, the key indices it sees: ctx_lo, ctx_hi [b, Q] and own_lo, own_hi [Q] (half-open intervals).

        Full attention: context keys below the anchor (none for a padded block) and all of its own block. A sliding
        layer with window W also needs q - W < key position <= q: context from a + k - W + 1 on, and its own slots up to
        k; a non-causal one (DFlash2) sees all of its own block (W >= B)."""
        b, n = self.anchors.shape
        s, size = self.context_len, self.block_size
        query = torch.arange(n * size, device=self.anchors.device)  # [Q]
        block, slot = query // size, query % size
        anchor = self.anchors[:, block]  # [b, Q]
        ctx_hi = torch.where(self.keep[:, block], anchor, 0)
        if sliding_window is None:
            return torch.zeros_like(ctx_hi), ctx_hi, s + block * size, s + (block + 1) * size
        ctx_lo = anchor + slot - sliding_window + 1
        if not causal:
            return ctx_lo, ctx_hi, s + block * size, s + (block + 1) * size
        return ctx_lo, ctx_hi, s + torch.maximum(block * size, query - sliding_window + 1), s + query + 1

    def block_mask(self, sliding_window: int | None = None, causal: bool = True) -> BlockMask:
        """The FlexAttention `BlockMask` of this layout (sliding_window None: a full-attention layer), on the anchors'
        device."""
        ctx_lo, ctx_hi, own_lo, own_hi = self.key_intervals(sliding_window, causal)
        b, q = ctx_hi.shape
        kv = self.context_len + q

        def mask_mod(batch, head, q_idx, kv_idx):
            in_context = (kv_idx >= ctx_lo[batch, q_idx]) & (kv_idx < ctx_hi[batch, q_idx])
            return in_context | ((kv_idx >= own_lo[q_idx]) & (kv_idx < own_hi[q_idx]))

        visit, full = _tiles(ctx_lo, ctx_hi, own_lo.expand(b, q), own_hi.expand(b, q), kv)
        partial = visit & ~full
        return BlockMask.from_kv_blocks(
            *_ordered(partial), *_ordered(full), BLOCK_SIZE=(TILE, TILE), mask_mod=mask_mod, seq_lengths=(q, kv)
        )


def _tiles(ctx_lo, ctx_hi, own_lo, own_hi, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(visit, full) [b, Q tiles, KV tiles] bool from the per-query intervals [b, Q]: visit = some query of the tile
    sees some key of it, full = every query of the tile sees every key of it. Query rows past Q count as seeing nothing,
    and a key tile is full only over its whole width, so ragged edges are never skipped unmasked."""
    b, q = ctx_hi.shape
    starts = torch.arange(0, kv_len, TILE, device=ctx_hi.device)  # [KV tiles]
    ends = starts + TILE
    visit = torch.zeros(b, q, starts.numel(), dtype=torch.bool, device=ctx_hi.device)
    full = torch.zeros_like(visit)
    for lo, hi in ((ctx_lo, ctx_hi), (own_lo, own_hi)):
        lo, hi = lo[..., None], hi[..., None]
        visit |= (lo < ends.clamp(max=kv_len)) & (hi > starts) & (lo < hi)
        full |= (lo <= starts) & (hi >= ends)
    pad = -q % TILE
    visit = torch.nn.functional.pad(visit, (0, 0, 0, pad), value=False).unflatten(1, (-1, TILE))
    full = torch.nn.functional.pad(full, (0, 0, 0, pad), value=False).unflatten(1, (-1, TILE))
    return visit.any(2), full.all(2)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, Q tiles, KV tiles] bool -> (count [b, 1, Q tiles], indices [b, 1, Q tiles, KV tiles]) int32, the listed
    key tiles first in ascending order, as `BlockMask.from_kv_blocks` takes them (one head: every head shares the
    mask)."""
    count = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None], indices[:, None]


@functools.cache
def _compiled_flex():
    # dynamic: a new context length or block count (every batch) reuses the kernel instead of compiling one per shape
    return torch.compile(flex_attention, dynamic=True)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q [b, h, Q, d], k/v [b, g, S+Q, d] (g divides h: grouped heads are read in place, never repeated) -> [b, h, Q,
    d].

    Under autocast q/k may be fp32 (RMSNorm's weight) while v is in the autocast dtype: all run in v's dtype, as SDPA's
    autocast cast would."""
    q, k = q.to(v.dtype), k.to(v.dtype)
    kernel = _compiled_flex() if COMPILE_FLEX else flex_attention
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=True)  # pyright: ignore[reportReturnType]


__all__ = ["COMPILE_FLEX", "TILE", "AnchorLayout", "AttentionChoice", "resolve_attention", "sparse_attention"]
