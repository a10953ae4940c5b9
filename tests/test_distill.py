"""Soft targets (train.distill_weight): the math of the distillation term in the chunked loss, and the target's own
distribution per slot. Weight 0 is the paper's loss bit for bit; weight 1 is minimal (zero, zero gradient) exactly where
the drafter reproduces the target's logits; the analytic gradient equals autograd's; chunking changes nothing."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from helpers.paths import GOLDEN_TARGET

from blockdraft.model import TargetHead, TargetModel, load_target
from blockdraft.stages.train.data import anchor_generator, build_block_batch
from blockdraft.stages.train.loss import Objective, Teacher, block_loss, dpace_weights

B, H, V = 4, 16, 40


class _PaperLoss(torch.autograd.Function):
    """The paper's chunked head + CE alone (weighted sum and input gradient), with no distillation or D-PACE term: the
    reference the default objective must reproduce bit for bit."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, chunk_rows):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = F.linear(hidden[sl].to(weight.dtype), weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[sl, None])[:, 0]
            total += (weights[sl] * (lse - picked)).sum()
            probs = torch.exp(logits.sub_(lse[:, None])).mul_(weights[sl, None])
            grad_chunk = probs.to(weight.dtype) @ weight - weights[sl, None].to(weight.dtype) * weight[labels[sl]]
            grad[sl] = grad_chunk.to(hidden.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def problem(seed: int = 0, rows: int = 2, blocks: int = 3, ctx: int = 10, dtype=torch.float32):
    """Random drafter outputs [rows, blocks*B, H], labels, decayed weights with unsupervised slots, a frozen head, and a
    teacher: the target's final hidden states [rows, ctx, H] at positions anchor + k - 1."""
    g = torch.Generator().manual_seed(seed)
    q = blocks * B
    hidden = torch.randn(rows, q, H, generator=g)
    labels = torch.randint(0, V, (rows, q), generator=g)
    k = torch.arange(q) % B
    weights = torch.where(k > 0, torch.exp(-(k - 1) / 2.0), torch.zeros(())).expand(rows, q).clone()
    weights[torch.rand(rows, q, generator=g) < 0.2] = 0.0  # unsupervised slots
    head_w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    head_b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    anchors = torch.randint(1, ctx - B, (rows, blocks), generator=g)
    positions = anchors.repeat_interleave(B, dim=1) + k
    teacher = Teacher.for_blocks(torch.randn(rows, ctx, H, generator=g), positions)
    return hidden, labels, weights, head_w, head_b, teacher


def loss_and_grad(hidden, labels, weights, head_w, head_b, chunk_blocks=1, **kwargs):
    h = hidden.clone().requires_grad_(True)
    out = block_loss(h, labels, weights, head_w, head_b, B, chunk_blocks, **kwargs)
    out.loss.backward()
    assert h.grad is not None
    return out, h.grad


def reference(hidden, labels, weights, head_w, head_b, teacher: Teacher, objective: Objective):
    """The same objective written plainly over the full [rows, V] logits, differentiated by autograd."""
    h = hidden.reshape(-1, H).clone().requires_grad_(True)
    logits = F.linear(h, head_w, head_b)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    w = weights.reshape(-1)
    if objective.weighting == "dpace":
        w = dpace_weights(ce.detach(), w > 0, B, objective.dpace_alpha)
    lam, t = objective.distill_weight, objective.temperature
    t_hidden, index = teacher.flat()
    log_p = F.log_softmax(F.linear(t_hidden[index], head_w, head_b) / t, dim=-1)
    kl = F.kl_div(F.log_softmax(logits / t, dim=-1), log_p, log_target=True, reduction="none").sum(-1)
    denominator = (weights > 0).float().sum() if objective.weighting == "dpace" else weights.sum()
    loss = (w * ((1 - lam) * ce + lam * t * t * kl)).sum() / denominator
    (grad,) = torch.autograd.grad(loss, h)
    return loss.detach(), grad.reshape(hidden.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_zero_is_bit_equal_to_the_paper_loss(dtype):
    hidden, labels, weights, head_w, head_b, teacher = problem(dtype=dtype)
    h = hidden.clone().requires_grad_(True)
    total = _PaperLoss.apply(h.reshape(-1, H), head_w, head_b, labels.reshape(-1), weights.reshape(-1), 2 * B)
    before = total / weights.sum()
    before.backward()
    assert h.grad is not None
    for kwargs in ({}, {"objective": Objective(distill_weight=0.0, temperature=3.0), "teacher": teacher}):
        out, grad = loss_and_grad(hidden, labels, weights, head_w, head_b, chunk_blocks=2, **kwargs)
        assert torch.equal(out.loss, before.detach()) and torch.equal(grad, h.grad)
        assert out.weighted_kl is None  # the teacher's path never ran


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_weight_one_is_zero_with_zero_gradient_where_the_drafter_reproduces_the_target(temperature):
    _, labels, weights, head_w, head_b, teacher = problem()
    t_hidden, index = teacher.flat()
    at_target = t_hidden[index].reshape(labels.shape[0], -1, H)  # the drafter's hidden states give the target's logits
    objective = Objective(distill_weight=1.0, temperature=temperature)
    out, grad = loss_and_grad(at_target, labels, weights, head_w, head_b, objective=objective, teacher=teacher)
    assert out.loss.item() == 0.0 and out.weighted_kl is not None and out.weighted_kl.item() == 0.0
    assert torch.count_nonzero(grad) == 0
    g = torch.Generator().manual_seed(1)
    for scale in (1e-3, 1e-1, 1.0):  # every move away from the target's logits costs more
        moved = at_target + scale * torch.randn(at_target.shape, generator=g)
        assert loss_and_grad(moved, labels, weights, head_w, head_b, objective=objective, teacher=teacher)[0].loss > 0
    # while the hard labels alone would still pull it elsewhere
    assert torch.count_nonzero(loss_and_grad(at_target, labels, weights, head_w, head_b,
                                             objective=Objective(distill_weight=0.5), teacher=teacher)[1]) > 0


@pytest.mark.parametrize("objective", [
    Objective(distill_weight=1.0), Objective(distill_weight=0.5, temperature=2.0),
    Objective(weighting="dpace", dpace_alpha=0.3), Objective(weighting="dpace", distill_weight=0.25, temperature=0.7),
], ids=["kl", "mix-T2", "dpace", "dpace-mix"])
def test_analytic_gradient_equals_autograd_of_the_plain_objective(objective):
    hidden, labels, weights, head_w, head_b, teacher = problem(seed=3)
    out, grad = loss_and_grad(hidden, labels, weights, head_w, head_b, objective=objective, teacher=teacher)
    ref_loss, ref_grad = reference(hidden, labels, weights, head_w, head_b, teacher, objective)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("objective",
                         [Objective(distill_weight=0.5, temperature=1.5),
                          Objective(weighting="dpace", distill_weight=0.3)])
def test_chunking_equals_one_chunk(objective):
    hidden, labels, weights, head_w, head_b, teacher = problem(seed=5, blocks=5)
    one, grad_one = loss_and_grad(hidden, labels, weights, head_w, head_b, chunk_blocks=5, objective=objective,
                                  teacher=teacher)
    for chunk_blocks in (1, 2, 3):  # chunks of whole blocks, the last one short
        out, grad = loss_and_grad(hidden, labels, weights, head_w, head_b, chunk_blocks, objective=objective,
                                  teacher=teacher)
        torch.testing.assert_close(out.loss, one.loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, grad_one, rtol=1e-6, atol=1e-9)
        assert torch.equal(out.slots.correct, one.slots.correct)


def test_distilling_without_the_target_states_is_refused():
    hidden, labels, weights, head_w, head_b, _ = problem()
    with pytest.raises(ValueError, match="distill_weight"):
        block_loss(hidden, labels, weights, head_w, head_b, B, 1, objective=Objective(distill_weight=0.5))


def test_each_slot_learns_the_targets_prediction_of_its_own_token():
    """On the target's own greedy continuations, the teacher of every supervised slot (the target's logits at a + k - 1
    given the true prefix) picks exactly that slot's label; shifted by one position it would not. The final hidden
    states are what the LM head reads: head(final) equals the model's own logits bit for bit."""
    hf = load_target(str(GOLDEN_TARGET), "cpu", torch.float32)
    prompts = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(4))
    greedy = cast(Any, hf).generate(prompts, max_new_tokens=18, min_new_tokens=18, do_sample=False, pad_token_id=0)
    rows = [{"input_ids": row.tolist(), "loss_mask": [0] * 6 + [1] * 18} for row in greedy]
    target, head = TargetModel(hf, [1]), TargetHead.from_target(hf)
    batch = build_block_batch([(r["input_ids"], r["loss_mask"]) for r in rows], num_anchors=6, block_size=B,
                              mask_token_id=511, gamma=4.0, generators=[anchor_generator(0, 0, i) for i in range(2)])
    features, final = target.features_and_final(batch.input_ids, batch.attention_mask_context.long())
    assert torch.equal(features, target.features(batch.input_ids, batch.attention_mask_context.long()))
    assert torch.equal(head.logits(final),
                       hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask_context.long()).logits)

    supervised = batch.weights > 0
    for shift, expect_all in ((0, True), (1, False)):
        teacher = Teacher.for_blocks(final, batch.block_positions + shift)
        t_hidden, index = teacher.flat()
        picks = head.logits(t_hidden[index]).argmax(-1).reshape(batch.labels.shape)
        agree = (picks == batch.labels)[supervised]
        assert bool(agree.all()) is expect_all, (shift, agree.float().mean())
    # and a drafter that reproduces those hidden states is at the distillation loss's minimum on this real batch
    teacher = Teacher.for_blocks(final, batch.block_positions)
    t_hidden, index = teacher.flat()
    out = block_loss(t_hidden[index].reshape(*batch.labels.shape, -1), batch.labels, batch.weights, head.lm_head_weight,
                     head.lm_head_bias, B, 2, objective=Objective(distill_weight=1.0), teacher=teacher)
    assert out.loss.item() == 0.0
