"""One-call speculative decoding of one prompt, as the decode tests drive it: the proposer and `run_speculative`
together (the eval stage builds its proposers itself)."""

from __future__ import annotations

from collections.abc import Iterable

from blockdraft.decode.ngram import NgramProposer
from blockdraft.decode.speculative import DFlashProposer, SpecResult, run_speculative


def speculative_generate(
    target_hf_model, drafter, target_head, prompt_ids, max_new_tokens: int, stop_token_ids: Iterable[int] = ()
) -> SpecResult:
    """Greedy speculative decoding of one prompt with a DFlash drafter; output equals `greedy_decode`'s up to
    near-ties."""
    return run_speculative(target_hf_model, DFlashProposer(drafter, target_head), prompt_ids, max_new_tokens,
                           stop_token_ids)


def ngram_generate(
    target_hf_model, prompt_ids, max_new_tokens: int, stop_token_ids: Iterable[int], block_size: int, pad_token_id: int
) -> SpecResult:
    """Speculative decoding with the prompt-lookup drafter; same loop, rules and result as `speculative_generate`."""
    return run_speculative(target_hf_model, NgramProposer(block_size, pad_token_id), prompt_ids, max_new_tokens,
                           stop_token_ids)
