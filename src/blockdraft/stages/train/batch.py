"""Training batch construction for DFlash (docs/DFLASH.md, "Training batch construction").

One training row (input_ids, loss_mask of length S) becomes N blocks of B query slots, packed after the row's S
context entries. Shapes below: b = rows in the batch, S = longest row, N = blocks per row, B = block size, Q = N*B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch

from blockdraft.model.attention import sliding_window_mask
from blockdraft.model.block_sparse import AnchorLayout


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p <= S-2 with loss_mask[p] and loss_mask[p+1] set: [E] long, ascending.

    The anchor itself is a clean token already produced, and slot 1 (the first draft) must be supervised.
    """
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` eligible anchors drawn uniformly without replacement, sorted; padded to exactly `num_anchors`.

    Returns (anchors [N] long, keep [N] bool). Padded entries have anchor 0 and keep False.
    """
    eligible = eligible_anchors(loss_mask)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    if eligible.numel() > num_anchors:
        pick = torch.randperm(eligible.numel(), generator=generator)[:num_anchors]
        eligible = eligible[pick].sort().values
    anchors[: eligible.numel()] = eligible
    keep[: eligible.numel()] = True
    return anchors, keep


def anchor_generator(seed: int, epoch: int, row: int) -> torch.Generator:
    """The generator that draws row `row`'s anchors in `epoch`.

    Keyed by (seed, epoch, row) rather than one running stream, so a resumed run draws exactly the anchors an
    uninterrupted run would, and every epoch draws new ones.
    """
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + row) % 2**63)  # manual_seed takes 64 bits
    return g


def slot_decay(block_size: int, gamma: float) -> torch.Tensor:
    """[B] float: 0 for slot 0 (the anchor, not predicted), exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def block_attention_mask(
    anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """[b, 1, Q, S+Q] bool, True = may attend; keys are the S context entries, then the Q = N*B block slots.

    Full attention (`sliding_window` None): a query of block n sees context keys at positions strictly below its anchor
    (`<=` would leak the anchor's own hidden state, which inference does not have) and every slot of its own block,
    bidirectionally. A padded block (keep False) sees its own block only, so no query row is fully masked (that gives NaN
    in SDPA). A sliding layer with window W sees that AND its causal window: the query at q = a_n + k sees context
    positions c with q - W < c < a_n and its own block's slots at positions <= q (what the drafter computes per layer).
    """
    b, n = anchors.shape
    q = n * block_size
    block_of_query = torch.arange(q, device=anchors.device) // block_size  # [Q]
    anchor_of_query = anchors[:, block_of_query]  # [b, Q]
    keep_of_query = keep[:, block_of_query]  # [b, Q]
    ctx_pos = torch.arange(context_len, device=anchors.device)
    ctx = (ctx_pos[None, None, :] < anchor_of_query[:, :, None]) & keep_of_query[:, :, None]  # [b, Q, S]
    own = (block_of_query[:, None] == block_of_query[None, :]).expand(b, q, q)  # [b, Q, Q]
    mask = torch.cat([ctx, own], dim=-1)[:, None]
    if sliding_window is None:
        return mask
    query_pos = anchor_of_query + torch.arange(block_size, device=anchors.device).repeat(n)  # [b, Q]
    key_pos = torch.cat([ctx_pos.expand(b, context_len), query_pos], dim=1)  # [b, S+Q]
    return mask & sliding_window_mask(query_pos, key_pos, sliding_window)


@dataclass
class BlockBatch:
    """One packed training batch; every tensor is on the CPU until `to(device)`.

    input_ids [b, S] long (right-padded with 0), attention_mask_context [b, S] bool (real tokens), context_positions [b, S],
    anchors [b, N], keep [b, N] bool, block_ids [b, Q] (anchor token at slot 0, mask token elsewhere),
    block_positions [b, Q] (anchor + k), labels [b, Q] (token at anchor + k), weights [b, Q] float.
    `attention_mask` [b, 1, Q, S+Q] bool is built on the batch's device when read (it is the one large tensor:
    about 92 MB per row at S = 3072, N = 512, B = 16, not worth a host-to-device copy). `attention` says what the drafter
    gets (`drafter_attention`): that dense mask, or with "flex" the anchors' layout, from which it builds block-sparse
    masks, so the dense one is never made.
    """

    input_ids: torch.Tensor
    attention_mask_context: torch.Tensor
    context_positions: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor
    block_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    block_size: int
    attention: Literal["dense", "flex"] = "dense"

    @property
    def attention_mask(self) -> torch.Tensor:
        return block_attention_mask(self.anchors, self.keep, self.input_ids.shape[1], self.block_size)

    @property
    def layout(self) -> AnchorLayout:
        return AnchorLayout(self.anchors, self.keep, self.input_ids.shape[1], self.block_size)

    @property
    def drafter_attention(self) -> torch.Tensor | AnchorLayout:
        """The drafter forward's `attention_mask` argument for this batch's `attention` path."""
        return self.layout if self.attention == "flex" else self.attention_mask

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) context tokens in the batch."""
        return int(self.attention_mask_context.sum())

    def to(self, device: torch.device | str) -> BlockBatch:
        moved = {f.name: value.to(device) for f in fields(self) if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def build_block_batch(
    rows: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]],
    *,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    generators: Sequence[torch.Generator],
    attention: Literal["dense", "flex"] = "dense",
) -> BlockBatch:
    """Pack `rows` ((input_ids, loss_mask) pairs) into one BlockBatch, one generator per row for its anchors; `attention`
    is the drafter's attention path (`blockdraft.model.block_sparse.resolve_attention`).

    N is min(num_anchors, the most eligible anchors of any row in the batch) (at least 1): rows with fewer get padded
    blocks of weight 0. Weight of slot k of block n:
    keep_n * (a_n + k < S_row) * (k > 0) * loss_mask[a_n + k] * exp(-(k - 1) / gamma).
    """
    if len(rows) != len(generators):
        raise ValueError(f"{len(rows)} rows but {len(generators)} generators")
    seqs = [torch.as_tensor(ids, dtype=torch.long) for ids, _ in rows]
    masks = [torch.as_tensor(mask, dtype=torch.bool) for _, mask in rows]
    for ids, mask in zip(seqs, masks, strict=True):
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids length {ids.numel()} != loss_mask length {mask.numel()}")
    b = len(seqs)
    s = max(ids.numel() for ids in seqs)
    n = max(1, min(num_anchors, max(eligible_anchors(mask).numel() for mask in masks)))
    q = n * block_size

    input_ids = torch.zeros(b, s, dtype=torch.long)
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    real = torch.zeros(b, s, dtype=torch.bool)
    anchors = torch.zeros(b, n, dtype=torch.long)
    keep = torch.zeros(b, n, dtype=torch.bool)
    for i, (ids, mask, gen) in enumerate(zip(seqs, masks, generators, strict=True)):
        input_ids[i, : ids.numel()] = ids
        loss_mask[i, : ids.numel()] = mask
        real[i, : ids.numel()] = True
        anchors[i], keep[i] = sample_anchors(mask, n, gen)

    k = torch.arange(block_size).repeat(n)  # [Q] slot index within its block
    block_of_query = torch.arange(q) // block_size
    block_positions = anchors[:, block_of_query] + k  # [b, Q]
    in_row = torch.stack([block_positions[i] < seqs[i].numel() for i in range(b)])  # [b, Q]
    gather_pos = block_positions.clamp(max=s - 1)
    labels = torch.gather(input_ids, 1, gather_pos)
    supervised = torch.gather(loss_mask, 1, gather_pos) & in_row & keep[:, block_of_query]
    weights = slot_decay(block_size, gamma)[k][None, :] * supervised.float()
    block_ids = torch.where(k[None, :] == 0, labels, torch.full_like(labels, mask_token_id))

    return BlockBatch(
        input_ids=input_ids,
        attention_mask_context=real,
        context_positions=torch.arange(s).expand(b, s).clone(),
        anchors=anchors,
        keep=keep,
        block_ids=block_ids,
        block_positions=block_positions,
        labels=labels,
        weights=weights,
        block_size=block_size,
        attention=attention,
    )


def teacher_forced_tau(leading: Sequence[float], blocks: float) -> float:
    """tau estimate of drafted blocks, teacher forced: 1 + the mean over `blocks` of how many slots from slot 1 on were all
    right (`leading[k]`: the blocks whose slots 1..k+1 all were). What a greedy verify accepts of them when the target's
    next tokens are the row's; taken block by block, since a slot is right far more often after right slots before it
    than its share over all blocks says (a product of per-slot accuracies reads well below decoding)."""
    return 1.0 + float(sum(leading)) / blocks if blocks > 0 else 1.0


__all__ = [
    "BlockBatch",
    "anchor_generator",
    "block_attention_mask",
    "build_block_batch",
    "eligible_anchors",
    "sample_anchors",
    "slot_decay",
    "teacher_forced_tau",
]
