"""Sliding-window drafter layers: the spec's rules, the training mask, and parity of the packed training forward with
the cached draft step (fp32, 1e-5), with controls showing that the window and the causality inside the block matter.

A sliding layer with window W is causal: the query at position q sees keys at q - W < k <= q (SGLang, vLLM).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.paths import GOLDEN

from blockdraft.config import DFlashConfig
from blockdraft.errors import SpecError
from blockdraft.model import DFlashDrafter, DraftCache, DrafterSpec, draft_step
from blockdraft.model.attention import sliding_window_mask
from blockdraft.stages.train.data import anchor_generator, block_attention_mask, build_block_batch
from blockdraft.stages.train.step import DraftForward

S, F = "sliding_attention", "full_attention"


def _spec(layer_types: list[str], window: int | None) -> DrafterSpec:
    base = DrafterSpec.from_export_config(json.loads((GOLDEN / "drafter" / "config.json").read_text()))
    return dataclasses.replace(base, layer_types=layer_types, sliding_window=window)


def _drafter(layer_types: list[str], window: int | None, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(_spec(layer_types, window)).eval()
    with torch.no_grad():  # norms away from 1 so every weight matters
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter


def _same_weights(source: DFlashDrafter, layer_types: list[str], window: int | None) -> DFlashDrafter:
    other = DFlashDrafter(_spec(layer_types, window)).eval()
    other.load_state_dict(source.state_dict())
    return other


def _inputs(length: int, seed: int = 1):
    """Random target features [1, S, K*H], a row of ids, and a fixed random embedding table for block tokens."""
    g = torch.Generator().manual_seed(seed)
    spec = _spec([F, F, F], None)
    features = torch.randn(1, length, spec.num_target_features * spec.hidden_size, generator=g)
    ids = torch.randint(0, 500, (length,), generator=g)
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(spec.vocab_size, spec.hidden_size, generator=g))
    return features, ids, embed


def _batch(rows, num_anchors: int, spec: DrafterSpec):
    """Loss on every position but the first, so every anchor has context (a draft step needs one)."""
    masks = [torch.arange(len(ids)) > 0 for ids in rows]
    return build_block_batch(
        list(zip(rows, masks, strict=True)), num_anchors=num_anchors, block_size=spec.block_size,
        mask_token_id=spec.mask_token_id, gamma=3.0, generators=[anchor_generator(0, 0, i) for i in range(len(rows))],
    )


def _train_hidden(drafter, features, embed, batch):
    with torch.no_grad():
        return DraftForward(drafter)(features, embed(batch.block_ids), batch.block_positions, batch.context_positions,
                                     batch.attention_mask)


def _step_hidden(drafter, features, embed, ids, p):
    block = torch.tensor([[int(ids[p])] + [drafter.spec.mask_token_id] * (drafter.spec.block_size - 1)])
    return draft_step(drafter, DraftCache(), features[:, :p], embed(block), start=p)


# --- the spec ---------------------------------------------------------------------------------------------------------

def test_spec_refuses_bad_layer_types_and_windows():
    with pytest.raises(SpecError, match="2 entries for 3 drafter layers"):
        _spec([S, F], 6)
    with pytest.raises(SpecError, match="unknown kind 'linear_attention'"):
        _spec([S, "linear_attention", F], 6)
    with pytest.raises(SpecError, match="sliding_window is None"):
        _spec([S, F, F], None)
    with pytest.raises(SpecError, match="at least block_size 4"):
        _spec([S, F, F], 3)
    with pytest.raises(SpecError, match="no layer is sliding_attention"):
        _spec([F, F, F], 8)
    assert _spec([], None).layer_types == [F, F, F]  # empty: all full attention


def test_from_target_config_takes_layer_types_from_dflash_config():
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(GOLDEN / "target")
    cfg = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=3, gamma=3.0,
                       layer_types=[S, S, F], sliding_window=16)
    spec = DrafterSpec.from_target_config(target, cfg)
    assert spec.layer_types == [S, S, F] and spec.sliding_window == 16 and spec.rope_scaling is None
    default = DrafterSpec.from_target_config(
        target, DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=3, gamma=3.0))
    assert default.layer_types == [F, F, F] and default.sliding_window is None


# --- the training mask ------------------------------------------------------------------------------------------------

def test_sliding_training_mask_is_the_engines_rule():
    """Every entry against the rule written out: full layers see their anchor's prefix and their own block; sliding =
    that AND q - W < key <= q."""
    anchors, keep = torch.tensor([[3, 9, 15], [5, 0, 0]]), torch.tensor([[True, True, True], [True, False, False]])
    b_size, ctx_len, window = 4, 20, 6
    full = block_attention_mask(anchors, keep, ctx_len, b_size)
    sliding = block_attention_mask(anchors, keep, ctx_len, b_size, sliding_window=window)
    for r in range(2):
        for qi in range(3 * b_size):
            n, k = divmod(qi, b_size)
            a, q = int(anchors[r, n]), int(anchors[r, n]) + k
            for c in range(ctx_len):
                assert bool(full[r, 0, qi, c]) == (bool(keep[r, n]) and c < a)
                assert bool(sliding[r, 0, qi, c]) == (bool(keep[r, n]) and q - window < c < a)
            for kj in range(3 * b_size):
                m, j = divmod(kj, b_size)
                assert bool(full[r, 0, qi, ctx_len + kj]) == (m == n)
                assert bool(sliding[r, 0, qi, ctx_len + kj]) == (m == n and j <= k)
    assert sliding.sum(-1).min() >= 1  # padded blocks still see their own anchor slot: no all-masked row


def test_sliding_window_mask_bounds():
    q = torch.tensor([[10]])
    keys = torch.arange(14)[None]
    assert sliding_window_mask(q, keys, 4)[0, 0, 0].nonzero().flatten().tolist() == [7, 8, 9, 10]


# --- parity of the training forward with the draft step ---------------------------------------------------------------

def test_training_forward_equals_draft_step_with_sliding_and_full_layers():
    drafter = _drafter([S, F, S], 6)
    features, ids, embed = _inputs(28)
    batch = _batch([ids], 5, drafter.spec)
    train = _train_hidden(drafter, features, embed, batch)
    b = drafter.spec.block_size
    anchors = batch.anchors[0].tolist()
    assert batch.keep.all() and max(anchors) > 12  # the window (6) really cuts the context of later anchors
    for n, p in enumerate(anchors):
        step = _step_hidden(drafter, features, embed, ids, p)
        torch.testing.assert_close(train[:, n * b:(n + 1) * b], step, atol=1e-5, rtol=1e-5)
    # negative control: the same weights with every layer full give other outputs, in training and in the draft step
    full = _same_weights(drafter, [F, F, F], None)
    full_train = _train_hidden(full, features, embed, batch)
    assert (full_train - train).abs().max() > 1e-3
    p = anchors[-1]
    assert (
        _step_hidden(full, features, embed, ids, p) - _step_hidden(drafter, features, embed, ids, p)
    ).abs().max() > 1e-3


def test_padded_rows_and_packed_blocks_stay_finite_and_match():
    """Two rows of different lengths: the short row's padded blocks see only themselves, and each real block of either
    row still equals its draft step."""
    drafter = _drafter([S, F, S], 6, seed=3)
    features, ids, embed = _inputs(30, seed=4)
    short = ids[:5]
    batch = _batch([ids, short], 6, drafter.spec)
    assert not batch.keep[1].all()
    feats = torch.cat([features, features], dim=0)  # row 1 reads only positions below its anchors (all < 5)
    train = _train_hidden(drafter, feats, embed, batch)
    assert torch.isfinite(train).all()
    b = drafter.spec.block_size
    for row, seq in ((0, ids), (1, short)):
        for n, (p, kept) in enumerate(zip(batch.anchors[row].tolist(), batch.keep[row].tolist(), strict=True)):
            if kept:
                step = _step_hidden(drafter, features, embed, seq, p)
                torch.testing.assert_close(train[row:row + 1, n * b:(n + 1) * b], step, atol=1e-5, rtol=1e-5)


def test_cached_draft_step_in_pieces_equals_one_step():
    drafter = _drafter([S, F, S], 6, seed=5)
    features, ids, embed = _inputs(24, seed=6)
    block = embed(torch.tensor([[int(ids[20])] + [drafter.spec.mask_token_id] * 3]))
    whole = draft_step(drafter, DraftCache(), features[:, :20], block, start=20)
    cache = DraftCache()
    draft_step(drafter, cache, features[:, :9], block, start=9)
    pieces = draft_step(drafter, cache, features[:, 9:20], block, start=20)
    torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=1e-6)


# --- what a sliding layer is ------------------------------------------------------------------------------------------

def test_wide_sliding_layer_is_causal_attention_not_full():
    """With W >= context + block the window cuts nothing: a sliding drafter then equals the all-full drafter given a
    causal block mask (so the sliding layer is causal inside the block), and differs from the plain full drafter."""
    drafter = _drafter([S, S, S], 64, seed=7)
    full = _same_weights(drafter, [F, F, F], None)
    features, ids, embed = _inputs(20, seed=8)
    p, b = 16, drafter.spec.block_size
    sliding_out = _step_hidden(drafter, features, embed, ids, p)
    causal = torch.ones(1, 1, b, p + b, dtype=torch.bool)
    causal[..., p:] = torch.ones(b, b, dtype=torch.bool).tril()
    block = embed(torch.tensor([[int(ids[p])] + [drafter.spec.mask_token_id] * (b - 1)]))
    with torch.no_grad():
        ctx = full.project_context(features[:, :p])
        positions = torch.arange(p + b)[None]
        causal_out = full(block, ctx, positions[:, p:], positions[:, :p], causal)
    torch.testing.assert_close(sliding_out, causal_out, atol=1e-5, rtol=1e-5)
    assert (_step_hidden(full, features, embed, ids, p) - sliding_out).abs().max() > 1e-3
    # and the window matters: W = 6 cuts the context of this anchor
    narrow = _same_weights(drafter, [S, S, S], 6)
    assert (_step_hidden(narrow, features, embed, ids, p) - sliding_out).abs().max() > 1e-3
