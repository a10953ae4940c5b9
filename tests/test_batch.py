"""Batch construction and loss conventions of docs/DFLASH.md, pinned without a model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from blockdraft.stages.train.data import (
    anchor_generator,
    block_attention_mask,
    build_block_batch,
    eligible_anchors,
    sample_anchors,
    slot_decay,
    teacher_forced_tau,
)
from blockdraft.stages.train.loss import block_loss

MASK = 99


def test_eligible_anchors_need_both_p_and_p_plus_1_supervised():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1])
    # p=2,3 (p+1 supervised); p=4 no (5 unsupervised); p=6; p=9 is the last position (no p+1).
    assert eligible_anchors(mask).tolist() == [2, 3, 6]


def test_sample_anchors_without_replacement_sorted_and_padded():
    mask = torch.ones(40, dtype=torch.long)
    anchors, keep = sample_anchors(mask, 10, anchor_generator(0, 0, 0))
    assert keep.all()
    assert anchors.tolist() == sorted(set(anchors.tolist()))
    assert anchors.max() <= 38
    short = torch.tensor([0, 1, 1, 1])
    anchors, keep = sample_anchors(short, 5, anchor_generator(0, 0, 0))
    assert anchors[:2].tolist() == [1, 2] and keep.tolist() == [True, True, False, False, False]


def test_anchors_resampled_each_epoch_and_reproducible():
    mask = torch.ones(200, dtype=torch.long)
    e0 = sample_anchors(mask, 16, anchor_generator(7, 0, 3))[0]
    again = sample_anchors(mask, 16, anchor_generator(7, 0, 3))[0]
    e1 = sample_anchors(mask, 16, anchor_generator(7, 1, 3))[0]
    other_row = sample_anchors(mask, 16, anchor_generator(7, 0, 4))[0]
    assert torch.equal(e0, again)
    assert not torch.equal(e0, e1)
    assert not torch.equal(e0, other_row)


def test_large_seeds_are_accepted():
    mask = torch.ones(50, dtype=torch.long)
    assert sample_anchors(mask, 4, anchor_generator(2**62, 10**6, 10**9))[1].all()


def test_anchor_sampling_is_uniform_over_eligible_positions():
    mask = torch.tensor([0] * 5 + [1] * 20)
    counts = torch.zeros(25)
    for epoch in range(400):
        anchors, _ = sample_anchors(mask, 4, anchor_generator(1, epoch, 0))
        counts[anchors] += 1
    eligible = counts[5:24]
    assert counts[:5].sum() == 0 and counts[24] == 0
    expected = 400 * 4 / 19
    assert (eligible - expected).abs().max() < 0.35 * expected


def test_mask_context_strictly_before_anchor_own_block_bidirectional():
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, True]])
    b = 3
    m = block_attention_mask(anchors, keep, context_len=8, block_size=b)[0, 0]  # [6, 14]
    ctx, blk = m[:, :8], m[:, 8:]
    for q in range(6):
        n = q // b
        a = anchors[0, n].item()
        assert ctx[q].tolist() == [j < a for j in range(8)], "context must be strictly before the anchor"
        assert blk[q].tolist() == [j // b == n for j in range(6)], "own block only, both directions"


def test_padded_block_sees_its_own_block_only_and_no_row_is_empty():
    anchors = torch.tensor([[3, 0]])
    keep = torch.tensor([[True, False]])
    m = block_attention_mask(anchors, keep, context_len=6, block_size=2)[0, 0]
    assert not m[2:, :6].any()
    assert m[2:, 6:].tolist() == [[False, False, True, True]] * 2
    assert m.any(dim=-1).all()


def test_labels_positions_and_decayed_weights():
    ids = list(range(10, 22))  # token at position p is 10 + p
    loss_mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1]
    gamma = 2.0
    batch = build_block_batch(
        [(ids, loss_mask)], num_anchors=64, block_size=4, mask_token_id=MASK, gamma=gamma,
        generators=[anchor_generator(0, 0, 0)]
    )
    assert batch.anchors[0].tolist() == [3, 4, 5, 6, 7, 8]  # all eligible, N capped at their count
    for n, a in enumerate(batch.anchors[0].tolist()):
        sl = slice(4 * n, 4 * n + 4)
        assert batch.block_ids[0, sl].tolist() == [10 + a, MASK, MASK, MASK]
        assert batch.block_positions[0, sl].tolist() == [a, a + 1, a + 2, a + 3]
        # Same-position prediction: slot k predicts the token at anchor + k.
        for k in range(4):
            p = a + k
            if p < len(ids):
                assert batch.labels[0, 4 * n + k] == 10 + p
            expected = 0.0 if k == 0 or p >= len(ids) or not loss_mask[p] else math.exp(-(k - 1) / gamma)
            assert batch.weights[0, 4 * n + k].item() == pytest.approx(expected)


def test_slot_decay_defaults():
    d = slot_decay(16, 7.0)
    assert d[0] == 0 and d[1] == 1 and d[15].item() == pytest.approx(math.exp(-2.0))


def test_short_row_gets_zero_weight_padded_blocks():
    long = ([1] * 30, [1] * 30)
    short = ([2] * 5, [0, 0, 1, 1, 1])
    batch = build_block_batch(
        [long, short], num_anchors=8, block_size=4, mask_token_id=MASK, gamma=3.0,
        generators=[anchor_generator(0, 0, 0), anchor_generator(0, 0, 1)],
    )
    assert batch.anchors.shape[1] == 8
    assert batch.keep[1].tolist() == [True, True] + [False] * 6
    assert batch.weights[1, 8:].abs().sum() == 0
    assert batch.num_tokens == 35
    # The short row's context padding (positions 5..29) is never attended.
    assert not batch.attention_mask[1, 0, :, 5:30].any()


def test_teacher_forced_tau_counts_each_blocks_leading_right_slots():
    assert teacher_forced_tau([], 0) == 1.0
    assert teacher_forced_tau([4.0, 4.0, 4.0], 4) == 4.0
    # Two blocks, one right in every slot and one wrong in every slot: each slot is right half the time, and the blocks
    # accept 3 and 0 drafts, tau 2.5; the product of the per-slot accuracies would say 1 + 0.5 + 0.25 + 0.125.
    assert teacher_forced_tau([1.0, 1.0, 1.0], 2) == 2.5


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_equals_dense_loss_and_gradient(bias):
    torch.manual_seed(0)
    b, n, bs, h, v = 2, 5, 4, 8, 33
    head = torch.nn.Linear(h, v, bias=bias).requires_grad_(False)
    hidden = torch.randn(b, n * bs, h, requires_grad=True)
    labels = torch.randint(0, v, (b, n * bs))
    weights = torch.rand(b, n * bs) * (torch.arange(n * bs) % bs != 0)
    out = block_loss(hidden, labels, weights, head.weight, head.bias, block_size=bs, chunk_blocks=2)
    out.loss.backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    dense = (
        weights * F.cross_entropy(head(hidden).reshape(-1, v), labels.reshape(-1), reduction="none").reshape(b, -1)
    ).sum()
    dense = dense / weights.sum()
    dense.backward()
    assert out.loss.item() == pytest.approx(dense.item(), rel=1e-6)
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-7)
    acc = (head(hidden).argmax(-1) == labels).float().reshape(b * n, bs)[:, 1:]
    sup = (weights.reshape(b * n, bs)[:, 1:] > 0).float()
    assert torch.allclose(out.slots.correct, (acc * sup).sum(0))
    assert torch.allclose(out.slots.total, sup.sum(0))
    assert torch.allclose(out.slots.leading, (acc * sup).cumprod(dim=1).sum(0))


def test_all_padded_batch_has_zero_finite_loss():
    head = torch.nn.Linear(4, 7, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    out = block_loss(hidden, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8), head.weight, None, block_size=4,
                     chunk_blocks=1)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(hidden.grad).all()
