"""The DFlash loss: LM head + cross-entropy in chunks of blocks, normalised over the global batch.

Loss = sum(w * CE) / sum(w) over every rank's rows. DDP averages gradients over ranks, so each rank returns
(its own sum(w * CE)) / (global sum(w)) * world_size; the averaged gradient then equals one process on the
global batch, and so does gradient clipping.

Two options change the per-slot term or its weight (`Objective`, docs/DFLASH.md "Training objective options"):
- `train.distill_weight` w > 0: each slot's term is (1 - w) * CE + w * T^2 * KL(p_T || q_T), p_T the target's own next-token
  distribution for that slot at temperature T (`train.distill_temperature`), q_T the drafter's. KL rather than the soft
  cross-entropy: the two differ by the target's entropy, a constant, so the gradient is the same, but KL is 0 exactly where
  the drafter matches the target, so the logged loss measures the gap and not the target's own uncertainty. T^2 keeps the
  gradient's size independent of T (Hinton et al., "Distilling the Knowledge in a Neural Network").
- `dflash.loss_weighting = "dpace"`: the weights come from the drafter's own predictions in the batch
  (`blockdraft.stages.train.weighting`), and the denominator is the count of supervised slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from blockdraft.config import DFlashConfig, TrainConfig
from blockdraft.stages.train.weighting import dpace_weights


@dataclass(frozen=True)
class Objective:
    """What each supervised slot's loss term is: `weighting` "exponential" (the batch's weights as they are) or "dpace";
    `dpace_alpha` D-PACE's smoothing; `distill_weight` in [0, 1] and `temperature` the distillation mix. The default is
    the paper's objective (hard-label CE, exponential decay)."""

    weighting: str = "exponential"
    dpace_alpha: float = 0.5
    distill_weight: float = 0.0
    temperature: float = 1.0

    @classmethod
    def of(cls, dflash: DFlashConfig, train: TrainConfig) -> Objective:
        """From the two sections that say it: dflash.loss_weighting, dflash.dpace_alpha, train.distill_weight, train.distill_temperature."""
        return cls(dflash.loss_weighting, dflash.dpace_alpha, train.distill_weight, train.distill_temperature)

    @property
    def distills(self) -> bool:
        """Whether the target's distribution is needed (weight 0 skips the teacher entirely)."""
        return self.distill_weight > 0

    def normaliser(self, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss's denominator for a batch's weights [...]: sum(w), or for D-PACE the count of
        supervised slots (w > 0). Summed over micro-batches and ranks, it is what `block_loss` divides by."""
        w = weights.detach().float()
        return (w > 0).float().sum() if self.weighting == "dpace" else w.sum()


PAPER_OBJECTIVE = Objective()


@dataclass
class Teacher:
    """The target's own next-token distribution for each slot, as the hidden states its LM head reads.

    hidden [b, S, H]: the target's final normed hidden states of the batch's rows (`TargetModel.features_and_final`);
    positions [b, Q] long: which position's distribution each slot learns. Slot k of the block anchored at a predicts
    token a + k, which the target predicts from position a + k - 1 given the true prefix (`for_blocks`)."""

    hidden: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def for_blocks(cls, final_hidden: torch.Tensor, block_positions: torch.Tensor) -> Teacher:
        """The teacher of a batch: the slot at position p reads the target's hidden state at p - 1, clamped into the row
        (only unsupervised slots fall outside: slot 0 of an anchor at 0, slots past a row's end)."""
        return cls(final_hidden, (block_positions - 1).clamp(0, final_hidden.shape[1] - 1))

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [b*S, H], index [b*Q] into it), both on the hidden states' device."""
        b, s, h = self.hidden.shape
        rows = torch.arange(b, device=self.positions.device)[:, None] * s
        return self.hidden.reshape(b * s, h), (rows + self.positions).reshape(-1).to(self.hidden.device)


@dataclass
class SlotStats:
    """Per-slot counts for slots 1..B-1: `correct` and `total` [B-1] float (supervised slots only), summable across ranks."""

    correct: torch.Tensor
    total: torch.Tensor

    def accuracy(self) -> list[float]:
        return (self.correct / self.total.clamp_min(1)).tolist()


@dataclass
class LossOutput:
    """loss: the scalar to backpropagate; weighted_ce: this rank's weighted sum of the per-slot terms (detached: sum(w * CE)
    for the paper's objective, the mixed term when distilling); weight_sum: the global denominator; weighted_kl: this
    rank's sum(w * KL) (detached) when distilling, else None."""

    loss: torch.Tensor
    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    slots: SlotStats
    weighted_kl: torch.Tensor | None = None


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum(w * term) with the LM head applied chunk by chunk, the weighted KL part, and argmax hits per row.

    Each chunk's [rows, V] logits live only inside `forward`, which also computes that chunk's gradient with respect to
    the hidden states: backward only scales it. So the logits are never kept nor recomputed, and the head costs one forward
    and one input-gradient matmul (distilling adds one forward of the teacher's rows). W and bias are frozen.
    With the drafter's logits z and the teacher's t, d(term)/dz = (1 - w_d) * (softmax(z) - onehot(label))
    + w_d * T * (softmax(z / T) - softmax(t / T)); times W gives the hidden-state gradient, the one-hot part a row lookup.
    The paper's objective (no teacher, exponential weights) runs exactly the operations it always did.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, teacher_hidden, teacher_index, chunk_rows, block_size, objective):
        distill, lam, temp = objective.distills, objective.distill_weight, objective.temperature
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = F.linear(hidden[sl].to(weight.dtype), weight, bias).float()  # [rows, V], matmul in the head's dtype
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[sl, None])[:, 0]
            hits[sl] = logits.argmax(dim=-1) == labels[sl]
            w = weights[sl]
            if objective.weighting == "dpace":
                w = dpace_weights(lse - picked, weights[sl] > 0, block_size, objective.dpace_alpha)
            if not distill:
                total += (w * (lse - picked)).sum()
                if grad is not None:
                    # d(w * CE)/dh = w * (softmax @ W - W[label]); the one-hot part is a row lookup, not a scatter.
                    probs = torch.exp(logits.sub_(lse[:, None])).mul_(w[:, None])  # in place of the logits
                    grad_chunk = probs.to(weight.dtype) @ weight - w[:, None].to(weight.dtype) * weight[labels[sl]]
                    grad[sl] = grad_chunk.to(hidden.dtype)
                continue
            # Distillation: the teacher's logits for these rows, then KL(p_T || q_T) per row, in place where it can be.
            teacher = F.linear(teacher_hidden[teacher_index[sl]].to(weight.dtype), weight, bias).float()
            log_p = torch.log_softmax(teacher.div_(temp), dim=-1)
            del teacher
            log_q = torch.log_softmax(logits / temp, dim=-1)
            p = torch.exp(log_p)
            kl = log_p.sub_(log_q).mul_(p).sum(-1)  # sum p * (log p - log q); log_p's buffer is reused
            del log_p
            kl_total += (w * kl).sum()
            total += (w * ((1.0 - lam) * (lse - picked) + lam * temp * temp * kl)).sum()
            if grad is not None:
                g = log_q.exp_().sub_(p).mul_(lam * temp)  # w_d * T * (q_T - p_T), in place of log_q
                g.add_(torch.exp(logits.sub_(lse[:, None])), alpha=1.0 - lam).mul_(w[:, None])
                hard = ((1.0 - lam) * w)[:, None].to(weight.dtype) * weight[labels[sl]]
                grad[sl] = (g.to(weight.dtype) @ weight - hard).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(kl_total, hits)
        return total, kl_total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_kl, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), *([None] * 9)


