"""The frozen HF target as the decode loop uses it: one sequence, a cache, and features at the drafter's layer ids.

Layer id `i` is the output of decoder layer `i`, which is `hidden_states[i + 1]` (index 0 is the embedding output).
`crop` puts the whole target back to a shorter prefix: attention K/V by a cache crop, and the state of linear-attention
layers (hybrid targets) by `blockdraft.decode.linear_state`.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from blockdraft.decode.linear_state import LinearStateRollback, check_rollback_supported, target_layer_types
from blockdraft.errors import DecodeError
from blockdraft.model.split import decoder_layers


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the gap between the best and the second-best logit, in fp32."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


class CachedTarget:
    """An HF causal LM running one sequence with its own KV cache.

    `layer_ids` None: no features are gathered (target-only greedy, the n-gram drafter). `rollback_linear_state` False
    leaves linear-attention layers' state as the last forward left it (only the negative control of the tests does
    that).
    """

    def __init__(self, hf_model, layer_ids: list[int] | None = None, rollback_linear_state: bool = True):
        check_rollback_supported(hf_model.config)
        self.model = hf_model
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.device = next(hf_model.parameters()).device
        self.cache = DynamicCache(config=hf_model.config)
        types = target_layer_types(hf_model.config)
        self.linear = None
        if rollback_linear_state and any(kind != "full_attention" for kind in types):
            layers = decoder_layers(hf_model, len(types))
            if layers is None:
                raise DecodeError(f"cannot find the decoder layers of {type(hf_model).__name__} to roll back its "
                                  "linear-attention state")
            self.linear = LinearStateRollback(hf_model, layers, types)
        self._verified = 0  # tokens of the last forward whose linear state a crop can roll back
        self.rollback_s = 0.0  # time spent rolling linear-attention state back
        # transformers 5.x renamed `past_key_values` to `cache`; 4.x knows only the old name.
        params = inspect.signature(type(hf_model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.forwards = 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self, token_ids: torch.Tensor, start: int, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `token_ids` [1, n] at positions start..start+n-1 (the cache must hold exactly 0..start-1).

        Returns logits [1, n, V] (or [1, 1, V] with `last_only`) in the model's dtype and, when layer ids are set,
        features [1, n, K*H] = the concatenated outputs of the layers `layer_ids`.
        """
        if self.length != start:
            raise RuntimeError(f"target cache holds {self.length} positions, the block starts at {start}")
        n = token_ids.shape[1]
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        linear = self.linear if start > 0 and n > 1 else None  # a verify after the prefill: it may be rolled back
        if linear is not None:
            linear.begin(self.cache, n)
        try:
            out = self.model(
                input_ids=token_ids.to(self.device),
                position_ids=positions,
                use_cache=True,
                output_hidden_states=self.layer_ids is not None,
                logits_to_keep=1 if last_only else 0,
                **{self._cache_kw: self.cache},
            )
        finally:
            if linear is not None:
                linear.finish()
        self._verified = n if linear is not None else 0
        self.forwards += 1
        features = None
        if self.layer_ids is not None:
            features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits, features

    def crop(self, length: int) -> None:
        """Put the target back to positions 0..length-1: attention K/V cropped (transformers 5.24's crop takes a
        negative count to remove), linear-attention state recomputed over the kept tokens of the last verify."""
        excess = self.length - length
        if excess <= 0:
            return
        for layer in self.cache.layers:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                cast(Any, layer).crop(-excess)
        if self.linear is not None:
            if excess > self._verified:
                raise DecodeError(f"cannot roll linear-attention state back {excess} tokens: the last forward verified "
                                  f"{self._verified}")
            began = time.perf_counter()
            self.linear.rollback(self.cache, self._verified - excess)
            self.rollback_s += time.perf_counter() - began
        self._count_linear_positions(length)

    def _count_linear_positions(self, length: int) -> None:
        """Set the position count that linear-attention cache layers keep (transformers >= 5.25) to `length`: their
        count grows with every forward, the verify's rejected tokens and a rollback's replay included, and the cache's
        length is read from its first layer, which is a linear one on a Qwen3.5-style target."""
        for layer in self.cache.layers:
            count = getattr(layer, "cumulative_length_linear", None)
            if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(count, torch.Tensor):
                count.fill_(length)
