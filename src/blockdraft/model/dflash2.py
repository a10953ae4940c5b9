"""DFlash2's two modules (docs/DFLASH.md, "DFlash2"): the grouped dynamic causal convolution that wraps every attention
and MLP of a drafter layer, and the candidate selector that drafts a path through each slot's top-K.

Shapes: b = batch, Q = block slots (one block in decode, N blocks of B slots back to back in training), H = hidden size,
G = H / group_size channel groups, T = taps, V = vocabulary, K = candidates per slot, r = selector rank.

The selector's API, for decoding and for the training objective:

- `unary_logits(logits, spec)`: the target head's logits [..., V] -> the unary logits (times `output_multiplier`, then
  soft-capped when `final_logit_softcapping` is set). Both the candidate set and the walk use these.
- `CandidateSelector.candidates(unary)`: unary [..., V] -> (candidate unary logits [..., K], candidate ids [..., K]),
  the top-K, best first.
- `CandidateSelector.scores(hidden, predecessor_ids, candidate_unary, candidate_ids)`: each candidate's walk score
  `unary[c] + <A[p] * (W h), B[c]>` [..., K] for slot hiddens [..., H] and one predecessor id per slot [...]. With the
  gold previous tokens as predecessors (slot 1's is the anchor) this is the teacher-forced score the selector's K-way
  cross-entropy reads; in decode the predecessor is what the walk chose at the slot before.
- `walk(selector, hidden, unary, anchor_ids, pick)`: the walk over slots 1..B-1 from the anchor: at each slot the scores
  given the predecessor the walk holds, `pick(scores, slot)` chooses a candidate index, and that candidate becomes the
  next predecessor. `greedy_walk` is `walk` with `pick` = argmax: the drafted block of greedy decoding. A sampled walk
  passes a `pick` that samples from softmax(scores / T); `Walk.scores` are then the q of rejection sampling (over
  `Walk.candidates`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from blockdraft.model.spec import DFlash2Spec

# The published drafters' scale of the codebooks' normal initialisation (HF's initializer_range), small enough that an
# untrained selector's bilinear term is near 0 and its walk starts as the unary argmax.
CODEBOOK_INIT_STD = 0.02


def grouped_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group_size]) * x[t - j, c], with x[t - j] = 0 when t - j lies
    before the first slot of t's block (blocks are `block_size` consecutive slots; a shorter Q is one block).

    x [b, Q, H], dynamic [b, Q, T, G], base [T, H] -> [b, Q, H]."""
    b, q, h = x.shape
    taps = base.shape[0]
    groups = h // group_size
    grouped = x.view(b, q, groups, group_size)
    slot = torch.arange(q, device=x.device) % block_size  # each query's slot within its block
    out = torch.zeros_like(grouped)
    for j in range(taps):
        if j == 0:
            shifted = grouped
        else:
            shifted = torch.zeros_like(grouped)
            shifted[:, j:] = grouped[:, :-j]
            shifted = shifted * (slot >= j).to(x.dtype)[None, :, None, None]  # a tap never reaches the block before
        kernel = base[j].to(x.dtype).view(1, 1, groups, group_size) + dynamic[:, :, j, :, None]
        out = out + kernel * shifted
    return out.view(b, q, h)


class GroupedDynamicCausalConv(nn.Module):
    """One convolution pair around a sublayer: `base_kernel` [2, T, H] (side 0 before the sublayer, side 1 after it) and
    `kernel_projection` (H -> 2*T*G, no bias), which makes both sides' dynamic taps from the sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Tap 0 at 1, the other taps and the projection at 0: the pair computes the identity, so a DFlash2 layer starts
        as exactly the DFlash layer it wraps."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input x [b, Q, H] -> (x convolved by the before-side, the after-side's dynamic taps [b, Q, T,
        G])."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        before = grouped_causal_conv(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size, self.block_size)
        return before, dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [b, Q, H] convolved by the after-side, with the taps `prepare` made from its
        input."""
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], self.group_size, self.block_size)