def global_weight_sum(weights: torch.Tensor, objective: Objective = PAPER_OBJECTIVE) -> torch.Tensor:
    """The loss's denominator over every rank (a detached scalar): sum(w), or for D-PACE the supervised slot count."""
    total = objective.normaliser(weights)
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
    weight_sum: torch.Tensor | None = None,
    *,
    objective: Objective = PAPER_OBJECTIVE,
    teacher: Teacher | None = None,
) -> LossOutput:
    """Weighted CE (or `objective`'s term) of the drafter's block outputs, globally normalised.

    hidden [b, Q, H] (after the drafter's final norm), labels [b, Q] long, weights [b, Q] float, Q = N*B;
    head_weight [V, H] (+ head_bias [V]) the frozen LM head. Peak extra memory is one chunk's logits
    [chunk_blocks*B, V] in fp32 (about four such buffers when distilling), never [Q, V] per row. `weight_sum`: the
    denominator when the optimizer step spans several micro-batches (`Objective.normaliser` summed over all of them and
    all ranks); None: this batch's `global_weight_sum`. `teacher`: required when `objective` distills, ignored otherwise.
    """
    if objective.distills and teacher is None:
        raise ValueError("train.distill_weight > 0 needs the target's final hidden states (a Teacher) for the loss")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    t_hidden, t_index = teacher.flat() if objective.distills and teacher is not None else (None, None)
    weighted_ce, weighted_kl, hits = _ChunkedHeadLoss.apply(
        h, head_weight, head_bias, y, w, t_hidden, t_index, chunk_blocks * block_size, block_size, objective
    )
    hits = hits.float().reshape(-1, block_size)[:, 1:]  # [b*N, B-1]
    supervised = (w.reshape(-1, block_size)[:, 1:] > 0).float()
    slots = SlotStats(correct=(hits * supervised).sum(0), total=supervised.sum(0))

    weight_sum = global_weight_sum(w, objective) if weight_sum is None else weight_sum
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    loss = weighted_ce / weight_sum.clamp_min(1e-12) * world
    kl = weighted_kl.detach() if objective.distills else None
    return LossOutput(loss=loss, weighted_ce=weighted_ce.detach(), weight_sum=weight_sum, slots=slots, weighted_kl=kl)


__all__ = ["LossOutput", "Objective", "PAPER_OBJECTIVE", "SlotStats", "Teacher", "block_loss", "global_weight_sum"]
