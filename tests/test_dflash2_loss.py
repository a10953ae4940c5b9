"""The DFlash2 objective's math (docs/DFLASH.md, "DFlash2 training"): the unary term plus the selector's K-way
cross-entropy over the top-K scored as the walk scores them with the gold predecessor, computed chunk by chunk, equals
the same objective written plainly over full logits and differentiated by autograd (value and gradients, both rules for
a gold token outside the top-K, scaled and soft-capped unary logits, D-PACE weights); the two rules differ exactly on
the slots whose gold is outside the top-K."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockdraft.model.dflash2 import CandidateSelector
from blockdraft.stages.train.loss import Objective, block_loss, dpace_weights

B, H, V, R, K = 4, 16, 40, 8, 5


def problem(seed: int = 0, rows: int = 2, blocks: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = blocks * B
    hidden = torch.randn(rows, q, H, generator=g)
    labels = torch.randint(0, V, (rows, q), generator=g)
    k = torch.arange(q) % B
    weights = torch.where(k > 0, torch.exp(-(k - 1) / 2.0), torch.zeros(())).expand(rows, q).clone()
    weights[torch.rand(rows, q, generator=g) < 0.2] = 0.0
    head_w = torch.randn(V, H, generator=g) * 0.3
    head_b = torch.randn(V, generator=g) * 0.1
    selector = {"pred": torch.randn(V, R, generator=g), "succ": torch.randn(V, R, generator=g),
                "proj": torch.randn(R, H, generator=g) * 0.3}
    return hidden, labels, weights, head_w, head_b, selector


def pair(selector):
    """The walk's scores (`CandidateSelector.scores`) with these tensors as its parameters."""
    module = CandidateSelector(H, V, R, K)
    del module.predecessor_codebook, module.successor_codebook, module.hidden_projection.weight
    module.predecessor_codebook, module.successor_codebook, module.hidden_projection.weight = (
        selector["pred"],
        selector["succ"],
        selector["proj"],
    )
    return module.scores


def leaves(selector):
    return {name: t.clone().requires_grad_(True) for name, t in selector.items()}


def reference(hidden, labels, weights, head_w, head_b, selector, objective: Objective):
    """The objective over the full logits, written plainly; returns (loss, grads of hidden and of the selector)."""
    h = hidden.reshape(-1, H).clone().requires_grad_(True)
    sel = leaves(selector)
    logits = F.linear(h, head_w, head_b) * objective.output_multiplier
    if objective.softcap is not None:
        logits = objective.softcap * torch.tanh(logits / objective.softcap)
    y, w = labels.reshape(-1), weights.reshape(-1)
    ce = F.cross_entropy(logits, y, reduction="none")
    used = dpace_weights(ce, w > 0, B, objective.dpace_alpha) if objective.weighting == "dpace" else w
    denominator = (w > 0).float().sum() if objective.weighting == "dpace" else w.sum()
    total = (used * ce).sum()
    pred = labels.reshape(-1, B).roll(1, dims=-1).reshape(-1)
    for i in range(y.numel()):
        if used[i] == 0:
            continue
        top = logits[i].topk(objective.top_k).indices
        cands = top if y[i] in top else (torch.cat((top, y[i : i + 1])) if objective.missing_gold == "inject" else None)
        if cands is None:
            continue
        query = sel["pred"][pred[i]] * (sel["proj"] @ h[i])
        scores = logits[i, cands] + (sel["succ"][cands] @ query)
        target = (cands == y[i]).nonzero()[0, 0]
        total = total + objective.selector_alpha * used[i] * (torch.logsumexp(scores, 0) - scores[target])
    loss = total / denominator
    loss.backward()
    return loss.detach(), h.grad.reshape(hidden.shape), {n: t.grad for n, t in sel.items()}


