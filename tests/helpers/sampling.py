"""The chi-square check that speculative sampling is lossless in distribution (tests/test_sampling*.py): the exact
distribution of target-only sampling's first two new tokens, and Pearson's test of observed counts against it."""

from __future__ import annotations

import torch

from blockdraft.decode.sampling import Sampling, processed_probs

THINKING = Sampling(temperature=0.6, top_p=0.95, top_k=20)  # Qwen3's recommended thinking-mode settings
ALPHA = 1e-3  # the correct verify fails with this probability (a fixed seed makes each run the same)
MIN_EXPECTED = 5.0  # cells with fewer expected samples are pooled into one, as the chi-square approximation needs


def exact_first_two(target, prompt: list[int], sampling: Sampling) -> dict[tuple[int, int], float]:
    """P(x1, x2) of target-only sampling, by enumeration: p(x1 | prompt) * p(x2 | prompt, x1) over x1's support."""
    with torch.inference_mode():
        p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], sampling)
        firsts = p1.nonzero()[:, 0]
        rows = torch.tensor([[*prompt, int(x)] for x in firsts])
        p2 = processed_probs(target(rows).logits[:, -1], sampling)
    return {
        (int(x1), int(x2)): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(firsts) for x2 in p2[i].nonzero()[:, 0]
    }


def chi_square(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> tuple[float, int, float]:
    """Pearson's chi-square of `counts` against the distribution `expected`: (statistic, degrees of freedom, p-value).
    Cells expected below MIN_EXPECTED are pooled into one; an outcome of probability 0 lands there too."""
    n = sum(counts.values())
    big = {cell for cell, prob in expected.items() if prob * n >= MIN_EXPECTED}
    observed = [counts.get(cell, 0) for cell in big]
    wanted = [expected[cell] * n for cell in big]
    rest_observed, rest_wanted = n - sum(observed), n - sum(wanted)
    if rest_wanted > 0:
        observed.append(rest_observed)
        wanted.append(rest_wanted)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    df = len(wanted) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                   torch.tensor(stat / 2, dtype=torch.float64)))
