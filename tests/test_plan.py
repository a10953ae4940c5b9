"""The memory plan: printed from the target's config.json alone, equal to the hand calculation of docs/PERFORMANCE.md
for the Qwen3.6-27B example of docs/HYBRID.md, refused in one line when it does not fit; the activation estimate against
what autograd really keeps; activation checkpointing and the bf16 gradient all-reduce (gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.s3server import free_ports
from torch import nn
from torch.multiprocessing.spawn import spawn
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.stages.train.data import block_attention_mask
from blockdraft.stages.train.loss import block_loss
from blockdraft.stages.train.memory import CUDA_RUNTIME_BYTES, apply_memory_options, drafter_activations, memory_plan
from blockdraft.stages.train.ranks import allreduce_hook_for, bf16_allreduce_hook, register_grad_allreduce
from blockdraft.stages.train.step import DraftForward

QWEN36 = Path(__file__).parent / "fixtures" / "qwen3.6-27b"  # its config.json only: no weights exist to load
GB = 1e9


def readme_config(tmp_path: Path, targets: list[str], drafters: list[str], memory_gb: float | None = 80,
                  **train) -> Path:
    """The Qwen3.6-27B example of docs/HYBRID.md (target on two GPUs, one drafter rank on each of two others) as a TOML
    file."""
    extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in train.items())
    memory = f"device_memory_gb = {memory_gb}\n" if memory_gb is not None else ""
    path = tmp_path / "blockdraft.toml"
    path.write_text(
        f'[target]\npath = "{QWEN36.as_posix()}"\ndtype = "bfloat16"\n'
        '[dflash]\narchitecture = "dflash"\nblock_size = 16\nmask_token_id = 248070\nnum_draft_layers = 5\n'
        'layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", '
        '"full_attention"]\n'
        "sliding_window = 2048\n"
        f"[placement]\ntarget_devices = {json.dumps(targets)}\ndrafter_devices = {json.dumps(drafters)}\n"
        f'[train]\ndata = "s3://my-bucket/drafters/qwen3.6-27b/tokenized"\n{memory}{extra}'
    )
    return path


def hand_plan() -> dict[str, float]:
    """docs/PERFORMANCE.md's hand calculation from the fixture's config.json fields, in bytes per item."""
    text = json.loads((QWEN36 / "config.json").read_text())["text_config"]
    hidden, inner, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    heads, kv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv, dk, dv = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
                      text["linear_value_head_dim"])
    linear_layers = text["layer_types"].count("linear_attention")
    full_layers = text["layer_types"].count("full_attention")
    mlp, norms = 3 * hidden * inner, 2 * hidden
    conv = 2 * nk * dk + nv * dv
    linear_attn = (hidden * conv + hidden * nv * dv + 2 * hidden * nv + conv * text["linear_conv_kernel_dim"] + 2 * nv
                   + dv + nv * dv * hidden)
    # q_proj also holds the output gate
    full_attn = hidden * heads * d * 2 + 2 * hidden * kv * d + heads * d * hidden + 2 * d
    target_params = (
        2 * vocab * hidden + hidden + 64 * (mlp + norms) + linear_layers * linear_attn + full_layers * full_attn
    )
    n_feat, layers = 5, 5
    drafter_layer = hidden * heads * d + 2 * hidden * kv * d + heads * d * hidden + 2 * d + mlp + norms
    drafter_params = n_feat * hidden * hidden + 2 * hidden + layers * drafter_layer
    drafter_linear = drafter_params - 2 * hidden - layers * (2 * d + norms)
    b, s, q, a = 1, 3072, 512 * 16, 2
    keys = s + q
    per_query = (2 * (8 * hidden + 4) + 5 * hidden * a + heads * d * (4 + a) + 4 * heads + kv * d * (4 + a) + 4 * kv
                 + 2 * heads * d * a + 4 * heads + 4 * inner * a)  # flex attention on CUDA: no mask bias
    layer = b * (q * per_query + keys * 2 * kv * d * a + s * (kv * d * (4 + a) + 4 * kv + 2 * hidden * a))
    once = b * s * (n_feat * hidden * a + hidden * (4 + a) + 4 + 8 * d) + b * q * (8 * d + 12 * hidden + 4) + 4
    feat = b * s * n_feat * hidden
    micro = 32 // (b * 2) * 2  # global batch 32 over 2 ranks of batch b, and one more step queued (pipeline_depth 1)
    return {
        "target_params": target_params,
        "drafter_params": drafter_params,
        "target": (2 * target_params + 256 + b * s * (2 * n_feat * hidden + 4 * hidden + 3 * inner) * 2 + b * s * s * 2
                   + CUDA_RUNTIME_BYTES),
        "drafter": (16 * drafter_params + 4 * drafter_params + 2 * vocab * hidden * 2 + 2 * drafter_linear
                    + feat * (2 * micro + 4) + b * q * 4 * hidden + once + layers * layer - b * q * (4 * hidden + 4)
                    + layer + 1024 * vocab * 6 + CUDA_RUNTIME_BYTES),
    }


def totals(output: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+)\s+total\s+([\d.]+)", output, re.M)}


def test_train_plan_prints_the_readme_27b_plan_from_config_json_alone(tmp_path):
    config = readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--plan"])
    assert result.exit_code == 0, result.output
    hand = hand_plan()
    # counted on the meta device = the formula
    assert f"{hand['target_params']:,} parameters in bfloat16" in result.output
    assert f"drafter: {hand['drafter_params']:,} parameters" in result.output
    assert totals(result.output) == {
        device: round(hand[role] / GB, 2)
        for device, role in (("cuda:0", "target"), ("cuda:1", "target"), ("cuda:2", "drafter"), ("cuda:3", "drafter"))
    }
    assert result.output.count("of 80.00  fits") == 4 and "DDP gradient buckets" in result.output


def test_a_plan_that_does_not_fit_is_refused_in_one_line_before_anything_loads(tmp_path):
    config = readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], memory_gb=60)
    planned = CliRunner().invoke(app, ["train", "--config", str(config), "--plan"])
    assert planned.exit_code == 2 and "cuda:2   total" in planned.output  # the plan is printed, then refused
    errors = [line for line in planned.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in planned.output
    assert re.search(r"memory plan: cuda:2 needs 71\.10 GB \(activations kept for backward 15\.18, AdamW moments "
                     r"\(fp32, 2 per parameter\) 14\.68, .*\) but has 60\.00 GB; .*activation_checkpointing", errors[0])
    # A real run refuses at the same point: the target's weights and the training data (an unreachable bucket) are never
    # read.
    trained = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert (
        trained.exit_code == 2
        and "memory plan: cuda:2 needs 71.10 GB" in trained.output
        and "s3://" not in trained.output
    )


def test_ranks_sharing_one_target_device_hold_one_replica_each(tmp_path):
    one_card = load_config(readme_config(tmp_path, ["cuda:0"], ["cuda:1", "cuda:2"], memory_gb=None))
    plan = memory_plan(one_card)
    card = plan.devices[0]
    assert (card.device, card.target_replicas, card.items["target weights (bfloat16)"][1]) == ("cuda:0", 2, 2)
    assert any(line.startswith("note: cuda:0 holds 2 target replicas") for line in plan.lines())  # no capacity: flagged
    assert plan.problem() is None
    small = memory_plan(
        one_card.model_copy(update={"train": one_card.train.model_copy(update={"device_memory_gb": 80.0})})
    )
    assert re.fullmatch(r"memory plan: cuda:0 needs 110\.14 GB \(target weights \(bfloat16\) 2 x 53\.79, .*",
                        small.problem() or "")
    large = memory_plan(
        one_card.model_copy(update={"train": one_card.train.model_copy(update={"device_memory_gb": 141.0})})
    )
    assert large.problem() is None and not large.warnings()  # two replicas that fit are fine


def test_activation_checkpointing_and_batch_size_change_the_plan(tmp_path):
    base = memory_plan(load_config(readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])))
    doubled = memory_plan(load_config(readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"],
                                                    batch_size=2)))
    saved = memory_plan(load_config(readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], batch_size=2,
                                                  activation_checkpointing=True)))
    one, two, recomputed = (plan.devices[2] for plan in (base, doubled, saved))  # cuda:2, a drafter rank
    # batch 2 needs more than 80 GB unless layers are recomputed
    assert one.fits and two.fits is False and recomputed.fits
    # two rows recomputed keep less than a third of what one row keeps without
    assert (
        recomputed.items["activations kept for backward (checkpointed)"][0]
        < one.items["activations kept for backward"][0] / 3
    )


def _spec(layers: int) -> DrafterSpec:
    return DrafterSpec(hidden_size=48, intermediate_size=80, num_layers=layers, num_attention_heads=6,
                       num_key_value_heads=2,
                       head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096, vocab_size=300,
                       block_size=4, mask_token_id=1, target_layer_ids=[0, 2], num_target_layers=8, gamma=7.0)


def _step(spec: DrafterSpec, checkpointing: bool, autocast: bool, batch: int = 2, context: int = 40, anchors: int = 5):
    """One drafter forward + loss + backward as `backward_micro` runs it (dense attention on the CPU), with every
    tensor autograd keeps for backward counted once (by storage); returns (kept bytes, drafter, gradients)."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    apply_memory_options(drafter, drafter,
                         load_config(None, {"train": {"activation_checkpointing": checkpointing}}).train)
    q, size = anchors * spec.block_size, spec.block_size
    features = torch.randn(batch, context, spec.num_target_features * spec.hidden_size)
    block_hidden = torch.randn(batch, q, spec.hidden_size)
    anchor = (torch.arange(anchors) * (context // anchors) + 1).expand(batch, anchors)
    mask = block_attention_mask(anchor, torch.ones(batch, anchors, dtype=torch.bool), context, size)
    positions = anchor.repeat_interleave(size, 1) + torch.arange(size).repeat(anchors)
    labels, weights, head = (
        torch.randint(0, spec.vocab_size, (batch, q)),
        torch.ones(batch, q),
        torch.randn(spec.vocab_size, spec.hidden_size),
    )
    inputs = [features, block_hidden, mask, positions, weights, labels, head]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        hidden = DraftForward(drafter)(features, block_hidden, positions, torch.arange(context).expand(batch, context),
                                       mask)
        out = block_loss(hidden, labels, weights, head, None, size, 4)
    for t in [*drafter.parameters(), *inputs]:
        kept.pop(t.untyped_storage().data_ptr(), None)
    out.loss.backward()
    return sum(kept.values()), drafter, [torch.zeros(0) if p.grad is None else p.grad for p in drafter.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
def test_the_activation_estimate_is_what_autograd_keeps(autocast, checkpointing):
    for layers in (1, 3):
        spec = _spec(layers)
        measured, drafter, _ = _step(spec, checkpointing, autocast)
        estimate = drafter_activations(spec, 2, 40, 5, autocast, "dense", False, checkpointing).kept
        casts = 0  # autocast's bf16 weight copies that backward needs (the plan counts all of them as one item)
        if autocast:
            layer_weights = [
                m.weight.numel() for layer in drafter.layers for m in layer.modules() if isinstance(m, nn.Linear)
            ]
            kv = [layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()  # type: ignore[union-attr]
                  for layer in drafter.layers]
            casts = 2 * (sum(kv) if checkpointing else sum(layer_weights))  # fc's weight: no input gradient, never kept
        assert measured == estimate + casts


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradients():
    spec = _spec(3)
    plain, _, grads = _step(spec, checkpointing=False, autocast=False)
    recomputed, _, again = _step(spec, checkpointing=True, autocast=False)
    assert recomputed < plain / 2
    assert all(torch.equal(g1, g2) for g1, g2 in zip(grads, again, strict=True))


def _allreduce_rank(rank: int, port: int, out: Path) -> None:
    """One of two gloo ranks: a DDP linear layer's gradient with each train.grad_allreduce_dtype, saved to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        grads = {}
        for dtype in ("float32", "bfloat16"):
            torch.manual_seed(0)
            linear = nn.Linear(4, 3)
            model = nn.parallel.DistributedDataParallel(linear)
            register_grad_allreduce(model, dtype)
            model(torch.full((2, 4), 1.0 + rank / 3)).sum().backward()
            grads[dtype] = linear.weight.grad
        torch.save(grads, out / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while the other still has a collective in flight
    finally:
        dist.destroy_process_group()


def test_gradient_allreduce_in_bf16_under_gloo(tmp_path):
    spawn(_allreduce_rank, args=(free_ports(1)[0], tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    # each rank's gradient entries are 2 * (1 + rank / 3): their mean is 7/3 in fp32, which bf16 rounds to 2.34375
    assert all(torch.equal(ranks[0][dtype], ranks[1][dtype]) for dtype in ("float32", "bfloat16"))
    torch.testing.assert_close(ranks[0]["float32"], torch.full((3, 4), 7 / 3), rtol=0, atol=1e-6)
    assert torch.equal(ranks[0]["bfloat16"], torch.full((3, 4), 2.34375))


def test_the_bf16_hook_is_torchs_on_nccl_and_ours_on_gloo():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    assert allreduce_hook_for("nccl", "bfloat16") is bf16_compress_hook
    assert allreduce_hook_for("gloo", "bfloat16") is bf16_allreduce_hook
    assert allreduce_hook_for("nccl", "float32") is None


def test_a_dflash2_plan_counts_the_codebooks_convolutions_and_top_k_tensors(tmp_path):
    """The same README run with a DFlash2 drafter (the published shape: taps 2, groups of 16, rank 256, top-K 16): the
    drafter's parameters grow by exactly its convolutions and selector, and the loss's top-K tensors are items."""
    dflash = readme_config(tmp_path, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], memory_gb=None)
    text = json.loads((QWEN36 / "config.json").read_text())["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    base = memory_plan(load_config(dflash))
    dflash.write_text(dflash.read_text().replace('architecture = "dflash"\n', 'architecture = "dflash2"\n'))
    plan = memory_plan(load_config(dflash))
    # base_kernel [2, taps, H] + kernel_projection H -> 2 * taps * G
    conv = 2 * 2 * hidden + hidden * 2 * 2 * (hidden // 16)
    extra = 5 * 2 * conv + 2 * vocab * 256 + hidden * 256  # two per layer; two codebooks and the hidden projection
    drafter, before = plan.devices[2].items, base.devices[2].items
    assert drafter["drafter weights (fp32)"][0] - before["drafter weights (fp32)"][0] == 4 * extra
    assert (
        drafter["AdamW moments (fp32, 2 per parameter)"][0] - before["AdamW moments (fp32, 2 per parameter)"][0]
        == 8 * extra
    )
    queries = 512 * 16  # dflash.num_anchors x block size, one row
    assert drafter["top-K candidates + gold (ids, unary logits)"][0] == queries * 17 * 12
    assert drafter["activations kept for backward"][0] > before["activations kept for backward"][0]  # the convolutions
    assert "candidates' head rows (backward, one chunk)" in drafter


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_dflash2_activation_estimates_against_what_autograd_keeps(autocast):
    """The convolutions' share is exact in fp32 and an upper bound under autocast; the selector's loss-side items are an
    upper estimate within 25% of what its term keeps."""
    import dataclasses

    from blockdraft.model.dflash2 import CandidateSelector
    from blockdraft.model.spec import DFlash2Spec
    from blockdraft.stages.train.loss import Objective
    from blockdraft.stages.train.memory import selector_items

    for taps in (1, 2):
        spec = dataclasses.replace(_spec(2),
                                   dflash2=DFlash2Spec(conv_kernel_size=taps, conv_group_size=16, selector_rank=8,
                                                       selector_top_k=4))
        measured, drafter, _ = _step(spec, False, autocast)
        estimate = drafter_activations(spec, 2, 40, 5, autocast, "dense", False, False).kept
        casts = (
            2 * sum(m.weight.numel() for layer in drafter.layers for m in layer.modules() if isinstance(m, nn.Linear))
            if autocast
            else 0
        )
        assert measured == estimate + casts if not autocast else measured <= estimate + casts

    rows, hidden_size, vocab = 40, 48, 300
    hidden = torch.randn(1, rows, hidden_size, requires_grad=True)
    labels, weights, head = torch.randint(0, vocab, (1, rows)), torch.ones(1, rows), torch.randn(vocab, hidden_size)
    selector = CandidateSelector(hidden_size, vocab, 8, 4)
    kept_by: dict[str, int] = {}
    for name, objective in (("unary", Objective()), ("dflash2", Objective(top_k=4, selector_alpha=1.0))):
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor, kept: dict[int, int] = kept) -> torch.Tensor:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block_loss(hidden * 1.0, labels, weights, head, None, 4, 4, objective=objective,
                       walk_scores=selector.scores)
        for t in [*selector.parameters(), hidden, head, labels, weights]:
            kept.pop(t.untyped_storage().data_ptr(), None)
        kept_by[name] = sum(kept.values())
    spec = dataclasses.replace(_spec(1),
                               dflash2=DFlash2Spec(conv_kernel_size=1, conv_group_size=16, selector_rank=8,
                                                   selector_top_k=4))
    items = dict(selector_items(spec, rows, 16, 4))
    estimate = items["top-K candidates + gold (ids, unary logits)"] + items["selector scores (hidden, codebook rows)"]
    measured = kept_by["dflash2"] - kept_by["unary"]
    assert measured <= estimate <= 1.25 * measured, (measured, estimate)
