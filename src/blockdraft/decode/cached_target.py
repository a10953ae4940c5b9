"""The frozen HF target as the decode loop uses it: one sequence, a KV cache, and features at the drafter's layer ids.

Layer id `i` is the output of decoder layer `i`, which is `hidden_states[i + 1]` (index 0 is the embedding output).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from blockdraft.errors import DecodeError


def check_rollback_supported(hf_config) -> None:
    """Refuse targets whose per-layer state a KV-cache crop cannot roll back (rejected drafts would leak into it)."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    kinds = sorted({kind for kind in layer_types if kind != "full_attention"})
    if any("linear" in kind or "mamba" in kind or "recurrent" in kind for kind in kinds):
        raise DecodeError(
            f"the target has hybrid attention (layer_types include {kinds}): its recurrent state cannot be rolled back after "
            "rejected drafts, so speculative decoding would not be lossless; eval supports full-attention targets only until "
            "state snapshot/rollback exists (training such targets works)"
        )
    if kinds:
        raise DecodeError(
            f"the target has layer types {kinds}: a sliding-window cache cannot be cropped back after rejected drafts yet; "
            "eval supports full-attention targets only"
        )


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the gap between the best and the second-best logit, in fp32."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


class CachedTarget:
    """An HF causal LM running one sequence with its own KV cache.

    `layer_ids` None: no features are gathered (target-only greedy, the n-gram drafter).
    """

    def __init__(self, hf_model, layer_ids: list[int] | None = None):
        self.model = hf_model
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.device = next(hf_model.parameters()).device
        self.cache = DynamicCache(config=hf_model.config)
        # transformers 5.x renamed `past_key_values` to `cache`; 4.x knows only the old name.
        params = inspect.signature(type(hf_model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.forwards = 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, token_ids: torch.Tensor, start: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `token_ids` [1, n] at positions start..start+n-1 (the cache must hold exactly 0..start-1).

        Returns logits [1, n, V] (or [1, 1, V] with `last_only`) in the model's dtype and, when layer ids are set,
        features [1, n, K*H] = the concatenated outputs of the layers `layer_ids`.
        """
        if self.length != start:
            raise RuntimeError(f"target cache holds {self.length} positions, the block starts at {start}")
        n = token_ids.shape[1]
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions,
            use_cache=True,
            output_hidden_states=self.layer_ids is not None,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: self.cache},
        )
        self.forwards += 1
        features = None
        if self.layer_ids is not None:
            features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits, features

    def crop(self, length: int) -> None:
        """Drop cached positions >= `length` (transformers 5.24's crop takes a negative count to remove)."""
        excess = self.length - length
        if excess > 0:
            self.cache.crop(-excess)