@pytest.mark.parametrize(
    "objective",
    [
        Objective(top_k=K, selector_alpha=0.7, missing_gold="inject"),
        Objective(top_k=K, selector_alpha=1.0, missing_gold="skip"),
        Objective(top_k=K, selector_alpha=0.5, missing_gold="inject", output_multiplier=1.7, softcap=3.0),
        Objective(weighting="dpace", top_k=K, selector_alpha=1.0, missing_gold="skip", output_multiplier=0.6),
    ],
    ids=["inject", "skip", "scaled-capped", "dpace"],
)
def test_chunked_dflash2_objective_equals_the_plain_one(objective):
    hidden, labels, weights, head_w, head_b, selector = problem()
    want, want_h, want_sel = reference(hidden, labels, weights, head_w, head_b, selector, objective)
    for chunk_blocks in (1, 4):
        h = hidden.clone().requires_grad_(True)
        sel = leaves(selector)
        out = block_loss(h, labels, weights, head_w, head_b, B, chunk_blocks, objective=objective,
                         walk_scores=pair(sel))
        out.loss.backward()
        torch.testing.assert_close(out.loss.detach(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h.grad, want_h, rtol=1e-4, atol=1e-6)
        for name in sel:
            torch.testing.assert_close(sel[name].grad, want_sel[name], rtol=1e-4, atol=1e-6)
        assert out.selector is not None


def test_the_two_rules_differ_on_the_slots_whose_gold_is_outside_the_top_k():
    """Skip leaves those slots out of the selector's term; inject scores the gold as one more candidate there. Recall
    counts them in both, and the unary term is the same."""
    hidden, labels, weights, head_w, head_b, selector = problem(seed=1)
    outs = {
        rule: block_loss(hidden, labels, weights, head_w, head_b, B, 2, walk_scores=pair(selector),
                         objective=Objective(top_k=K, selector_alpha=1.0, missing_gold=rule))
        for rule in ("inject", "skip")
    }
    inject, skip = outs["inject"].selector, outs["skip"].selector
    assert inject is not None and skip is not None
    torch.testing.assert_close(inject.recall, skip.recall)
    torch.testing.assert_close(inject.correct, skip.correct)
    supervised = outs["inject"].slots.total
    assert (inject.recall < supervised).any()  # this problem has slots whose gold is outside the top-K
    assert inject.weighted > skip.weighted > 0
    assert (inject.correct <= inject.recall).all()
    # with K = V every gold is a candidate: the rules agree and recall is every supervised slot
    full = [
        block_loss(
            hidden,
            labels,
            weights,
            head_w,
            head_b,
            B,
            2,
            walk_scores=pair(selector),
            objective=Objective(top_k=V, selector_alpha=1.0, missing_gold=rule),
        ).selector
        for rule in ("inject", "skip")
    ]
    assert full[0] is not None and full[1] is not None
    torch.testing.assert_close(full[0].weighted, full[1].weighted)
    torch.testing.assert_close(full[0].recall, supervised)


def test_a_dflash_objective_has_no_selector_term():
    hidden, labels, weights, head_w, head_b, _ = problem()
    out = block_loss(hidden, labels, weights, head_w, head_b, B, 2)
    assert out.selector is None
    with pytest.raises(ValueError, match="candidate selector"):
        block_loss(hidden, labels, weights, head_w, head_b, B, 2, objective=Objective(top_k=K, selector_alpha=1.0))


def test_the_loss_unary_logits_are_the_walks():
    """The transform the chunked loss applies in place, and its slope, are the decode's `unary_logits` and its
    derivative."""
    from blockdraft.model.dflash2 import unary_logits
    from blockdraft.model.spec import DFlash2Spec

    z = torch.randn(6, V, requires_grad=True)
    for multiplier, cap in ((1.0, None), (1.7, None), (0.6, 2.5)):
        objective = Objective(top_k=K, selector_alpha=1.0, output_multiplier=multiplier, softcap=cap)
        want = unary_logits(z, DFlash2Spec(output_multiplier=multiplier, final_logit_softcapping=cap))
        got = objective.unary(z.detach().clone())
        torch.testing.assert_close(got, want.detach())
        (slope,) = torch.autograd.grad(want.sum(), z)
        torch.testing.assert_close(objective.unary_slope(got), slope)
