"""Speculative sampling under each serving engine's draft rule (docs/EVAL.md, "Draft rules") is lossless in
distribution: the first two new tokens of our loop follow target-only sampling's exact distribution under the chi-square
test, for a DFlash and a DFlash2 drafter and every rule, while the same test rejects three broken verifies of each: one
that keeps every draft, one that on a rejection draws from p itself instead of the residual (for a point-mass q: p
without the rejected token), and one handed the wrong q (the target's own distribution in place of the drafts').

One decode serves all four verifies: the first cycle's verify is run by each of them from the same generator state, and
each one's second token is recorded (the first comes from the prefill), so each verify's counts are an independent
sample of its own output distribution. Measured p-values (fixed seeds, so every run gives the same):

| drafter, rule | rejection sampling | accepts every draft | skips the residual | wrong q |
|---|---|---|---|---|
| DFlash, vllm (and sglang, the same proposals) | 0.769 | 0 | 4.7e-16 | 0 |
| DFlash, vllm-probabilistic | 0.48 | 0 | 2.63e-06 | 0 |
| DFlash2, vllm | 0.831 | 0 | 2.75e-14 | 1.35e-284 |
| DFlash2, sglang (and vllm-probabilistic, the same proposals) | 0.45 | 0 | 3.21e-06 | 1.79e-284 |
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from helpers.paths import GOLDEN, GOLDEN2
from helpers.sampling import ALPHA, THINKING, chi_square, exact_first_two
from transformers import AutoModelForCausalLM

from blockdraft.decode.sampling import PROPOSALS, Proposal, Sampler, Sampling, rejection_verify
from blockdraft.decode.speculative import DFlashProposer, run_speculative
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.target import TargetHead

# Decodes per (drafter, rule): enough cells expected at 5 or more for 20+ degrees of freedom, and power against each
# broken verify (its p-value in the table above).
SAMPLES = {"dflash": 1200, "dflash2": 600}
GOLDENS = {"dflash": GOLDEN, "dflash2": GOLDEN2}


@pytest.fixture(scope="module", params=sorted(GOLDENS))
def golden(request):
    folder = GOLDENS[request.param]
    target = AutoModelForCausalLM.from_pretrained(folder / "target", attn_implementation="eager",
                                                  dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(folder / "drafter").eval()
    assert (drafter.candidate_selector is not None) == (request.param == "dflash2")
    prompt = json.loads((folder / "golden.json").read_text())["decode"][1]["prompt"]
    return request.param, target, drafter, TargetHead.from_target(target), prompt


def _accept_every_draft(proposal: Proposal, p: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    n = len(proposal.tokens)
    return n, int(sampler.draw(p[n]))


def _skip_the_residual(proposal: Proposal, p: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    accepted, _ = rejection_verify(proposal, p, sampler)
    return accepted, int(sampler.draw(p[accepted]))


def _target_as_q(proposal: Proposal, p: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Handed the target's distribution where the drafts' belongs: a draft p gives mass is kept, whatever q drew it."""
    return rejection_verify(Proposal(proposal.tokens, p[: len(proposal.tokens)]), p, sampler)


VERIFIES: dict[str, Callable[[Proposal, torch.Tensor, Sampler], tuple[int, int]]] = {
    "rejection sampling": rejection_verify,
    "accepts every draft": _accept_every_draft,
    "skips the residual": _skip_the_residual,
    "wrong q": _target_as_q,
}


def _first_two(golden, sampling: Sampling) -> dict[str, dict[tuple[int, ...], int]]:
    """{verify: counts of (first, second) new token} over SAMPLES decodes, every verify run on each decode's first
    cycle."""
    name, target, drafter, head, prompt = golden
    counts: dict[str, dict[tuple[int, ...], int]] = {v: {} for v in VERIFIES}
    for seed in range(SAMPLES[name]):
        seconds: dict[str, int] = {}

        def fan_out(proposal: Proposal, p: torch.Tensor, sampler: Sampler, seconds=seconds) -> tuple[int, int]:
            generator = sampler.generator(p.device)
            state = generator.get_state()
            for verify_name, verify in VERIFIES.items():
                generator.set_state(state)
                accepted, bonus = verify(proposal, p, sampler)
                seconds.setdefault(verify_name, proposal.tokens[0] if accepted else bonus)  # the first cycle's only
            generator.set_state(state)
            return rejection_verify(proposal, p, sampler)

        result = run_speculative(target, DFlashProposer(drafter, head), prompt, 2, sampler=Sampler(sampling, seed),
                                 verify=fan_out)
        for verify_name, second in seconds.items():
            cell = (result.new_tokens[0], second)
            counts[verify_name][cell] = counts[verify_name].get(cell, 0) + 1
        # the loop committed what rejection sampling chose
        assert tuple(result.new_tokens) in counts["rejection sampling"]
    return counts


