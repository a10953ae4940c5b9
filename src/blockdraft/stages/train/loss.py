"""The training objective: the DFlash loss, how much each slot of a block weighs in it, and DFlash2's selector term.

The DFlash loss: LM head + cross-entropy in chunks of blocks, normalised over the global batch.

Loss = sum(w * CE) / sum(w) over every rank's rows. DDP averages gradients over ranks, so each rank returns
(its own sum(w * CE)) / (global sum(w)) * world_size; the averaged gradient then equals one process on the
global batch, and so does gradient clipping.

Two options change the per-slot term or its weight (`Objective`, docs/DFLASH.md "Training objective options"):
- `train.distill_weight` w > 0: each slot's term is (1 - w) * CE + w * T^2 * KL(p_T || q_T), p_T the target's own
  next-token distribution for that slot at temperature T (`train.distill_temperature`), q_T the drafter's. KL rather
  than the soft cross-entropy: the two differ by the target's entropy, a constant, so the gradient is the same, but KL
  is 0 exactly where the drafter matches the target, so the logged loss measures the gap and not the target's own
  uncertainty. T^2 keeps the gradient's size independent of T (Hinton et al., "Distilling the Knowledge in a Neural
  Network").
- `dflash.loss_weighting = "dpace"`: the weights come from the drafter's own predictions in the batch
  (`dpace_weights`, below), and the denominator is the count of supervised slots.

A DFlash2 drafter (`dflash.architecture = "dflash2"`) adds the selector's term (`selector_term`, below):
the unary logits above (the head's times `output_multiplier`, soft-capped when `final_logit_softcapping` is set) decide
each slot's top-K, which the chunked head returns with their values (differentiable) and the gold token as one more
column; the selector's K-way cross-entropy over them, weighted by `dflash.selector_loss_alpha` and by the same per-slot
weights, joins the sum before the one division by the global denominator.

How much each slot of a block counts in the loss: the paper's fixed decay, or D-PACE weights that follow the drafter.

`dflash.loss_weighting` picks one; it is pinned in the checkpoint's config and in the run's identity like
`dflash.gamma`.

- **exponential** (default, the DFlash paper's): slot k >= 1 of a block weighs `exp(-(k - 1) / gamma)`, fixed for the
  whole run. The batch carries these weights (`batch.slot_decay`); the loss is `sum(w * CE) / sum(w)`.
- **dpace** (D-PACE, "Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting", arXiv 2605.18810; the
  same definition is implemented in vllm-project/speculators `src/speculators/losses/utils.py` (`dpace_loss_decay`) and
  in sgl-project/SpecForge `specforge/algorithms/common/dflash_family_model.py` (`OnlineDFlashModel._dpace_weight`)):
  per block, with the drafter's own probability of the label at each supervised slot, `q_k = exp(-CE_k)` (no gradient),
  smoothed `s_k = (1 - alpha) * q_k + alpha` (`dflash.dpace_alpha`, default 0.5; 1 on unsupervised slots), the weight of
  slot k is `w_k = m_k * sum_{j >= k} m_j * prod_{i <= j} s_i` (m the supervision mask). That is the derivative of the
  expected acceptance length `sum_j prod_{i <= j} s_i` with respect to `log s_k`: a slot counts by how many later tokens
  its acceptance gates, measured on this batch with the current drafter, so the weights move with the drafter as it
  learns (early in training they fall off steeply, later they flatten). Being computed from the batch, they need no
  running statistics, and a resumed run computes exactly what an uninterrupted one would. The loss is normalised by the
  global count of supervised slots (as speculators does), so it is `sum(w * CE) / count`, not a weighted mean: the
  weights' sum is part of the signal (it grows as acceptance grows). gamma is still resolved and pinned, and unused.

The selector's term of the DFlash2 objective: a K-way cross-entropy over each slot's top-K, with the gold predecessor.

Slot k of a block (k >= 1) has unary logits u (the chunked head's, `block_loss`) and candidates C = the
top-K of u. The walk scores candidate c after predecessor p as u[c] + pair(h, p, c) (the drafter's candidate selector,
`CandidateSelector.scores`, the function the walk calls) and takes the best; training scores them the same way with the
GOLD previous token as p (teacher forcing: slot 1's predecessor is the anchor), and the term is the cross-entropy of
that softmax over C against the gold token, weighted per slot like the unary term (exponential decay or D-PACE's
weights).

A gold token outside C (`missing_gold`): "inject" scores it as one more candidate of that slot's loss (so the selector
still learns to prefer it over every token the unary ranked above it), "skip" gives that slot no selector term (the
unary term is what can bring the gold into C). Candidate recall (gold in C) is reported either way. Teacher-forced
selector accuracy counts a slot right when the walk's choice among C (never the injected column: the walk does not have
it) is gold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from blockdraft.config import DFlashConfig, TrainConfig


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE weights [R] (detached, fp32) of R = blocks * block_size rows in block order, from each row's cross-entropy
    against its label `ce` [R] and its supervision mask `supervised` [R] (bool or 0/1); 0 where unsupervised."""
    if ce.numel() % block_size:
        raise ValueError(f"{ce.numel()} rows are not whole blocks of {block_size}")
    with torch.no_grad():
        m = supervised.reshape(-1, block_size).float()
        smoothed = (1.0 - alpha) * torch.exp(-ce.detach().float().reshape(-1, block_size)) + alpha
        prefix = torch.cumprod(torch.where(m > 0, smoothed, torch.ones_like(smoothed)), dim=-1)
        suffix = (prefix * m).flip(-1).cumsum(-1).flip(-1)  # sum over j >= k of m_j * prefix_j
        return (suffix * m).reshape(-1)


