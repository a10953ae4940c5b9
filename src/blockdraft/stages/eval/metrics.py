"""What eval measures: acceptance and cost of each drafter, the target-only greedy reference, and where a speculative
output first departs from greedy output (with the tolerance that decides whether that departure is a rounding near-tie).

Definitions follow docs/DFLASH.md ("Decode loop"): tau is the mean of (accepted + 1) over every cycle of every prompt,
the last cycle included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel

from blockdraft.config import EvalConfig
from blockdraft.decode.speculative import GreedyResult, SpecResult


class DrafterMetrics(BaseModel):
    """Acceptance and cost of one drafter over every prompt.

    histogram[j]: cycles that committed j tokens (j = 1..B, keys are strings as in JSON). position_acceptance[k-1]: the
    fraction of cycles whose draft k was accepted (k = 1..B-1); conditional_acceptance[k-1]: the same among cycles that
    reached draft k. target_forwards_per_token: (prefills + verifies) / new tokens. Times in seconds; speedup: greedy
    wall time / this drafter's wall time on the same prompts.
    """

    tau: float
    cycles: int
    histogram: dict[str, int]
    position_acceptance: list[float]
    conditional_acceptance: list[float]
    new_tokens: int
    target_forwards: int
    target_forwards_per_token: float
    wall_s: float
    tokens_per_s: float
    draft_s: float
    verify_s: float
    # part of verify_s: linear-attention state rolled back after partial acceptances (hybrid targets)
    rollback_s: float = 0.0
    speedup: float = 0.0


class GreedyMetrics(BaseModel):
    """Target-only greedy decoding over every prompt; min_margin: the smallest top-2 logit gap met (None: no token)."""

    new_tokens: int
    target_forwards: int
    target_forwards_per_token: float
    wall_s: float
    tokens_per_s: float
    min_margin: float | None


class Divergence(BaseModel):
    """Where a speculative output first departs from target-only greedy output.

    `position` is the absolute token index; `margin` the target's top-2 logit gap there in the greedy run (a near-tie
    when tiny; inf when greedy had no token there); `tolerated` whether that margin is within the dtype's tolerance.
    """

    drafter: str
    prompt_index: int
    position: int
    new_token_index: int
    spec_token: int | None
    target_token: int | None
    margin: float
    tolerated: bool


def first_divergence(
    drafter: str, prompt_index: int, spec: SpecResult, greedy: GreedyResult, tolerance: float
) -> Divergence | None:
    """The first position where `spec.tokens` and `greedy.tokens` differ, or None when they are identical.

    Once two greedy sequences differ, every later position conditions on different text, so only the first
    difference says anything about the decode loop.
    """
    a, b = spec.tokens, greedy.tokens
    if a == b:
        return None
    common = min(len(a), len(b))
    position = next((i for i in range(common) if a[i] != b[i]), common)
    new_index = position - greedy.prompt_len
    margin = greedy.margins[new_index] if 0 <= new_index < len(greedy.margins) else float("inf")
    return Divergence(
        drafter=drafter,
        prompt_index=prompt_index,
        position=position,
        new_token_index=new_index,
        spec_token=a[position] if position < len(a) else None,
        target_token=b[position] if position < len(b) else None,
        margin=margin,
        tolerated=margin <= tolerance,
    )


def divergence_tolerance(settings: EvalConfig, dtype: torch.dtype) -> float:
    """The largest top-2 margin at which a divergence still counts as a rounding near-tie for this target dtype."""
    return settings.divergence_margin_fp32 if dtype == torch.float32 else settings.divergence_margin_bf16


def acceptance_metrics(results: Sequence[SpecResult], block_size: int) -> DrafterMetrics:
    """Acceptance and cost of one drafter over many prompts (`speedup` is left 0: it needs the greedy reference)."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    cycles = len(lengths)
    new_tokens = sum(len(r.new_tokens) for r in results)
    wall = sum(r.wall_s for r in results)
    forwards = sum(r.target_forwards for r in results)
    reached = [sum(1 for n in lengths if n - 1 >= k) for k in range(0, block_size)]  # reached[k]: cycles with a >= k
    return DrafterMetrics(
        tau=sum(lengths) / cycles if cycles else 0.0,
        cycles=cycles,
        histogram={str(j): sum(1 for n in lengths if n == j) for j in range(1, block_size + 1)},
        position_acceptance=[reached[k] / cycles if cycles else 0.0 for k in range(1, block_size)],
        conditional_acceptance=[reached[k] / reached[k - 1] if reached[k - 1] else 0.0 for k in range(1, block_size)],
        new_tokens=new_tokens,
        target_forwards=forwards,
        target_forwards_per_token=forwards / new_tokens if new_tokens else 0.0,
        wall_s=wall,
        tokens_per_s=new_tokens / wall if wall else 0.0,
        draft_s=sum(c.draft_s for r in results for c in r.cycles),
        verify_s=sum(c.verify_s for r in results for c in r.cycles),
        rollback_s=sum(r.rollback_s for r in results),
    )


def greedy_metrics(results: Sequence[GreedyResult]) -> GreedyMetrics:
    """Cost of target-only greedy decoding over many prompts, and the smallest top-2 margin it met."""
    new_tokens = sum(len(r.new_tokens) for r in results)
    wall = sum(r.wall_s for r in results)
    forwards = sum(r.target_forwards for r in results)
    return GreedyMetrics(
        new_tokens=new_tokens,
        target_forwards=forwards,
        target_forwards_per_token=forwards / new_tokens if new_tokens else 0.0,
        wall_s=wall,
        tokens_per_s=new_tokens / wall if wall else 0.0,
        min_margin=min((m for r in results for m in r.margins), default=None),
    )


def with_speedup(drafter: DrafterMetrics, greedy: GreedyMetrics) -> DrafterMetrics:
    """`drafter` with its wall-clock speedup over greedy on the same prompts (0 when it took no time)."""
    return drafter.model_copy(update={"speedup": greedy.wall_s / drafter.wall_s if drafter.wall_s else 0.0})


__all__ = [
    "Divergence", "DrafterMetrics", "GreedyMetrics", "acceptance_metrics", "divergence_tolerance", "first_divergence",
    "greedy_metrics", "with_speedup",
]