# Two rules propose alike for one architecture: SGLang's DFlash rule is vLLM's default (the argmax), and vLLM's
# probabilistic DFlash2 walk is SGLang's. Their distribution is tested once; the other rule is checked to give the
# very same proposals, seed for seed.
SAME_AS = {("dflash", "sglang"): "vllm", ("dflash2", "vllm-probabilistic"): "sglang"}


@pytest.mark.parametrize("rule", PROPOSALS)
def test_every_draft_rule_is_lossless_and_each_broken_verify_fails(golden, rule):
    """The p-values of each (drafter, rule) and verify are in the module's docstring."""
    name, target, _, _, prompt = golden
    if (name, rule) in SAME_AS:
        other = SAME_AS[name, rule]
        for seed in range(8):
            mine, theirs = _proposals(golden, rule, seed=seed), _proposals(golden, other, seed=seed)
            assert [(p.tokens, None if p.q is None else p.q.tolist()) for p, _ in mine] == \
                   [(p.tokens, None if p.q is None else p.q.tolist()) for p, _ in theirs]
        return
    sampling = Sampling(THINKING.temperature, THINKING.top_p, THINKING.top_k, rule)
    expected = exact_first_two(target, prompt, sampling)
    assert abs(sum(expected.values()) - 1) < 1e-5
    failures = []
    for verify_name, counts in _first_two(golden, sampling).items():
        stat, df, p_value = chi_square(counts, expected)
        print(f"{name} {rule} {verify_name}: chi-square {stat:.1f}, {df} degrees of freedom, p = {p_value:.3g}")
        assert df >= 20, "too few cells for the test to say anything"
        if (p_value >= ALPHA) != (verify_name == "rejection sampling"):
            failures.append(f"{verify_name}: chi-square {stat:.1f} with {df} degrees of freedom, p = {p_value:.3g}")
    assert not failures, failures


def _proposals(golden, rule: str, top_k: int = THINKING.top_k, seed: int = 3) -> list[tuple[Proposal, list[int]]]:
    """(the proposal at temperature, greedy decoding's proposal from the same drafter state) of every cycle of a
    decode."""
    _, target, drafter, head, prompt = golden
    seen: list[tuple[Proposal, list[int]]] = []

    class Recording(DFlashProposer):
        def sample(self, tokens, new_features, start, sampler):
            proposal = super().sample(tokens, new_features, start, sampler)
            # The context is cached now: drafting again from it with no new features is greedy decoding's draft here.
            seen.append((proposal, self.propose(tokens, new_features[:, :0], start)))
            return proposal

    sampling = Sampling(THINKING.temperature, THINKING.top_p, top_k, rule)
    result = run_speculative(target, Recording(drafter, head), prompt, 24, sampler=Sampler(sampling, seed))
    assert result.acceptance_lengths and len(seen) == len(result.acceptance_lengths)
    return seen


def test_each_rule_proposes_as_its_engine_does(golden):
    """Argmax rules give greedy decoding's drafts with a point-mass q; sampled rules give q summing to one per slot, a
    DFlash slot's over the whole vocabulary (no top-k on q), a DFlash2 walk's over its K candidates only."""
    name, _, drafter, _, _ = golden
    spec = drafter.spec
    argmax_rules = {"dflash": ("vllm", "sglang"), "dflash2": ("vllm",)}[name]
    for rule in PROPOSALS:
        differs = 0
        for proposal, greedy in _proposals(golden, rule):
            if rule in argmax_rules:
                assert proposal.q is None and proposal.tokens == greedy, rule
                continue
            differs += proposal.tokens != greedy
            assert proposal.q is not None and proposal.q.shape == (spec.block_size - 1, spec.vocab_size), rule
            torch.testing.assert_close(proposal.q.sum(dim=-1), torch.ones(spec.block_size - 1))
            assert all(float(proposal.q[k, token]) > 0 for k, token in enumerate(proposal.tokens))
            if name == "dflash":
                assert (int((proposal.q > 0).sum(dim=-1).min())
                        > THINKING.top_k), "a sampled DFlash slot's q is untruncated"
            else:
                assert (
                    spec.dflash2 is not None and int((proposal.q > 0).sum(dim=-1).max()) <= spec.dflash2.selector_top_k
                )
        assert rule in argmax_rules or differs, (f"{rule}: every sampled draft equals the argmax one: nothing was "
                                                 "sampled")
    if name == "dflash2":  # SGLang walks greedily where top-k is 1
        assert all(p.q is None and p.tokens == greedy for p, greedy in _proposals(golden, "sglang", top_k=1))
