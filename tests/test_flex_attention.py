"""The block-sparse (FlexAttention) training attention against the dense mask, its reference.

The BlockMask, expanded entry by entry, is the dense mask exactly (full and sliding layers, padded blocks, lengths that
are not tile multiples); the drafter's loss and every gradient are the dense path's (fp32, 1e-5); the compiled kernel
gives the dense forward and keeps each block blind to features at and after its anchor. Gradients use torch's eager
FlexAttention: the fused CPU kernel has no backward, and torch refuses CPU inputs that require grad, a guard these tests
lift.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.paths import GOLDEN
from torch.nn.attention import flex_attention as flex_attention_module
from torch.nn.attention.flex_attention import BlockMask

from blockdraft.config import BlockdraftConfig
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec, block_sparse
from blockdraft.model.block_sparse import TILE, AnchorLayout, resolve_attention
from blockdraft.stages.train.data import anchor_generator, block_attention_mask, build_block_batch
from blockdraft.stages.train.loss import block_loss
from blockdraft.stages.train.step import DraftForward

S, F = "sliding_attention", "full_attention"


def _spec(layer_types: list[str], window: int | None) -> DrafterSpec:
    base = DrafterSpec.from_export_config(json.loads((GOLDEN / "drafter" / "config.json").read_text()))
    return dataclasses.replace(base, layer_types=layer_types, sliding_window=window)


def _drafter(layer_types: list[str], window: int | None) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(_spec(layer_types, window))
    with torch.no_grad():  # norms away from 1 so every weight matters
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter


def _rows(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random ids; loss on all but the first 3 positions, and on nothing in the middle third of every other row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        mask = torch.arange(n) >= 3
        if i % 2:
            mask[n // 3 : 2 * n // 3] = False
        rows.append((torch.randint(0, 500, (n,), generator=g), mask))
    return rows


def _batch(lengths: list[int], num_anchors: int, spec: DrafterSpec, attention: str, seed: int = 0):
    return build_block_batch(
        _rows(lengths, seed), num_anchors=num_anchors, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
        gamma=3.0, generators=[anchor_generator(seed, 0, i) for i in range(len(lengths))],
        attention=attention,  # type: ignore[arg-type]
    )


def _expanded(mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The BlockMask entry by entry [b, 1, Q, S+Q] (a full tile allows all of it, a partial tile what mask_mod allows,
    any other tile nothing), and its tiles [b, partial/full, Q tiles, KV tiles]."""
    q, kv = mask.seq_lengths
    b = mask.kv_num_blocks.shape[0]
    tiles = torch.zeros(b, 2, -(-q // TILE), -(-kv // TILE), dtype=torch.bool)  # [b, partial/full, Q tiles, KV tiles]
    for kind, (count, index) in enumerate(((mask.kv_num_blocks, mask.kv_indices),
                                           (mask.full_kv_num_blocks, mask.full_kv_indices))):
        assert count is not None and index is not None
        for r in range(b):
            for t in range(tiles.shape[2]):
                tiles[r, kind, t, index[r, 0, t, : count[r, 0, t]].long()] = True
    assert not (tiles[:, 0] & tiles[:, 1]).any(), "a tile listed both partial and full"
    element = tiles.repeat_interleave(TILE, 2).repeat_interleave(TILE, 3)[:, :, :q, :kv]
    rows, cols = torch.arange(q)[None, :, None], torch.arange(kv)[None, None, :]
    allowed = mask.mask_mod(torch.arange(b)[:, None, None], torch.zeros(()), rows, cols)
    return (element[:, 1] | (element[:, 0] & allowed))[:, None], tiles


@pytest.mark.parametrize("window", [None, 24, 200])
def test_block_mask_is_the_dense_mask_entry_by_entry(window):
    """Rows of uneven length (padded context, padded blocks), Q and S+Q not tile multiples, and anchors on tile edges
    (query tiles are 32 blocks of 4): row 0's first query tile needs key tile [128, 256) for key 128 only (anchor 129),
    and its second one, lowest anchor 255, leaves that tile one key short of full; row 2 has whole context tiles full;
    row 3 puts a window's first key on a tile's last key (window 24: anchor 150) and one key past a tile's first (window
    200: anchor 197, slot 3)."""
    size, s, n = 4, 419, 70
    assert n > 2 * TILE // size  # three query tiles, the last one ragged
    g = torch.Generator().manual_seed(3)

    def between(low: int, high: int, count: int) -> torch.Tensor:
        return torch.randint(low, high, (count,), generator=g).sort().values

    def at(*values: int) -> torch.Tensor:
        return torch.tensor(values)

    anchors = torch.stack([
        torch.cat([between(1, 128, 31), at(129, 255), between(256, 410, 31), between(410, 418, 6)]),
        torch.cat([between(1, 60, 20), torch.zeros(n - 20, dtype=torch.long)]),
        torch.cat([at(256), between(256, 418, 69)]),
        torch.cat([at(150), between(150, 197, 30), at(197), between(197, 418, 38)]),
    ])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    keep[1, 20:] = False
    layout = AnchorLayout(anchors, keep, s, size)
    expanded, tiles = _expanded(layout.block_mask(window))
    dense = block_attention_mask(anchors, keep, s, size, sliding_window=window)
    assert torch.equal(expanded, dense)
    assert not tiles.any(1).all(), "no tile skipped: the mask would not be sparse"
    if window is None:
        assert (tiles[2, 1, 0, :2].all() and tiles[0, 1, 1, 0]
                and not tiles[0, 1, 1, 1]), "full where every key is seen, only there"


def test_a_tile_list_that_misses_a_visited_tile_is_caught():
    """Control for the test above: the same mask without its partial tiles no longer expands to the dense mask."""
    layout = AnchorLayout(torch.tensor([[130, 140, 300]]), torch.tensor([[True, True, True]]), 320, 4)
    mask = layout.block_mask()
    assert torch.equal(_expanded(mask)[0], block_attention_mask(layout.anchors, layout.keep, 320, 4))
    dropped = BlockMask.from_kv_blocks(
        torch.zeros_like(mask.kv_num_blocks), mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        BLOCK_SIZE=(TILE, TILE), mask_mod=mask.mask_mod, seq_lengths=mask.seq_lengths,
    )
    assert not torch.equal(_expanded(dropped)[0], block_attention_mask(layout.anchors, layout.keep, 320, 4))


@pytest.fixture
def eager_flex_with_grad(monkeypatch):
    """torch's eager FlexAttention (scores materialised, the mask applied entry by entry) with its CPU-backward guard
    lifted: the mask's semantics and gradients, on a machine without the fused kernel's backward."""
    monkeypatch.setattr(block_sparse, "COMPILE_FLEX", False)
    monkeypatch.setattr(flex_attention_module, "_validate_device", lambda *tensors: None)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layer_types", [[F, F, F], [S, F, S]])
def test_flex_and_dense_give_equal_loss_and_gradients(eager_flex_with_grad, layer_types):
    """fp32, GQA (4 query heads on 2 KV heads), three rows of uneven length: padded context and padded blocks."""
    drafter = _drafter(layer_types, 24 if S in layer_types else None)
    spec = drafter.spec
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
    head = torch.randn(spec.vocab_size, spec.hidden_size, generator=g) * 0.1
    assert spec.num_attention_heads == 2 * spec.num_key_value_heads
    results = {}
    for attention in ("dense", "flex"):
        batch = _batch([150, 61, 23], 40, spec, attention)
        assert not batch.keep.all() and batch.anchors.shape[1] * spec.block_size > TILE
        features = torch.randn(3, batch.input_ids.shape[1], spec.num_target_features * spec.hidden_size,
                               generator=g.manual_seed(2))
        hidden = DraftForward(drafter)(features, embed[batch.block_ids], batch.block_positions, batch.context_positions,
                                       batch.drafter_attention)
        out = block_loss(hidden, batch.labels, batch.weights, head, None, spec.block_size, 8)
        drafter.zero_grad(set_to_none=True)
        out.loss.backward()
        results[attention] = (
            out.loss.detach(),
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
        )
    (dense_loss, dense_grads), (flex_loss, flex_grads) = results["dense"], results["flex"]
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-5, atol=0)
    assert dense_grads.keys() == flex_grads.keys() and len(dense_grads) == len(list(drafter.parameters()))
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compiled_kernel_equals_dense_and_keeps_blocks_blind_past_their_anchor():
    """The fused kernel (compiled for the CPU, forward only) reads the tile lists, so this checks them in a real kernel:
    same hidden states as the dense path, full and sliding layers; features at or after a block's anchor cannot reach
    it."""
    drafter = _drafter([S, F, S], 24).eval()
    spec = drafter.spec
    g = torch.Generator().manual_seed(4)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
    (ids, _), short = _rows([300, 140], seed=5)
    batch = build_block_batch(  # row 0 anchors from 140 on, so its first context tile is full for every query tile
        [(ids, torch.arange(300) >= 140), short], num_anchors=64, block_size=spec.block_size,
        mask_token_id=spec.mask_token_id, gamma=3.0, generators=[anchor_generator(5, 0, i) for i in range(2)],
        attention="flex",
    )
    assert batch.layout.block_mask().full_kv_num_blocks[0].min() >= 1  # type: ignore[union-attr]
    features = torch.randn(2, 300, spec.num_target_features * spec.hidden_size, generator=g)

    def run(feats, attention):
        with torch.no_grad():
            return DraftForward(drafter)(feats, embed[batch.block_ids], batch.block_positions, batch.context_positions,
                                         attention)

    flex = run(features, batch.layout)
    torch.testing.assert_close(flex, run(features, batch.attention_mask), rtol=1e-5, atol=1e-5)
    size, n = spec.block_size, 40
    anchor = int(batch.anchors[0, n])
    assert anchor > TILE + 1 and batch.keep[0, n]
    own = slice(n * size, (n + 1) * size)
    later = features.clone()
    later[0, anchor:] += torch.randn_like(later[0, anchor:])
    torch.testing.assert_close(run(later, batch.layout)[0, own], flex[0, own], atol=0, rtol=0)
    earlier = features.clone()
    earlier[0, anchor - 1] += 1.0
    assert (run(earlier, batch.layout)[0, own] - flex[0, own]).abs().max() > 1e-3


def test_flex_batches_hand_the_drafter_the_layout_and_never_build_the_dense_mask(monkeypatch):
    spec = _spec([F, F, F], None)
    batch = _batch([40, 12], 8, spec, "flex")
    monkeypatch.setattr("blockdraft.stages.train.data.block_attention_mask",
                        lambda *a, **k: pytest.fail("dense mask built"))
    layout = batch.drafter_attention
    assert isinstance(layout, AnchorLayout) and layout.context_len == 40 and torch.equal(layout.anchors, batch.anchors)


def test_train_attention_choice():
    assert BlockdraftConfig.model_validate({}).train.attention == "auto"
    assert resolve_attention("auto", torch.device("cpu")) == "dense"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention("dense", torch.device("cuda", 0)) == "dense"
    with pytest.raises(ConfigError, match="train.attention = 'flex' needs a CUDA drafter device"):
        resolve_attention("flex", torch.device("cpu"))
