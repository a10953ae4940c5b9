"""Sampled decoding: the target's and the drafter's logits turned into the distribution a token is drawn from, the
seeded draws, and the verify step that keeps speculative sampling lossless (docs/DFLASH.md, "Sampled verify").

`Sampling` is the user's settings (temperature, top-k, top-p) and the serving engine's draft rule (`proposal`, one of
`PROPOSALS`: how the drafter proposes at temperature, docs/EVAL.md "Draft rules"); `processed_probs` applies the
settings to the target's logits, in the order serving engines apply them: temperature, then top-k, then top-p over what
top-k kept. A drafter's proposal is a `Proposal`: its draft tokens and, per slot, the distribution `q` each was drawn
from (None: drafts chosen without chance, a point mass on each, as an engine that proposes the argmax verifies them).
`rejection_verify` accepts draft x with probability min(1, p(x)/q(x)), on the first rejection draws from the normalised
residual max(0, p - q), and after a fully accepted block draws the bonus from p. The output is then distributed exactly
as target-only sampling's, whatever q is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from blockdraft.decode.cached_target import CachedTarget

# The serving engines' draft rules at temperature, by the name `eval.proposal` takes:
# - vllm: vLLM's default (`draft_sample_method` greedy): a DFlash drafter proposes each slot's argmax and a DFlash2
#   drafter its greedy walk; q is a point mass on each draft.
# - vllm-probabilistic: vLLM's `draft_sample_method` probabilistic: a DFlash slot is drawn from softmax(logits / T)
#   (no top-k or top-p on q), a DFlash2 walk from softmax(walk scores / T) over its K candidates; q is what they came
#   from.
# - sglang: SGLang's: a DFlash drafter proposes the argmax; a DFlash2 walk is sampled as under vllm-probabilistic, and
#   walks greedily when top-k is 1.
# Every rule verifies the same way: accept with min(1, p/q), on rejection draw from max(p - q, 0) normalised, which for
# a point mass q is "accept with p(x), else draw from p without x".
PROPOSALS = ("vllm", "vllm-probabilistic", "sglang")


@dataclass(frozen=True)
class Sampling:
    """Temperature > 0 (0 is greedy, which the decode loop runs as argmax), top_k 0 = off, top_p 1.0 = off, and the
    draft rule of the engine whose serving is measured (`PROPOSALS`)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    proposal: str = "vllm"

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("sampling needs temperature > 0; temperature 0 is greedy decoding")
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal {self.proposal!r} is none of {', '.join(PROPOSALS)}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")


def processed_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k (ties with the k-th kept) and top-p
    (the most likely tokens whose mass reaches top_p, the first always kept)."""
    x = logits.float() / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = x.topk(sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        above = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        drop = (above >= sampling.top_p).scatter(-1, order, above >= sampling.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Seeded draws for one decode: `Sampling` and one torch generator per device, all seeded with `seed`, so a decode
    is reproduced by its seed on the same devices."""

    def __init__(self, sampling: Sampling, seed: int):
        self.sampling, self.seed = sampling, seed
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits, self.sampling)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V] probabilities -> [...] token ids, one draw per row."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator(probs.device)).reshape(probs.shape[:-1])

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.rand(n, generator=self.generator(device), device=device)


@dataclass
class Proposal:
    """A sampled draft: `tokens` for the B-1 slots after the anchor, and `q` [B-1, V], the distribution each slot's
    token was drawn from (zero outside what the drafter could propose: top-k, top-p, a DFlash2 walk's K candidates). `q`
    None: the drafts were chosen without chance (the n-gram drafter), a point mass on each token."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Verify(Protocol):
    def __call__(self, proposal: Proposal, p: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
        """`p` [B, V]: the target's processed distribution at the anchor and each draft slot (p[k] is the one for the
        token after slot k). Returns (accepted drafts a, the token committed after them)."""
        ...


def rejection_verify(proposal: Proposal, p: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Lossless rejection sampling: accept draft k with probability min(1, p_k(x)/q_k(x)), in order; on the first
    rejection draw from max(0, p_k - q_k) normalised; after all B-1, draw the bonus from p_{B-1}."""
    drafts = torch.tensor(proposal.tokens, dtype=torch.long, device=p.device)
    n = len(proposal.tokens)
    px = p[:n].gather(1, drafts[:, None])[:, 0]
    if proposal.q is None:
        q = torch.zeros_like(p[:n]).scatter_(1, drafts[:, None], 1.0)
    else:
        q = proposal.q.to(device=p.device, dtype=p.dtype)
    qx = q.gather(1, drafts[:, None])[:, 0]
    # u < p(x)/q(x) without the division; a draft q gave no mass (never drawn from q) is rejected.
    accept = (sampler.uniform(n, p.device) * qx < px) & (qx > 0)
    rejected = (~accept).nonzero()
    if len(rejected) == 0:
        return n, int(sampler.draw(p[n]))
    k = int(rejected[0, 0])
    residual = (p[k] - q[k]).clamp(min=0.0)
    total = residual.sum()
    # A zero residual means p_k <= q_k everywhere, i.e. p_k == q_k, where a rejection has probability 0: rounding only.
    return k, int(sampler.draw(residual / total if total > 0 else p[k]))


@dataclass
class SampledResult:
    """Target-only sampling of one prompt: the tokens (prompt + new), the forwards and the wall time."""

    tokens: list[int]
    prompt_len: int
    target_forwards: int = 0
    wall_s: float = 0.0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@torch.inference_mode()
def sample_decode(target_hf_model, prompt_ids: Iterable[int], max_new_tokens: int, sampler: Sampler,
                  stop_token_ids: Iterable[int] = ()) -> SampledResult:
    """Target-only sampling with a KV cache, one token per forward, each drawn from the processed distribution."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt: eval needs at least one prompt token")
    stops = set(int(t) for t in stop_token_ids)
    target = CachedTarget(target_hf_model)
    began = time.perf_counter()
    logits, _ = target.forward(torch.tensor([prompt], dtype=torch.long), 0, last_only=True)
    tokens = list(prompt)
    while True:
        tokens.append(int(sampler.draw(sampler.probs(logits[0, -1]))))
        if len(tokens) - len(prompt) >= max_new_tokens or tokens[-1] in stops:
            break
        logits, _ = target.forward(torch.tensor([[tokens[-1]]], dtype=torch.long), len(tokens) - 1)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return SampledResult(tokens, len(prompt), target.forwards, time.perf_counter() - began)


__all__ = ["PROPOSALS", "Proposal", "SampledResult", "Sampler", "Sampling", "Verify", "processed_probs",
           "rejection_verify", "sample_decode"]
