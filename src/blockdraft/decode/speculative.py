"""Speculative decoding, exactly as docs/DFLASH.md "Decode loop" and "Sampled verify" specify, and target-only greedy
decoding.

One sequence at a time (batch 1), like the reference implementation the golden vectors come from. The loop is written
once (`run_speculative`) and takes the drafter as a `Proposer`, so the DFlash drafter and the n-gram baseline are
verified by the very same target code. Without a `Sampler` it is greedy (draft accepted when it is the target's argmax);
with one, drafts are sampled and verified by rejection sampling (`blockdraft.decode.sampling`). Greedy is the limit of
the sampled rule at temperature 0, where p and q are point masses at their argmax: min(1, p/q) is 1 exactly when the
draft is the target's argmax, and the residual is that argmax; the loop runs that case as the argmax rule itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blockdraft.decode.cached_target import CachedTarget, top2_margin
from blockdraft.decode.sampling import Proposal, Sampler, Verify, rejection_verify
from blockdraft.model.dflash2 import greedy_walk, unary_logits, walk
from blockdraft.model.drafter import DFlashDrafter, DraftCache, draft_step
from blockdraft.model.target import TargetHead


class Proposer(Protocol):
    """Drafts the B-1 tokens after an anchor."""

    block_size: int
    mask_token_id: int

    @property
    def layer_ids(self) -> list[int] | None:
        """Target layers whose features it reads; None: it reads none."""
        ...

    def propose(self, tokens: list[int], new_features: torch.Tensor | None, start: int) -> list[int]:
        """`tokens`: every committed token, positions 0..start (the anchor last). `new_features` [1, n, K*H]: target
        features of positions start-n..start-1 not given before (None when `layer_ids` is None). Returns B-1 drafts
        for positions start+1..start+B-1."""
        ...

    def sample(self, tokens: list[int], new_features: torch.Tensor | None, start: int, sampler: Sampler) -> Proposal:
        """As `propose`, at temperature: the drafts drawn with `sampler`, with the distribution each was drawn from."""
        ...


@dataclass
class Cycle:
    """One draft/verify cycle: anchor position, accepted drafts a (a+1 tokens committed), seconds spent in each half."""

    start: int
    accepted: int
    draft_s: float
    verify_s: float


@dataclass
class SpecResult:
    tokens: list[int]  # prompt + new tokens, truncated to P + max_new_tokens and after the first stop token
    prompt_len: int
    acceptance_lengths: list[int]  # a + 1 per cycle, the last cycle included
    cycles: list[Cycle] = field(default_factory=list)
    target_forwards: int = 0  # the prefill and one verify per cycle
    wall_s: float = 0.0
    rollback_s: float = 0.0  # seconds of the verify halves spent rolling linear-attention state back (hybrid targets)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@dataclass
class GreedyResult:
    tokens: list[int]
    prompt_len: int
    margins: list[float]  # target's top-2 logit margin at each generated position, in order
    target_forwards: int = 0
    wall_s: float = 0.0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_tensor(prompt_ids: Iterable[int] | torch.Tensor) -> tuple[list[int], torch.Tensor]:
    ids = prompt_ids.reshape(-1).tolist() if isinstance(prompt_ids, torch.Tensor) else [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("empty prompt: eval needs at least one prompt token")
    return ids, torch.tensor([ids], dtype=torch.long)


def _truncate(tokens: list[int], prompt_len: int, max_new_tokens: int, stops: set[int]) -> list[int]:
    tokens = tokens[: prompt_len + max_new_tokens]
    for i in range(prompt_len, len(tokens)):
        if tokens[i] in stops:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def run_speculative(
    target_hf_model,
    proposer: Proposer,
    prompt_ids,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    rollback_linear_state: bool = True,
    sampler: Sampler | None = None,
    verify: Verify = rejection_verify,
) -> SpecResult:
    """Prefill, then draft / verify / accept / crop until P + max_new_tokens positions are filled or a stop token
    appears.

    `sampler` None: greedy. With a sampler, the prefill's token and every committed token are drawn, and `verify`
    decides each cycle (only the tests' broken verifies replace `rejection_verify`). `rollback_linear_state` False
    exists for the negative control of the tests only: a hybrid target then keeps the linear-attention state of rejected
    drafts, and the output diverges from greedy."""
    prompt, prompt_t = _prompt_tensor(prompt_ids)
    stops = set(int(t) for t in stop_token_ids)
    block_size = proposer.block_size
    target = CachedTarget(target_hf_model, proposer.layer_ids, rollback_linear_state=rollback_linear_state)
    began = time.perf_counter()

    # 1. Prefill: positions 0..P-1; the greedy token goes to position P; all P positions are the first new context.
    logits, features = target.forward(prompt_t, 0, last_only=True)  # [1, 1, V]: P x V logits can be gigabytes
    first = logits[0, -1].argmax() if sampler is None else sampler.draw(sampler.probs(logits[0, -1]))
    tokens = prompt + [int(first)]
    prompt_len = len(prompt)
    max_length = prompt_len + max_new_tokens
    start = prompt_len
    lengths: list[int] = []
    cycles: list[Cycle] = []
    checked = prompt_len

    while start < max_length:
        # 2a. Draft B-1 tokens after the anchor at `start`.
        t0 = time.perf_counter()
        proposal = (
            Proposal(proposer.propose(tokens, features, start))
            if sampler is None
            else proposer.sample(tokens, features, start, sampler)
        )
        drafts = proposal.tokens
        _sync(target.device)
        t1 = time.perf_counter()
        # 2b. Verify: one target forward over [anchor, drafts] at positions start..start+B-1.
        block = torch.tensor([[tokens[start], *drafts]], dtype=torch.long)
        logits, block_features = target.forward(block, start)
        if sampler is None:
            # 2c. Accept the longest prefix with draft[k] == posterior[k-1]; posterior[a] is the bonus token.
            posterior = logits[0].argmax(dim=-1).tolist()
            accepted = 0
            while accepted < block_size - 1 and drafts[accepted] == posterior[accepted]:
                accepted += 1
            bonus = posterior[accepted]
        else:
            # 2c'. Rejection sampling against the target's processed distribution at each position of the block.
            accepted, bonus = verify(proposal, sampler.probs(logits[0]), sampler)
        tokens.extend(drafts[:accepted])
        tokens.append(bonus)
        # 2d. Commit a+1 positions; the bonus is not in the cache, it is the next anchor.
        start += accepted + 1
        target.crop(start)
        features = None if block_features is None else block_features[:, : accepted + 1]
        _sync(target.device)
        cycles.append(Cycle(start=start - accepted - 1, accepted=accepted, draft_s=t1 - t0,
                            verify_s=time.perf_counter() - t1))
        lengths.append(accepted + 1)
        # 2e. Stop once a stop token is among the committed new tokens (the first cycle also sees the prefill's token).
        if stops and any(t in stops for t in tokens[checked:]):
            break
        checked = len(tokens)

    return SpecResult(
        tokens=_truncate(tokens, prompt_len, max_new_tokens, stops),
        prompt_len=prompt_len,
        acceptance_lengths=lengths,
        cycles=cycles,
        target_forwards=target.forwards,
        wall_s=time.perf_counter() - began,
        rollback_s=target.rollback_s,
    )


@torch.inference_mode()
def greedy_decode(target_hf_model, prompt_ids, max_new_tokens: int, stop_token_ids: Iterable[int] = ()) -> GreedyResult:
    """Target-only greedy decoding with a KV cache, one token per forward; records each position's top-2 margin."""
    prompt, prompt_t = _prompt_tensor(prompt_ids)
    stops = set(int(t) for t in stop_token_ids)
    target = CachedTarget(target_hf_model)
    began = time.perf_counter()
    logits, _ = target.forward(prompt_t, 0, last_only=True)
    tokens = list(prompt)
    margins: list[float] = []
    while True:
        last = logits[0, -1]
        tokens.append(int(last.argmax()))
        margins.append(float(top2_margin(last)))
        if len(tokens) - len(prompt) >= max_new_tokens or tokens[-1] in stops:
            break
        logits, _ = target.forward(torch.tensor([[tokens[-1]]], dtype=torch.long), len(tokens) - 1)
    _sync(target.device)
    return GreedyResult(tokens, len(prompt), margins, target.forwards, time.perf_counter() - began)


class DFlashProposer:
    """The DFlash drafter as a `Proposer`: one `draft_step` over the new context and [anchor, m x (B-1)], then the
    argmax of each slot, or for a DFlash2 drafter the candidate selector's greedy walk from the anchor (`use_selector`
    False: the unary argmax instead, which measures what the selector earns).

    `target_head` supplies the target's embedding and LM head on the drafter's device
    (`blockdraft.model.target.TargetHead`).
    """

    def __init__(self, drafter: DFlashDrafter, target_head: TargetHead, use_selector: bool = True):
        self.drafter = drafter
        self.head = target_head
        self.use_selector = use_selector and drafter.candidate_selector is not None
        self.block_size = drafter.spec.block_size
        self.mask_token_id = drafter.spec.mask_token_id
        self.layer_ids = list(drafter.spec.target_layer_ids)
        self.cache = DraftCache()
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype

    def propose(self, tokens: list[int], new_features: torch.Tensor | None, start: int) -> list[int]:
        hidden, block = self._draft(tokens, new_features, start)
        logits = self.head.logits(hidden[:, 1:])
        spec2 = self.drafter.spec.dflash2
        if spec2 is None:
            return logits.argmax(dim=-1)[0].tolist()
        unary = unary_logits(logits, spec2)
        if not self.use_selector:
            return unary.argmax(dim=-1)[0].tolist()
        assert self.drafter.candidate_selector is not None  # built with spec.dflash2
        return greedy_walk(self.drafter.candidate_selector, hidden[:, 1:], unary, block[:, 0]).path[0].tolist()

    def _draft(
        self, tokens: list[int], new_features: torch.Tensor | None, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drafter's hidden states [1, B, H], the block [1, B] they were drafted for: tokens[start], then
        masks)."""
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = tokens[start]
        assert new_features is not None, "a DFlash drafter reads target features at every cycle"
        features = new_features.to(device=self.device, dtype=self.dtype)
        # draft_step crops its cache back to `start` itself: context K/V only, never the block's.
        return draft_step(self.drafter, self.cache, features, self.head.embed(block), start), block

    def sample(self, tokens: list[int], new_features: torch.Tensor | None, start: int, sampler: Sampler) -> Proposal:
        """The drafts at temperature under the sampler's draft rule (`blockdraft.decode.sampling.PROPOSALS`).

        Where the rule proposes the argmax (DFlash under `vllm` and `sglang`, DFlash2 under `vllm`, and under `sglang`
        at top-k 1) the drafts are greedy decoding's and q is None, a point mass on each. A sampled DFlash slot is drawn
        from softmax(logits / T), the target's temperature without its top-k or top-p. A sampled DFlash2 walk draws each
        slot's candidate from the softmax of its walk scores at the temperature (the scores given the candidate drawn
        before it); q is that distribution on the slot's K candidates and zero elsewhere. Without the selector
        (`use_selector` False, a measurement no engine serves) the unary logits stand in for DFlash's, under the
        rule's DFlash treatment. Rejection sampling is lossless whatever the drafts come from, as long as q is the
        distribution they were drawn from."""
        rule, temperature = sampler.sampling.proposal, sampler.sampling.temperature
        spec2 = self.drafter.spec.dflash2
        walks = spec2 is not None and self.use_selector
        sampled = rule == "vllm-probabilistic" or (walks and rule == "sglang" and sampler.sampling.top_k != 1)
        if not sampled:
            return Proposal(self.propose(tokens, new_features, start))
        hidden, block = self._draft(tokens, new_features, start)
        logits = self.head.logits(hidden[:, 1:])
        if spec2 is None:
            return _drawn(logits[0], temperature, sampler)
        unary = unary_logits(logits, spec2)
        if not walks:
            return _drawn(unary[0], temperature, sampler)
        assert self.drafter.candidate_selector is not None  # built with spec.dflash2
        drawn_from: list[torch.Tensor] = []

        def draw(scores: torch.Tensor, _slot: int) -> torch.Tensor:
            probs = torch.softmax(scores.float() / temperature, dim=-1)  # [1, K]
            drawn_from.append(probs)
            return sampler.draw(probs)

        path = walk(self.drafter.candidate_selector, hidden[:, 1:], unary, block[:, 0], draw)
        q = torch.zeros(unary.shape[1:], dtype=torch.float32, device=unary.device)  # [B-1, V]
        q.scatter_(-1, path.candidates[0], torch.cat(drawn_from, dim=0))
        return Proposal(path.path[0].tolist(), q)


def _drawn(logits: torch.Tensor, temperature: float, sampler: Sampler) -> Proposal:
    """Each slot's token drawn from softmax(logits / T) [B-1, V], untruncated, with that distribution as q."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    return Proposal(sampler.draw(q).tolist(), q)
