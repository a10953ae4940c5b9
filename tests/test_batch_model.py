"""The training forward against the decode-time draft step, on the golden target and drafter (fp32).

Parity: a training forward with an anchor at p over context 0..p-1 gives the draft step's logits at p. Leak: the
target features at positions >= the anchor cannot reach that block. Padding: mixing a short and a long row changes
nothing but the (global) normaliser.
"""

from __future__ import annotations

import pytest
import torch
from helpers.paths import GOLDEN
from safetensors.torch import load_file

from blockdraft.model import DFlashDrafter, DraftCache, TargetHead, TargetModel, draft_step, load_target
from blockdraft.stages.train.data import anchor_generator, build_block_batch, sample_anchors
from blockdraft.stages.train.loss import block_loss
from blockdraft.stages.train.step import DraftForward


@pytest.fixture(scope="module")
def golden():
    hf = load_target(str(GOLDEN / "target"), "cpu", torch.float32, attn_implementation="eager")
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()
    target = TargetModel(hf, drafter.spec.target_layer_ids)
    return drafter, target, TargetHead.from_target(hf)


def _row(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (length,), generator=g)


def _training_forward(drafter, head, features, batch):
    block_hidden = head.embed(batch.block_ids)
    return DraftForward(drafter)(features, block_hidden, batch.block_positions, batch.context_positions,
                                 batch.attention_mask)


def _batch(rows, masks, num_anchors, spec, epoch=0):
    return build_block_batch(
        list(zip(rows, masks, strict=True)), num_anchors=num_anchors, block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        gamma=3.0, generators=[anchor_generator(0, epoch, i) for i in range(len(rows))],
    )


def test_training_forward_equals_draft_step_at_every_anchor(golden):
    drafter, target, head = golden
    spec = drafter.spec
    ids = _row(40, 1)
    mask = torch.ones(40, dtype=torch.long)
    mask[:5] = 0
    batch = _batch([ids], [mask], 6, spec)
    features = target.features(batch.input_ids)
    with torch.no_grad():
        train_logits = head.logits(_training_forward(drafter, head, features, batch))  # [1, N*B, V]
    b = spec.block_size
    assert batch.keep.all() and batch.anchors.shape[1] == 6
    for n, p in enumerate(batch.anchors[0].tolist()):
        block = torch.tensor([[int(ids[p])] + [spec.mask_token_id] * (b - 1)])
        hidden = draft_step(drafter, DraftCache(), features[:, :p], head.embed(block), start=p)
        decode_logits = head.logits(hidden)[0]
        torch.testing.assert_close(train_logits[0, n * b : (n + 1) * b], decode_logits, atol=2e-5, rtol=1e-5)
        # The anchor's own label is itself and slot k predicts position p + k (same-position prediction).
        assert batch.labels[0, n * b : (n + 1) * b].tolist() == ids[p : p + b].tolist()


def test_draft_step_reproduces_golden_logits_through_training_path(golden):
    """The golden step (anchor 11, context 0..10) computed by the training forward; ties train to the reference
    engine."""
    drafter, target, head = golden
    spec = drafter.spec
    gold = load_file(str(GOLDEN / "golden.safetensors"))
    ids = torch.cat([gold["context_ids"][0], gold["anchor_id"], torch.zeros(spec.block_size - 1, dtype=torch.long)])
    mask = torch.zeros(ids.numel(), dtype=torch.long)
    mask[11:13] = 1  # the only eligible anchor is 11
    batch = _batch([ids], [mask], 1, spec)
    assert batch.anchors.tolist() == [[11]]
    features = target.features(batch.input_ids)
    torch.testing.assert_close(features[:, :11], gold["target_features"], atol=1e-4, rtol=1e-4)
    # The reference's own features for 0..10, and noise where the mask must hide the anchor and what follows it.
    features = torch.cat([gold["target_features"], torch.randn(1, ids.numel() - 11, features.shape[-1])], dim=1)
    with torch.no_grad():
        hidden = _training_forward(drafter, head, features, batch)
    torch.testing.assert_close(hidden, gold["draft_hidden"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(hidden[:, 1:]), gold["draft_logits"], atol=1e-4, rtol=1e-5)


def test_features_at_or_after_anchor_cannot_reach_its_block(golden):
    drafter, target, head = golden
    spec = drafter.spec
    ids = _row(30, 2)
    batch = _batch([ids], [torch.ones(30, dtype=torch.long)], 4, spec)
    features = target.features(batch.input_ids)
    b = spec.block_size
    with torch.no_grad():
        base = _training_forward(drafter, head, features, batch)
        for n, p in enumerate(batch.anchors[0].tolist()):
            own = slice(n * b, (n + 1) * b)
            later = features.clone()
            later[:, p:] += torch.randn_like(later[:, p:])  # the anchor's own features and everything after
            torch.testing.assert_close(_training_forward(drafter, head, later, batch)[:, own], base[:, own], atol=0,
                                       rtol=0)
            earlier = features.clone()
            earlier[:, p - 1] += 1.0
            changed = _training_forward(drafter, head, earlier, batch)[:, own]
            assert (changed - base[:, own]).abs().max() > 1e-3


def test_short_and_long_rows_give_the_loss_of_each_alone_globally_normalised(golden):
    drafter, target, head = golden
    spec = drafter.spec
    long_ids, short_ids = _row(36, 3), _row(9, 4)
    long_mask = torch.ones(36, dtype=torch.long)
    short_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])

    def loss_of(rows, masks, gens):
        batch = build_block_batch(list(zip(rows, masks, strict=True)), num_anchors=8, block_size=spec.block_size,
                                  mask_token_id=spec.mask_token_id, gamma=3.0, generators=gens)
        features = target.features(batch.input_ids, batch.attention_mask_context.long())
        hidden = _training_forward(drafter, head, features, batch)
        return block_loss(hidden, batch.labels, batch.weights, head.lm_head_weight, None, spec.block_size,
                          chunk_blocks=3), batch

    both, batch = loss_of([short_ids, long_ids], [short_mask, long_mask],
                          [anchor_generator(0, 0, 0), anchor_generator(0, 0, 1)])
    assert not batch.keep[0].all(), "the short row must get padded blocks"
    short, _ = loss_of([short_ids], [short_mask], [anchor_generator(0, 0, 0)])
    long, _ = loss_of([long_ids], [long_mask], [anchor_generator(0, 0, 1)])
    assert torch.isfinite(both.loss)
    expected = (short.weighted_ce + long.weighted_ce) / (short.weight_sum + long.weight_sum)
    torch.testing.assert_close(both.loss.detach(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(both.weight_sum, short.weight_sum + long.weight_sum)
    torch.testing.assert_close(both.slots.total, short.slots.total + long.slots.total)
    both.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
    drafter.zero_grad(set_to_none=True)


def test_anchors_of_a_training_row_stay_inside_its_supervised_span():
    mask = torch.tensor([0] * 10 + [1] * 10 + [0] * 5)
    anchors, keep = sample_anchors(mask, 20, anchor_generator(3, 0, 0))
    assert keep.sum() == 9 and anchors[keep].min() == 10 and anchors[keep].max() == 18
