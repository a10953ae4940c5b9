"""Sampled decoding (docs/DFLASH.md, "Sampled verify"): the processed distribution is the one Hugging Face's warpers
give, target-only sampling follows it, and a seed reproduces a sampled decode. That speculative sampling is lossless
under every engine's draft rule is tests/test_sampling_rules.py's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import GOLDEN
from helpers.sampling import ALPHA, THINKING, chi_square, exact_first_two
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from blockdraft.decode.cached_target import CachedTarget
from blockdraft.decode.sampling import Proposal, Sampler, Sampling, processed_probs, rejection_verify, sample_decode
from blockdraft.decode.speculative import DFlashProposer, run_speculative
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.target import TargetHead

TARGET_ONLY_SAMPLES = 400  # the target-only reference sampler is checked with fewer (it has no verify to get wrong)


@pytest.fixture(scope="module")
def golden():
    target = AutoModelForCausalLM.from_pretrained(GOLDEN / "target", attn_implementation="eager",
                                                  dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()
    prompt = json.loads((GOLDEN / "golden.json").read_text())["decode"][1]["prompt"]
    return target, drafter, TargetHead.from_target(target), prompt


def test_processed_probs_are_huggingfaces_temperature_top_k_top_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    logits[0, :4] = 5.0  # ties at the k-th value are kept, as both rules keep them
    for s in (THINKING, Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.5),
              Sampling(0.9, top_p=0.8, top_k=50)):
        x = TemperatureLogitsWarper(s.temperature)(None, logits.clone())
        if s.top_k:
            x = TopKLogitsWarper(s.top_k)(None, x)
        if s.top_p < 1:
            x = TopPLogitsWarper(s.top_p)(None, x)
        torch.testing.assert_close(processed_probs(logits, s), torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5)


def test_target_only_sampling_follows_the_processed_distribution(golden):
    target, _, _, prompt = golden
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(TARGET_ONLY_SAMPLES):
        cell = tuple(sample_decode(target, prompt, 2, Sampler(THINKING, seed)).new_tokens)
        counts[cell] = counts.get(cell, 0) + 1
    stat, df, p_value = chi_square(counts, exact_first_two(target, prompt, THINKING))
    assert p_value >= ALPHA, f"chi-square {stat:.1f} with {df} degrees of freedom, p = {p_value:.3g}"


def test_a_seed_reproduces_a_sampled_decode_and_another_seed_differs(golden):
    target, drafter, head, prompt = golden
    runs = [
        run_speculative(target, DFlashProposer(drafter, head), prompt, 16, sampler=Sampler(THINKING, seed))
        for seed in (7, 7, 8)
    ]
    assert runs[0].tokens == runs[1].tokens and runs[0].acceptance_lengths == runs[1].acceptance_lengths
    assert runs[0].tokens != runs[2].tokens
    # Drafts from a point-mass proposal (q None) are verified by the same rule: accepted with probability p(x).
    with torch.inference_mode():
        logits, _ = CachedTarget(target).forward(torch.tensor([prompt]), 0)
    p = processed_probs(logits[0, -2:], THINKING)
    best = int(p[0].argmax())
    accepted = sum(rejection_verify(Proposal([best]), p, Sampler(THINKING, s))[0] for s in range(400))
    assert abs(accepted / 400 - float(p[0, best])) < 4 * (float(p[0, best]) * (1 - float(p[0, best])) / 400) ** 0.5
