"""Eval at temperature: every prompt decoded `eval.samples_per_prompt` times by each drafter with rejection sampling,
and as often by target-only sampling (the speedup's reference), at the eval's sampling settings.

Decode i (prompt i // S, its sample i % S) is seeded with `eval.seed + i`, the seed the engine check sends with the same
request. Confidence intervals treat each decode as one sample (cycles within a decode are not independent): tau and
each position's acceptance rate are ratios of per-decode sums, so their standard error is the ratio estimator's,
sqrt(sum_i (y_i - r x_i)^2 / (n (n - 1))) / mean(x), with y_i the decode's committed tokens (or acceptances at
position k) and x_i its cycles; the interval is r +/- 1.96 standard errors (95%).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from blockdraft.config import EvalConfig
from blockdraft.decode.sampling import Sampler, Sampling, sample_decode
from blockdraft.decode.speculative import Proposer, SpecResult, run_speculative
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.metrics import DrafterMetrics, GreedyMetrics, acceptance_metrics

Z95 = 1.959964  # the two-sided 95% point of the standard normal


class SampledDrafter(BaseModel):
    """One drafter's figures at temperature: the metrics (speedup over target-only sampling), 95% intervals of tau and of
    each position's acceptance rate, and a + 1 per cycle of every decode (decode i = prompt i // S, sample i % S)."""

    metrics: DrafterMetrics
    tau_ci95: list[float]
    position_acceptance_ci95: list[list[float]]
    acceptance_lengths: list[list[int]]


class SampledEval(BaseModel):
    """What eval measured at temperature > 0, with the settings it ran at."""

    temperature: float
    top_p: float
    top_k: int
    proposal: str  # the engine's draft rule the drafters proposed by (`eval.proposal`)
    seed: int
    samples_per_prompt: int
    decodes: int
    target_only: GreedyMetrics  # target-only sampling's cost (its min_margin is None)
    drafters: dict[str, SampledDrafter]


def sampling_of(cfg: EvalConfig) -> Sampling | None:
    """The eval's sampling settings, or None when it decodes greedy only (temperature 0)."""
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.proposal) if cfg.temperature > 0 else None


def ratio_ci95(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """[low, high]: the 95% interval of sum(numerators) / sum(denominators), one pair per independent decode."""
    n = len(numerators)
    total = sum(denominators)
    if n < 2 or total == 0:
        r = sum(numerators) / total if total else 0.0
        return [r, r]
    r = sum(numerators) / total
    mean_x = total / n
    se = math.sqrt(sum((y - r * x) ** 2 for y, x in zip(numerators, denominators)) / (n * (n - 1))) / mean_x
    return [r - Z95 * se, r + Z95 * se]


def sampled_drafter(results: Sequence[SpecResult], block_size: int, reference: GreedyMetrics) -> SampledDrafter:
    """The metrics of one drafter's sampled decodes, with intervals, and its speedup over target-only sampling."""
    metrics = acceptance_metrics(results, block_size)
    metrics.speedup = reference.wall_s / metrics.wall_s if metrics.wall_s else 0.0
    cycles = [len(r.acceptance_lengths) for r in results]
    return SampledDrafter(
        metrics=metrics,
        tau_ci95=ratio_ci95([sum(r.acceptance_lengths) for r in results], cycles),
        position_acceptance_ci95=[
            ratio_ci95([sum(1 for n in r.acceptance_lengths if n - 1 >= k) for r in results], cycles) for k in range(1, block_size)
        ],
        acceptance_lengths=[list(r.acceptance_lengths) for r in results],
    )


def evaluate_sampled(
    hf_model, makers: dict[str, Callable[[], Proposer]], block_sizes: dict[str, int], prompts: Sequence[Sequence[int]],
    max_new_tokens: int, stops: Sequence[int], cfg: EvalConfig, sampling: Sampling, reporter: Reporter,
) -> SampledEval:
    """Each prompt S times: target-only sampling, then every drafter; progress ("eval sampled", decodes done, decodes)."""
    count = len(prompts) * cfg.samples_per_prompt
    target_only = []
    results: dict[str, list[SpecResult]] = {name: [] for name in makers}
    reporter.progress("eval sampled", 0, count)
    for i in range(count):
        prompt, seed = list(prompts[i // cfg.samples_per_prompt]), cfg.seed + i
        target_only.append(sample_decode(hf_model, prompt, max_new_tokens, Sampler(sampling, seed), stops))
        for name, make in makers.items():
            results[name].append(run_speculative(hf_model, make(), prompt, max_new_tokens, stops, sampler=Sampler(sampling, seed)))
        reporter.progress("eval sampled", i + 1, count)
    new_tokens = sum(len(r.new_tokens) for r in target_only)
    wall = sum(r.wall_s for r in target_only)
    forwards = sum(r.target_forwards for r in target_only)
    reference = GreedyMetrics(new_tokens=new_tokens, target_forwards=forwards, target_forwards_per_token=forwards / new_tokens if new_tokens else 0.0,
                              wall_s=wall, tokens_per_s=new_tokens / wall if wall else 0.0, min_margin=None)
    return SampledEval(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, proposal=sampling.proposal, seed=cfg.seed,
        samples_per_prompt=cfg.samples_per_prompt, decodes=count, target_only=reference,
        drafters={name: sampled_drafter(rs, block_sizes[name], reference) for name, rs in results.items()},
    )


__all__ = ["SampledDrafter", "SampledEval", "evaluate_sampled", "ratio_ci95", "sampled_drafter", "sampling_of"]
