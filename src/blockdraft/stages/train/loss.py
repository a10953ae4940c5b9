"""The DFlash loss: LM head + cross-entropy in chunks of blocks, normalised over the global batch.

Loss = sum(w * CE) / sum(w) over every rank's rows. DDP averages gradients over ranks, so each rank returns
(its own sum(w * CE)) / (global sum(w)) * world_size; the averaged gradient then equals one process on the
global batch, and so does gradient clipping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


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


class _ChunkedHeadCE(torch.autograd.Function):
    """sum(w * CE(hidden @ W^T + bias, labels)) with the LM head applied chunk by chunk, and argmax hits per row.

    Each chunk's [rows, V] logits live only inside `forward`, which also computes that chunk's gradient with respect to
    the hidden states (w * (softmax @ W - W[label])): backward only scales it. So the logits are never kept nor recomputed,
    and the head costs one forward and one input-gradient matmul. W and bias are frozen (no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, chunk_rows):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = F.linear(hidden[sl].to(weight.dtype), weight, bias).float()  # [rows, V], matmul in the head's dtype
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[sl, None])[:, 0]
            total += (weights[sl] * (lse - picked)).sum()
            hits[sl] = logits.argmax(dim=-1) == labels[sl]
            if grad is not None:
                # d(w * CE)/dh = w * (softmax @ W - W[label]); the one-hot part is a row lookup, not a scatter.
                probs = torch.exp(logits.sub_(lse[:, None])).mul_(weights[sl, None])  # in place of the logits
                grad_chunk = probs.to(weight.dtype) @ weight - weights[sl, None].to(weight.dtype) * weight[labels[sl]]
                grad[sl] = grad_chunk.to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


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
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    block_size: int,
    chunk_blocks: int,
) -> LossOutput:
    """Weighted CE of the drafter's block outputs, globally normalised.

    hidden [b, Q, H] (after the drafter's final norm), labels [b, Q] long, weights [b, Q] float, Q = N*B;
    head_weight [V, H] (+ head_bias [V]) the frozen LM head. Peak extra memory is one chunk's logits
    [chunk_blocks*B, V] in fp32, never [Q, V] per row.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    weighted_ce, hits = _ChunkedHeadCE.apply(h, head_weight, head_bias, y, w, chunk_blocks * block_size)
    hits = hits.float().reshape(-1, block_size)[:, 1:]  # [b*N, B-1]
    supervised = (w.reshape(-1, block_size)[:, 1:] > 0).float()
    slots = SlotStats(correct=(hits * supervised).sum(0), total=supervised.sum(0))

    weight_sum = global_weight_sum(w)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    loss = weighted_ce / weight_sum.clamp_min(1e-12) * world
    return LossOutput(loss=loss, weighted_ce=weighted_ce.detach(), weight_sum=weight_sum, slots=slots)


__all__ = ["LossOutput", "SlotStats", "block_loss", "global_weight_sum"]