# (final hidden [R, H], predecessor ids [R], candidates' unary logits [R, C], candidate ids [R, C]) -> each candidate's
# walk score [R, C]: `blockdraft.model.dflash2.CandidateSelector.scores`
WalkScores = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SelectorTerm:
    """`weighted`: sum(w * CE) over the rows (differentiable); per row [R] bool: `recall` (gold among the top-K) and
    `correct` (the best-scoring top-K candidate is the gold); rows without weight are False in both."""

    weighted: torch.Tensor
    recall: torch.Tensor
    correct: torch.Tensor


def gold_predecessors(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R] the gold token before each row's slot: slot k's is the label of slot k - 1 of its block (slot 1's the anchor,
    slot 0's label); slot 0 gets its own block's last label, which no weighted row reads."""
    return labels.reshape(-1, block_size).roll(1, dims=-1).reshape(-1)


def selector_term(
    hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, candidates: torch.Tensor, values: torch.Tensor,
    walk_scores: WalkScores, block_size: int, inject: bool,
) -> SelectorTerm:
    """The term over R = blocks * block_size rows in block order: hidden [R, H] (the drafter's, after its final norm),
    labels [R], weights [R] (0: not supervised), candidates [R, K + 1] and their unary logits values [R, K + 1] (the
    top-K, then the label: `_ChunkedHeadLoss`). Only weighted rows are scored."""
    rows = torch.nonzero(weights > 0, as_tuple=True)[0]
    recall = torch.zeros_like(labels, dtype=torch.bool)
    correct = torch.zeros_like(labels, dtype=torch.bool)
    if rows.numel() == 0:
        return SelectorTerm(values.sum() * 0.0, recall, correct)
    k = candidates.shape[1] - 1
    gold = labels[rows]
    cand = candidates[rows]
    # [n, K + 1]
    scores = walk_scores(hidden[rows], gold_predecessors(labels, block_size)[rows], values[rows], cand).float()
    in_top = cand[:, :k] == gold[:, None]
    found = in_top.any(dim=-1)
    # The gold column counts only where the gold is outside the top-K and the rule injects it; elsewhere it is masked
    # out.
    scores = scores.masked_fill(torch.cat((torch.zeros_like(in_top), (found | (not inject))[:, None]), dim=1),
                                float("-inf"))
    target = torch.where(found, in_top.float().argmax(dim=-1), torch.full_like(gold, k if inject else 0))
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(1, target[:, None])[:, 0]
    counted = found | inject
    ce = torch.where(counted, ce, torch.zeros_like(ce))  # a skipped row's target is masked: its value is not used
    recall[rows] = found
    correct[rows] = found & (scores[:, :k].argmax(dim=-1) == target)
    return SelectorTerm((weights[rows] * ce).sum(), recall, correct)


@dataclass(frozen=True)
class Objective:
    """What each supervised slot's loss term is: `weighting` "exponential" (the batch's weights as they are) or "dpace";
    `dpace_alpha` D-PACE's smoothing; `distill_weight` in [0, 1] and `temperature` the distillation mix. The default is
    the paper's objective (hard-label CE, exponential decay).

    A DFlash2 drafter's: `top_k` > 0 candidates per slot (0: DFlash, no selector term), `selector_alpha` the selector
    term's weight, `missing_gold` what a slot whose gold token is not among its top-K gets ("inject": the gold joins
    that slot's candidates in the loss; "skip": no selector term), and the unary logits' `output_multiplier` and
    `softcap`."""

    weighting: str = "exponential"
    dpace_alpha: float = 0.5
    distill_weight: float = 0.0
    temperature: float = 1.0
    top_k: int = 0
    selector_alpha: float = 0.0
    missing_gold: str = "inject"
    output_multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, dflash: DFlashConfig, train: TrainConfig) -> Objective:
        """From the two sections that say it: dflash.loss_weighting, dflash.dpace_alpha, train.distill_weight,
        train.distill_temperature, and for a DFlash2 drafter dflash.selector_top_k, selector_loss_alpha,
        selector_missing_gold, output_multiplier and final_logit_softcapping."""
        base = cls(dflash.loss_weighting, dflash.dpace_alpha, train.distill_weight, train.distill_temperature)
        if dflash.architecture != "dflash2":
            return base
        return dataclasses.replace(
            base, top_k=dflash.selector_top_k, selector_alpha=dflash.selector_loss_alpha,
            missing_gold=dflash.selector_missing_gold,
            output_multiplier=dflash.output_multiplier, softcap=dflash.final_logit_softcapping,
        )

    @property
    def distills(self) -> bool:
        """Whether the target's distribution is needed (weight 0 skips the teacher entirely)."""
        return self.distill_weight > 0

    @property
    def selects(self) -> bool:
        """Whether the loss has the selector's term (a DFlash2 drafter)."""
        return self.top_k > 0

    @property
    def transforms(self) -> bool:
        """Whether the unary logits are the head's scaled or soft-capped (otherwise the head's as they are)."""
        return self.output_multiplier != 1.0 or self.softcap is not None

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits -> the unary logits (in place): times output_multiplier, then cap * tanh(. / cap)."""
        if self.output_multiplier != 1.0:
            logits.mul_(self.output_multiplier)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def unary_slope(self, unary: torch.Tensor) -> torch.Tensor:
        """d(unary) / d(head logit), from the unary logits themselves: m, or m * (1 - (unary / cap)^2) when capped."""
        if self.softcap is None:
            return torch.full_like(unary, self.output_multiplier)
        return (1.0 - (unary / self.softcap).square()).mul_(self.output_multiplier)

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
    """Per-slot counts for slots 1..B-1 (supervised slots only), summable across ranks, all [B-1] float: `correct`
    (unary argmax = label), `total`, `ce` the sum of the unary cross-entropy against the label (unweighted), and
    `leading` the blocks whose slots 1..k all are supervised and right (`batch.teacher_forced_tau`; `total[0]` counts
    the blocks)."""

    correct: torch.Tensor
    total: torch.Tensor
    ce: torch.Tensor
    leading: torch.Tensor

    def accuracy(self) -> list[float]:
        return (self.correct / self.total.clamp_min(1)).tolist()


@dataclass
class SelectorStats:
    """The selector's term of a DFlash2 drafter: `weighted` its sum(w * CE) (detached, before selector_loss_alpha), and
    per slot 1..B-1 [B-1] float over supervised slots: `recall` (gold among the top-K) and `correct` (the walk's choice
    with the gold predecessor, among the top-K, is the gold: teacher-forced selector accuracy), and `leading` as
    `SlotStats`'s for the walk's choices."""

    weighted: torch.Tensor
    recall: torch.Tensor
    correct: torch.Tensor
    leading: torch.Tensor


@dataclass
class LossOutput:
    """loss: the scalar to backpropagate; weighted_ce: this rank's weighted sum of the per-slot terms (detached: sum(w *
    CE) for the paper's objective, the mixed term when distilling, plus selector_loss_alpha times the selector's for
    DFlash2); weight_sum: the global denominator; weighted_kl: this rank's sum(w * KL) (detached) when distilling, else
    None; selector: the selector term's figures for a DFlash2 drafter, else None."""

    loss: torch.Tensor
    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    slots: SlotStats
    weighted_kl: torch.Tensor | None = None
    selector: SelectorStats | None = None

    def sums(self) -> dict[str, torch.Tensor]:
        """This batch's figures as named sums (detached, fp32): added up over micro-batches (or held-out batches) and
        ranks, they are what `metrics.Figures.of_sums` reads, each by its name here."""
        named = {
            "weighted_term": self.weighted_ce, "slot_correct": self.slots.correct, "slot_counted": self.slots.total,
            "slot_ce": self.slots.ce, "slot_leading": self.slots.leading,
        }
        if self.weighted_kl is not None:
            named["weighted_kl"] = self.weighted_kl
        if self.selector is not None:
            named |= {
                "selector_weighted": self.selector.weighted, "slot_recall": self.selector.recall,
                "slot_selector_correct": self.selector.correct, "slot_walk_leading": self.selector.leading,
            }
        return {name: value.detach().float() for name, value in named.items()}


