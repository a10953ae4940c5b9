"""Sampled decoding with a DFlash2 drafter (docs/DFLASH.md, "Sampled verify"): each slot's candidate is drawn from the
softmax of its walk scores at the temperature, `q` is that distribution on the slot's K candidates, and the first two new
tokens then follow target-only sampling's distribution under the chi-square test. The same test rejects drafts drawn from
the walk but verified against another `q` (the unary distribution), so it sees a proposal whose `q` is not the one its
drafts came from."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import GOLDEN2
from helpers.sampling import ALPHA, THINKING, chi_square, exact_first_two
from transformers import AutoModelForCausalLM

from blockdraft.decode.sampling import Proposal, Sampler
from blockdraft.decode.speculative import DFlashProposer, run_speculative
from blockdraft.model.dflash2 import unary_logits
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.target import TargetHead

SAMPLES = 600  # speculative decodes per proposal: about 25 cells expected at 5 or more, and the wrong q is far off


@pytest.fixture(scope="module")
def golden2():
    target = AutoModelForCausalLM.from_pretrained(GOLDEN2 / "target", attn_implementation="eager", dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(GOLDEN2 / "drafter").eval()
    assert drafter.candidate_selector is not None
    prompt = json.loads((GOLDEN2 / "golden.json").read_text())["decode"][1]["prompt"]
    return target, drafter, TargetHead.from_target(target), prompt


class _UnaryQ(DFlashProposer):
    """Broken: the drafts come from the walk, but the verify is given the unary distribution as their q."""

    def _draft(self, tokens, new_features, start):
        self.last = super()._draft(tokens, new_features, start)
        return self.last

    def sample(self, tokens, new_features, start, sampler):
        proposal = super().sample(tokens, new_features, start, sampler)
        spec2 = self.drafter.spec.dflash2
        assert spec2 is not None
        unary = unary_logits(self.head.logits(self.last[0][:, 1:]), spec2)
        return Proposal(proposal.tokens, sampler.probs(unary[0]))


class _Recording(DFlashProposer):
    def sample(self, tokens, new_features, start, sampler):
        proposal = super().sample(tokens, new_features, start, sampler)
        self.proposals = [*getattr(self, "proposals", []), proposal]
        return proposal


def test_a_sampled_walk_draws_from_its_k_candidates_and_gives_that_q(golden2):
    target, drafter, head, prompt = golden2
    proposer = _Recording(drafter, head)
    result = run_speculative(target, proposer, prompt, 24, sampler=Sampler(THINKING, 3))
    spec2 = drafter.spec.dflash2
    assert result.acceptance_lengths and proposer.proposals and spec2 is not None
    for proposal in proposer.proposals:
        assert proposal.q is not None and proposal.q.shape == (drafter.spec.block_size - 1, drafter.spec.vocab_size)
        torch.testing.assert_close(proposal.q.sum(dim=-1), torch.ones(drafter.spec.block_size - 1))
        assert int((proposal.q > 0).sum(dim=-1).max()) <= spec2.selector_top_k  # the walk's K candidates, zero elsewhere
        assert all(float(proposal.q[k, token]) > 0 for k, token in enumerate(proposal.tokens))


@pytest.mark.parametrize("proposer,lossless", [(DFlashProposer, True), (_UnaryQ, False)], ids=["walk q", "unary q for walk drafts"])
def test_speculative_sampling_with_a_dflash2_walk_follows_target_only_sampling(golden2, proposer, lossless):
    target, drafter, head, prompt = golden2
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        cell = tuple(run_speculative(target, proposer(drafter, head), prompt, 2, sampler=Sampler(THINKING, seed)).new_tokens)
        counts[cell] = counts.get(cell, 0) + 1
    stat, df, p_value = chi_square(counts, exact_first_two(target, prompt, THINKING))
    print(f"{proposer.__name__}: chi-square {stat:.1f}, {df} degrees of freedom, p = {p_value:.3g}")
    assert df >= 20, "too few cells for the test to say anything"
    assert (p_value >= ALPHA) == lossless, f"chi-square {stat:.1f} with {df} degrees of freedom, p = {p_value:.3g}"
