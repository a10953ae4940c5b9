"""Eval at temperature: every prompt decoded `eval.samples_per_prompt` times by each drafter with rejection sampling,
and as often by target-only sampling (the speedup's reference), at the eval's sampling settings.

Decode i (prompt i // S, its sample i % S) is seeded with `eval.seed + i`, the seed the engine check sends with the same
request. Confidence intervals treat each decode as one sample (cycles within a decode are not independent): tau and
each position's acceptance rate are ratios of per-decode sums, so their standard error is the ratio estimator's,
sqrt(sum_i (y_i - r x_i)^2 / (n (n - 1))) / mean(x), with y_i the decode's committed tokens (or acceptances at
position k) and x_i its cycles; the interval is r +/- 1.96 standard errors (95%). One decode has no spread to estimate
an error from, so its intervals are None (the summary says "no interval: 1 decode"), never a zero-width [r, r].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from blockdraft.config import EvalConfig
from blockdraft.decode.sampling import Sampler, Sampling, sample_decode
from blockdraft.decode.speculative import Proposer, SpecResult, run_speculative
from blockdraft.errors import EvalError
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.metrics import DrafterMetrics, GreedyMetrics, acceptance_metrics

Z95 = 1.959964  # the two-sided 95% point of the standard normal
MIN_DECODES_FOR_INTERVAL = 2  # the ratio estimator's standard error divides by n - 1
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this; decode i is seeded with eval.seed + i
# The eval settings only the decodes at temperature read, and the flags that set them: given with temperature 0 they
# would change nothing, so the CLI refuses them (`refuse_idle_sampling`).
SAMPLED_ONLY = {"top_p": "--top-p", "top_k": "--top-k", "seed": "--seed", "samples_per_prompt": "--samples-per-prompt",
                "proposal": "--proposal"}


class SampledDrafter(BaseModel):
    """One drafter's figures at temperature: the metrics (speedup over target-only sampling), 95% intervals of tau and
    of each position's acceptance rate, and a + 1 per cycle of every decode (decode i = prompt i // S, sample i % S)."""

    metrics: DrafterMetrics
    tau_ci95: list[float] | None  # None: fewer decodes than an interval needs (`MIN_DECODES_FOR_INTERVAL`)
    position_acceptance_ci95: list[list[float]] | None
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


def ratio_ci95(numerators: Sequence[float], denominators: Sequence[float]) -> list[float] | None:
    """[low, high]: the 95% interval of sum(numerators) / sum(denominators), one pair per independent decode; None for
    fewer than `MIN_DECODES_FOR_INTERVAL` decodes, where there is no spread to estimate the error from."""
    n = len(numerators)
    if n < MIN_DECODES_FOR_INTERVAL:
        return None
    total = sum(denominators)
    if total == 0:
        return [0.0, 0.0]
    r = sum(numerators) / total
    mean_x = total / n
    se = math.sqrt(sum((y - r * x) ** 2 for y, x in zip(numerators, denominators)) / (n * (n - 1))) / mean_x
    return [r - Z95 * se, r + Z95 * se]


def sampled_drafter(results: Sequence[SpecResult], block_size: int, reference: GreedyMetrics) -> SampledDrafter:
    """The metrics of one drafter's sampled decodes, with intervals, and its speedup over target-only sampling."""
    metrics = acceptance_metrics(results, block_size)
    metrics.speedup = reference.wall_s / metrics.wall_s if metrics.wall_s else 0.0
    cycles = [len(r.acceptance_lengths) for r in results]
    positions = [ratio_ci95([sum(1 for n in r.acceptance_lengths if n - 1 >= k) for r in results], cycles)
                 for k in range(1, block_size)]
    return SampledDrafter(
        metrics=metrics,
        tau_ci95=ratio_ci95([sum(r.acceptance_lengths) for r in results], cycles),
        # Every position has the same decodes: each has an interval, or (one decode) none has.
        position_acceptance_ci95=None if None in positions else [ci for ci in positions if ci is not None],
        acceptance_lengths=[list(r.acceptance_lengths) for r in results],
    )


def check_seeds(cfg: EvalConfig, prompts: int) -> None:
    """EvalError unless every sampled decode's seed (eval.seed + i for decode i of prompts x samples_per_prompt) is one
    torch takes: checked once the prompts are counted, before any model loads (and never at temperature 0)."""
    if cfg.temperature == 0:
        return
    decodes = prompts * cfg.samples_per_prompt
    if cfg.seed + decodes > SEED_LIMIT:
        raise EvalError(
            f"eval.seed {cfg.seed} + {decodes} sampled decodes passes {SEED_LIMIT - 1}, the largest seed torch takes "
            f"(decode i is seeded with seed + i); give a seed of at most {SEED_LIMIT - decodes}"
        )


def refuse_idle_sampling(cfg: EvalConfig, given: Sequence[str]) -> None:
    """EvalError when `given` (settings of `SAMPLED_ONLY` set on the command line, as the user spelled them) would be
    dropped without a word: the eval decodes greedy only (temperature 0), which none of them changes."""
    if cfg.temperature == 0 and given:
        they, them = ("it", "it") if len(given) == 1 else ("they", "them")
        raise EvalError(
            f"{', '.join(given)} set only the decodes at temperature, and eval.temperature is 0 (greedy only), so "
            f"{they} would change nothing; add --temperature T above 0 to sample, or drop {them}"
        )


def evaluate_sampled(
    hf_model, makers: dict[str, Callable[[], Proposer]], block_sizes: dict[str, int], prompts: Sequence[Sequence[int]],
    max_new_tokens: int, stops: Sequence[int], cfg: EvalConfig, sampling: Sampling, reporter: Reporter,
) -> SampledEval:
    """Each prompt S times: target-only sampling, then every drafter; progress ("eval sampled", decodes done,
    decodes)."""
    count = len(prompts) * cfg.samples_per_prompt
    target_only = []
    results: dict[str, list[SpecResult]] = {name: [] for name in makers}
    reporter.progress("eval sampled", 0, count)
    for i in range(count):
        prompt, seed = list(prompts[i // cfg.samples_per_prompt]), cfg.seed + i
        target_only.append(sample_decode(hf_model, prompt, max_new_tokens, Sampler(sampling, seed), stops))
        for name, make in makers.items():
            results[name].append(run_speculative(hf_model, make(), prompt, max_new_tokens, stops,
                                                 sampler=Sampler(sampling, seed)))
        reporter.progress("eval sampled", i + 1, count)
    new_tokens = sum(len(r.new_tokens) for r in target_only)
    wall = sum(r.wall_s for r in target_only)
    forwards = sum(r.target_forwards for r in target_only)
    reference = GreedyMetrics(new_tokens=new_tokens, target_forwards=forwards,
                              target_forwards_per_token=forwards / new_tokens if new_tokens else 0.0,
                              wall_s=wall, tokens_per_s=new_tokens / wall if wall else 0.0, min_margin=None)
    return SampledEval(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, proposal=sampling.proposal,
        seed=cfg.seed, samples_per_prompt=cfg.samples_per_prompt, decodes=count, target_only=reference,
        drafters={name: sampled_drafter(rs, block_sizes[name], reference) for name, rs in results.items()},
    )


__all__ = [
    "MIN_DECODES_FOR_INTERVAL", "SAMPLED_ONLY", "SEED_LIMIT", "SampledDrafter", "SampledEval", "check_seeds",
    "evaluate_sampled", "ratio_ci95", "refuse_idle_sampling", "sampled_drafter", "sampling_of",
]