@dataclass(frozen=True)
class HeadInputs:
    """What the chunked head reads besides the hidden states, none of it differentiated: the frozen head `weight` [V, H]
    and `bias` [V] (or None), each row's `labels` [R] and loss `weights` [R], the teacher's rows when distilling
    (`Teacher.flat`: hidden [b*S, H] and each row's `teacher_index` [R], else None), `chunk_rows` rows per chunk, the
    `block_size` and the `objective`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    weights: torch.Tensor
    teacher_hidden: torch.Tensor | None
    teacher_index: torch.Tensor | None
    chunk_rows: int
    block_size: int
    objective: Objective


class HeadLoss(NamedTuple):
    """The chunked head's result over R rows: `total` sum(w * term) (differentiable); `kl` sum(w * KL(p_T || q_T)) (0
    unless distilling); per row [R]: `hits` (unary argmax = label), `ce` (unary CE against the label), `used` (the
    weight each row counted with: D-PACE's are computed in the head); `candidates` [R, K + 1] each row's top-K unary ids
    then its label, with their unary logits `values` [R, K + 1] (differentiable), K = 0 columns without a selector."""

    total: torch.Tensor
    kl: torch.Tensor
    hits: torch.Tensor
    ce: torch.Tensor
    used: torch.Tensor
    candidates: torch.Tensor
    values: torch.Tensor


def chunked_head_loss(hidden: torch.Tensor, inputs: HeadInputs) -> HeadLoss:
    """`HeadLoss` of hidden [R, H] (the drafter's, after its final norm), one chunk's logits in memory at a time."""
    return HeadLoss(*_ChunkedHeadLoss.apply(hidden, inputs))


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum(w * term) with the LM head applied chunk by chunk, the weighted KL part, argmax hits and CE per row, the
    weights used, and for DFlash2 each row's top-K candidates plus its label with their unary logits.

    Each chunk's [rows, V] logits live only inside `forward`, which also computes that chunk's gradient with respect to
    the hidden states: backward only scales it. So the logits are never kept nor recomputed, and the head costs one
    forward and one input-gradient matmul (distilling adds one forward of the teacher's rows). W and bias are frozen.
    With the drafter's logits z and the teacher's t, d(term)/dz = (1 - w_d) * (softmax(z) - onehot(label))
    + w_d * T * (softmax(z / T) - softmax(t / T)); times W gives the hidden-state gradient, the one-hot part a row
      lookup.
    Unary logits that are scaled or capped (`Objective.unary`) multiply that by their slope first.
    The candidates' logits [rows, K + 1] are an output with a gradient (the selector's term scores with them): backward
    adds sum_c g_c * slope_c * W[c] per row, gathering the K + 1 rows of W chunk by chunk again rather than keeping
    them. The paper's objective (no teacher, exponential weights, no selector) runs exactly the operations it always
    did.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, inputs: HeadInputs):
        weight, bias, labels, weights = inputs.weight, inputs.bias, inputs.labels, inputs.weights
        objective, chunk_rows, block_size = inputs.objective, inputs.chunk_rows, inputs.block_size
        distill, lam, temp, k = objective.distills, objective.distill_weight, objective.temperature, objective.top_k
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = hidden.shape[0]
        hits = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        ce_rows = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        used = weights.clone()  # the weights each row counts with (D-PACE: computed below)
        candidates = torch.empty(rows, k + 1 if k else 0, dtype=torch.long, device=hidden.device)
        values = torch.empty(rows, k + 1 if k else 0, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, chunk_rows):
            sl = slice(start, start + chunk_rows)
            # [rows, V], matmul in the head's dtype
            logits = F.linear(hidden[sl].to(weight.dtype), weight, bias).float()
            if objective.transforms:
                objective.unary(logits)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[sl, None])[:, 0]
            hits[sl] = logits.argmax(dim=-1) == labels[sl]
            ce_rows[sl] = lse - picked
            if k:  # before the logits' buffer is reused below
                top = logits.topk(k, dim=-1)
                candidates[sl] = torch.cat((top.indices, labels[sl, None]), dim=1)
                values[sl] = torch.cat((top.values, picked[:, None]), dim=1)
            slope = objective.unary_slope(logits) if objective.transforms and grad is not None else None
            w = weights[sl]
            if objective.weighting == "dpace":
                w = used[sl] = dpace_weights(lse - picked, weights[sl] > 0, block_size, objective.dpace_alpha)
            if not distill:
                total += (w * (lse - picked)).sum()
                if grad is not None:
                    # d(w * CE)/dh = w * (softmax @ W - W[label]); the one-hot part is a row lookup, not a scatter.
                    probs = torch.exp(logits.sub_(lse[:, None])).mul_(w[:, None])  # in place of the logits
                    hard = w
                    if slope is not None:
                        hard = w * slope.gather(1, labels[sl, None])[:, 0]
                        probs.mul_(slope)
                    grad_chunk = probs.to(weight.dtype) @ weight - hard[:, None].to(weight.dtype) * weight[labels[sl]]
                    grad[sl] = grad_chunk.to(hidden.dtype)
                continue
            # Distillation: the teacher's logits for these rows, then KL(p_T || q_T) per row, in place where it can be.
            assert inputs.teacher_hidden is not None and inputs.teacher_index is not None, (
                "block_loss checks the teacher"
            )
            teacher = F.linear(inputs.teacher_hidden[inputs.teacher_index[sl]].to(weight.dtype), weight, bias).float()
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
                hard = (1.0 - lam) * w
                if slope is not None:
                    hard = hard * slope.gather(1, labels[sl, None])[:, 0]
                    g.mul_(slope)
                grad[sl] = (g.to(weight.dtype) @ weight - hard[:, None].to(weight.dtype) * weight[labels[sl]]).to(
                    hidden.dtype
                )
        ctx.save_for_backward(grad, weight, candidates, values)  # read back by these names in backward
        ctx.objective, ctx.chunk_rows = objective, chunk_rows
        ctx.mark_non_differentiable(kl_total, hits, ce_rows, used, candidates)
        return HeadLoss(total, kl_total, hits, ce_rows, used, candidates, values)

    @staticmethod
    def backward(ctx, *grads):
        upstream = HeadLoss(*grads)  # one gradient per output, by name: only `total` and `values` are differentiable
        grad, weight, candidates, values = ctx.saved_tensors
        objective: Objective = ctx.objective
        grad = grad * upstream.total.to(grad.dtype)
        if upstream.values is not None and candidates.shape[1]:
            g = upstream.values * objective.unary_slope(values) if objective.transforms else upstream.values
            for start in range(0, grad.shape[0], ctx.chunk_rows):
                sl = slice(start, start + ctx.chunk_rows)
                rows = torch.einsum("rk,rkh->rh", g[sl].to(weight.dtype), weight[candidates[sl]])
                grad[sl] += rows.to(grad.dtype)
        return grad, None  # the hidden states' gradient; `inputs` gets none


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
    walk_scores: WalkScores | None = None,
) -> LossOutput:
    """Weighted CE (or `objective`'s term) of the drafter's block outputs, globally normalised.

    hidden [b, Q, H] (after the drafter's final norm), labels [b, Q] long, weights [b, Q] float, Q = N*B;
    head_weight [V, H] (+ head_bias [V]) the frozen LM head. Peak extra memory is one chunk's logits
    [chunk_blocks*B, V] in fp32 (about four such buffers when distilling), never [Q, V] per row. `weight_sum`: the
    denominator when the optimizer step spans several micro-batches (`Objective.normaliser` summed over all of them and
    all ranks); None: this batch's `global_weight_sum`. `teacher`: required when `objective` distills, ignored
    otherwise. `walk_scores`: the DFlash2 selector's scoring (`CandidateSelector.scores`), required when `objective`
    selects.
    """
    if objective.distills and teacher is None:
        raise ValueError("train.distill_weight > 0 needs the target's final hidden states (a Teacher) for the loss")
    if objective.selects and walk_scores is None:
        raise ValueError("a DFlash2 objective needs the drafter's candidate selector (walk_scores) for the loss")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    t_hidden, t_index = teacher.flat() if objective.distills and teacher is not None else (None, None)
    inputs = HeadInputs(head_weight, head_bias, y, w, t_hidden, t_index, chunk_blocks * block_size, block_size,
                        objective)
    head = chunked_head_loss(h, inputs)
    supervised = (w.reshape(-1, block_size)[:, 1:] > 0).float()
    per_slot = lambda rows: (rows.float().reshape(-1, block_size)[:, 1:] * supervised).sum(0)  # noqa: E731  [B-1]
    # [B-1]: the blocks whose slots 1..k are all supervised and right (a running product along each block).
    leading = lambda rows: (  # noqa: E731
        (rows.float().reshape(-1, block_size)[:, 1:] * supervised).cumprod(dim=1).sum(0))
    slots = SlotStats(correct=per_slot(head.hits), total=supervised.sum(0), ce=per_slot(head.ce.detach()),
                      leading=leading(head.hits))
    selector = None
    term = head.total
    if objective.selects and walk_scores is not None:
        out = selector_term(h, y, head.used, head.candidates, head.values, walk_scores, block_size,
                            objective.missing_gold == "inject")
        selector = SelectorStats(out.weighted.detach(), per_slot(out.recall), per_slot(out.correct),
                                 leading(out.correct))
        term = head.total + objective.selector_alpha * out.weighted

    weight_sum = global_weight_sum(w, objective) if weight_sum is None else weight_sum
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    loss = term / weight_sum.clamp_min(1e-12) * world
    kl = head.kl.detach() if objective.distills else None
    return LossOutput(loss=loss, weighted_ce=term.detach(), weight_sum=weight_sum, slots=slots, weighted_kl=kl,
                      selector=selector)


__all__ = [
    "HeadInputs", "HeadLoss", "LossOutput", "Objective", "PAPER_OBJECTIVE", "SelectorStats", "SelectorTerm",
    "SlotStats", "Teacher", "WalkScores", "block_loss", "chunked_head_loss", "dpace_weights", "global_weight_sum",
    "gold_predecessors", "selector_term",
]
