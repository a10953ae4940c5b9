"""The n-gram (prompt-lookup) baseline drafter: copy what followed the latest earlier occurrence of the current suffix.

It needs no training and no target features, and runs through the same verify loop as the DFlash drafter, so its tau
is the floor a trained drafter has to beat on the same prompts.
"""

from __future__ import annotations

import torch

from blockdraft.decode.sampling import Proposal, Sampler


class NgramProposer:
    """Drafts B-1 tokens by matching the longest suffix (max_ngram down to min_ngram tokens) earlier in the sequence.

    Slots it has nothing for hold `pad_token_id` (the mask id): the target rejects them like any wrong draft.
    """

    layer_ids: list[int] | None = None  # it reads no target features

    def __init__(self, block_size: int, pad_token_id: int, max_ngram: int = 3, min_ngram: int = 1):
        if block_size < 2:
            raise ValueError("block_size must be at least 2 (one anchor, one draft)")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("n-gram sizes need 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.mask_token_id = pad_token_id
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], new_features: torch.Tensor | None, start: int) -> list[int]:
        width = self.block_size - 1
        history = tokens[: start + 1]
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            # Latest earlier occurrence first: recent text predicts the continuation best.
            for i in range(len(history) - n - 1, -1, -1):
                if history[i : i + n] == suffix:
                    follow = history[i + n : i + n + width]
                    return follow + [self.mask_token_id] * (width - len(follow))
        return [self.mask_token_id] * width


    def sample(self, tokens: list[int], new_features: torch.Tensor | None, start: int, sampler: Sampler) -> Proposal:
        """The same copy at temperature: chosen without chance, so a point mass on each draft (`Proposal.q` None)."""
        return Proposal(self.propose(tokens, new_features, start))