def unary_logits(logits: torch.Tensor, spec: DFlash2Spec) -> torch.Tensor:
    """The target head's logits [..., V] -> the selector's unary logits: times `output_multiplier`, then
    `cap * tanh(logits / cap)` when `final_logit_softcapping` is set."""
    if spec.output_multiplier != 1.0:
        logits = logits * spec.output_multiplier
    cap = spec.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


class CandidateSelector(nn.Module):
    """`predecessor_codebook` A [V, r], `successor_codebook` B [V, r] (plain parameters, so their export names carry no
    `.weight`, as the engines read them) and `hidden_projection` W (H -> r, no bias)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_codebooks()

    @torch.no_grad()
    def reset_codebooks(self) -> None:
        """Both codebooks ~ normal(0, CODEBOOK_INIT_STD)."""
        self.predecessor_codebook.normal_(0.0, CODEBOOK_INIT_STD)
        self.successor_codebook.normal_(0.0, CODEBOOK_INIT_STD)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """unary [..., V] -> (their values [..., K], candidate ids [..., K]): the top-K, best first."""
        values, ids = torch.topk(unary, self.top_k, dim=-1)
        return values, ids

    def scores(
        self, hidden: torch.Tensor, predecessor_ids: torch.Tensor, candidate_unary: torch.Tensor,
        candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """Walk scores [..., K] = candidate_unary + <A[predecessor] * W(hidden), B[candidate]>, for slot hiddens
        [..., H], predecessor ids [...] and the slot's candidates [..., K]."""
        query = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden)  # [..., r]
        successors = self.successor_codebook[candidate_ids]  # [..., K, r]
        return candidate_unary + torch.einsum("...r,...kr->...k", query, successors.to(query.dtype))


@dataclass
class Walk:
    """A walk through the candidates of slots 1..n: `path` [b, n] the drafted ids, `candidates` [b, n, K] each slot's
    top-K, `scores` [b, n, K] each slot's walk scores given the predecessor the walk held there, `unary_argmax` [b,
    n]."""

    path: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor
    unary_argmax: torch.Tensor


# pick(scores [b, K], slot index from 0) -> the chosen candidate index [b] long.
Pick = Callable[[torch.Tensor, int], torch.Tensor]


def argmax_pick(scores: torch.Tensor, _slot: int) -> torch.Tensor:
    return scores.argmax(dim=-1)


def walk(selector: CandidateSelector, hidden: torch.Tensor, unary: torch.Tensor, anchor_ids: torch.Tensor,
         pick: Pick) -> Walk:
    """The walk from the anchor over the draft slots: hidden [b, n, H] and unary [b, n, V] of slots 1..n, anchor_ids
    [b]. Slot k's predecessor is slot k-1's pick (slot 1's: the anchor)."""
    candidate_unary, candidate_ids = selector.candidates(unary)
    predecessor = anchor_ids
    path, rows = [], []
    for k in range(hidden.shape[1]):
        scores = selector.scores(hidden[:, k], predecessor, candidate_unary[:, k], candidate_ids[:, k])
        chosen = pick(scores, k)
        predecessor = candidate_ids[:, k].gather(-1, chosen[:, None])[:, 0]
        path.append(predecessor)
        rows.append(scores)
    return Walk(torch.stack(path, dim=1), candidate_ids, torch.stack(rows, dim=1), unary.argmax(dim=-1))


def greedy_walk(selector: CandidateSelector, hidden: torch.Tensor, unary: torch.Tensor,
                anchor_ids: torch.Tensor) -> Walk:
    """The greedy walk: at every slot the best-scoring candidate (what greedy decoding drafts)."""
    return walk(selector, hidden, unary, anchor_ids, argmax_pick)


__all__ = [
    "CandidateSelector", "GroupedDynamicCausalConv", "Pick", "Walk", "argmax_pick", "greedy_walk",
    "grouped_causal_conv", "unary_logits", "walk",
]
