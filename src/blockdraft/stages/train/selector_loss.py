"""The selector's term of the DFlash2 objective: a K-way cross-entropy over each slot's top-K, with the gold predecessor.

Slot k of a block (k >= 1) has unary logits u (the chunked head's, `blockdraft.stages.train.loss`) and candidates C = the
top-K of u. The walk scores candidate c after predecessor p as u[c] + pair(h, p, c) (the drafter's candidate selector,
`CandidateSelector.scores`, the function the walk calls) and takes the best; training scores them the same way with the GOLD previous token as p (teacher forcing:
slot 1's predecessor is the anchor), and the term is the cross-entropy of that softmax over C against the gold token,
weighted per slot like the unary term (exponential decay or D-PACE's weights).

A gold token outside C (`missing_gold`): "inject" scores it as one more candidate of that slot's loss (so the selector
still learns to prefer it over every token the unary ranked above it), "skip" gives that slot no selector term (the unary
term is what can bring the gold into C). Candidate recall (gold in C) is reported either way. Teacher-forced selector
accuracy counts a slot right when the walk's choice among C (never the injected column: the walk does not have it) is gold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (final hidden [R, H], predecessor ids [R], candidates' unary logits [R, C], candidate ids [R, C]) -> each candidate's walk
# score [R, C]: `blockdraft.model.dflash2.CandidateSelector.scores`
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
    labels [R], weights [R] (0: not supervised), candidates [R, K + 1] and their unary logits values [R, K + 1] (the top-K,
    then the label: `_ChunkedHeadLoss`). Only weighted rows are scored."""
    rows = torch.nonzero(weights > 0, as_tuple=True)[0]
    recall = torch.zeros_like(labels, dtype=torch.bool)
    correct = torch.zeros_like(labels, dtype=torch.bool)
    if rows.numel() == 0:
        return SelectorTerm(values.sum() * 0.0, recall, correct)
    k = candidates.shape[1] - 1
    gold = labels[rows]
    cand = candidates[rows]
    scores = walk_scores(hidden[rows], gold_predecessors(labels, block_size)[rows], values[rows], cand).float()  # [n, K + 1]
    in_top = cand[:, :k] == gold[:, None]
    found = in_top.any(dim=-1)
    # The gold column counts only where the gold is outside the top-K and the rule injects it; elsewhere it is masked out.
    scores = scores.masked_fill(torch.cat((torch.zeros_like(in_top), (found | (not inject))[:, None]), dim=1), float("-inf"))
    target = torch.where(found, in_top.float().argmax(dim=-1), torch.full_like(gold, k if inject else 0))
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(1, target[:, None])[:, 0]
    counted = found | inject
    ce = torch.where(counted, ce, torch.zeros_like(ce))  # a skipped row's target is masked: its value is not used
    recall[rows] = found
    correct[rows] = found & (scores[:, :k].argmax(dim=-1) == target)
    return SelectorTerm((weights[rows] * ce).sum(), recall, correct)


__all__ = ["WalkScores", "SelectorTerm", "gold_predecessors", "selector_term"]
