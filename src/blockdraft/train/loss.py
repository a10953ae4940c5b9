"""The DFlash loss: LM head + cross-entropy in chunks of blocks, normalised over the global batch.

Loss = sum(w * CE) / sum(w) over every rank's rows. DDP averages gradients over ranks, so each rank returns
(its own sum(w * CE)) / (global sum(w)) * world_size; the averaged gradient then equals one process on the
global batch, and so does gradient clipping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class SlotStats:
    """Per-slot counts for slots 1..B-1: `correct` and `total` [B-1] float (supervised slots only), summable across ranks."""

    correct: torch.Tensor
    total: torch.Tensor

    def accuracy(self) -> list[float]:
        return (self.correct / self.total.clamp_min(1)).tolist()


@dataclass
class LossOutput:
    """loss: the scalar to backpropagate; weighted_ce: this rank's sum(w * CE) (detached); weight_sum: global sum(w)."""

    loss: torch.Tensor
    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    slots: SlotStats


def _chunk_ce(hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]):
    logits = lm_head(hidden).float()  # [rows, V]
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(dim=-1) == labels).float()
    return (weights * ce).sum(), correct


def global_weight_sum(weights: torch.Tensor) -> torch.Tensor:
    """sum(w) over every rank (a detached scalar): the loss's denominator."""
    total = weights.detach().float().sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total


def block_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    block_size: int,
    chunk_blocks: int,
) -> LossOutput:
    """Weighted CE of the drafter's block outputs, globally normalised.

    hidden [b, Q, H] (after the drafter's final norm), labels [b, Q] long, weights [b, Q] float, Q = N*B.
    The [chunk_blocks*B, V] logits of one chunk exist only inside a checkpointed call: they are recomputed in
    backward rather than kept, so peak memory is one chunk's logits, not [Q, V] per row.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    rows = chunk_blocks * block_size
    weighted_ce = h.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, h.shape[0], rows):
        sl = slice(start, start + rows)
        if h.requires_grad:
            part, hit = checkpoint(_chunk_ce, h[sl], y[sl], w[sl], lm_head, use_reentrant=False)
        else:
            part, hit = _chunk_ce(h[sl], y[sl], w[sl], lm_head)
        weighted_ce = weighted_ce + part
        correct.append(hit.detach())
    hits = torch.cat(correct).reshape(-1, block_size)[:, 1:]  # [b*N, B-1]
    supervised = (w.reshape(-1, block_size)[:, 1:] > 0).float()
    slots = SlotStats(correct=(hits * supervised).sum(0), total=supervised.sum(0))

    weight_sum = global_weight_sum(w)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    loss = weighted_ce / weight_sum.clamp_min(1e-12) * world
    return LossOutput(loss=loss, weighted_ce=weighted_ce.detach(), weight_sum=weight_sum, slots=slots)


__all__ = ["LossOutput", "SlotStats", "block_loss", "global_weight_sum"]
