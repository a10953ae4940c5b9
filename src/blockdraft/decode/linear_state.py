"""Rolling back the state of linear-attention target layers after a verify (hybrid targets: Qwen3.5/3.6, Qwen3-Next).

A Gated DeltaNet layer carries two states from one token to the next: a short window of its convolution's inputs and a
recurrent state (one matrix per value head). Cropping the KV cache after a verify of B tokens rolls back the attention
layers, not these. After a verify that commits only c < B tokens, each linear layer's state must be the one after
exactly those c tokens, or every later token is computed from a state that has seen rejected drafts.

How it is done here (no extra target forward): during the verify, the outputs of each linear layer's projections
(its `nn.Linear` children) are kept, and its conv and recurrent states are copied before the verify starts. To roll
back, the states are put back and the layer's own forward is run once more over the first c positions with every
projection replaced by a replay of what it computed in the verify: the convolution and the delta rule run again on c
tokens (the layer's own code, so its exact numerics), and no weight matrix is read again. The cost is that of the
recurrence over c <= B tokens per linear layer, a small share of a cycle (bench/eval.py measures it).

Where a fused kernel runs the whole layer without calling its projections, nothing is captured and the rollback
refuses with an error instead of silently keeping a wrong state.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from blockdraft.errors import DecodeError

LINEAR_ATTENTION = "linear_attention"
# Layer kinds whose per-token state a cache crop rolls back (attention K/V), and those this module rolls back.
CROPPABLE_KINDS = {"full_attention"}
SUPPORTED_KINDS = CROPPABLE_KINDS | {LINEAR_ATTENTION}


def target_layer_types(hf_config: Any) -> list[str]:
    """The target's per-layer kinds (the text config's `layer_types`); all full attention when it has none."""
    getter = getattr(hf_config, "get_text_config", None)
    text_config: Any = getter() if callable(getter) else hf_config
    types = list(getattr(text_config, "layer_types", None) or [])
    return types or ["full_attention"] * int(text_config.num_hidden_layers)


def check_rollback_supported(hf_config: Any) -> None:
    """Refuse, by name, target layer kinds whose state the decode loop cannot roll back after rejected drafts."""
    unsupported = sorted({kind for kind in target_layer_types(hf_config) if kind not in SUPPORTED_KINDS})
    if unsupported:
        raise DecodeError(
            f"the target has layer types {unsupported}: speculative decoding cannot roll their state back after "
            f"rejected drafts, so it would not be lossless; eval supports {sorted(SUPPORTED_KINDS)} layers"
        )


class _Replay(nn.Module):
    """Stands in for a projection during a rollback: returns the first `length` positions of what it computed in the
    verify."""

    def __init__(self, output: torch.Tensor, length: int) -> None:
        super().__init__()
        self.output = output[:, :length]

    def forward(self, _x: torch.Tensor) -> torch.Tensor:
        return self.output


class LinearStateRollback:
    """Keeps what a rollback of the linear-attention layers needs during one verify, and performs it.

    Use: `begin(cache)` before the verify forward, `finish()` after it, then `rollback(cache, committed)` when only
    `committed` of the verified tokens are kept (none needed when all are).
    """

    def __init__(self, hf_model: Any, decoder_layers: nn.ModuleList, layer_types: list[str]) -> None:
        self.mixers: dict[int, nn.Module] = {}
        for index, kind in enumerate(layer_types):
            if kind != LINEAR_ATTENTION:
                continue
            mixer = getattr(decoder_layers[index], "linear_attn", None)
            if not isinstance(mixer, nn.Module):
                raise DecodeError(
                    f"target layer {index} is linear attention but has no `linear_attn` module "
                    f"({type(decoder_layers[index]).__name__}); its state cannot be rolled back"
                )
            self.mixers[index] = mixer
        self.hidden_size = int(hf_model.config.get_text_config().hidden_size)
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._captured: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._tokens = 0
        first = next(iter(self.mixers.values()), None)
        params = inspect.signature(type(first).forward).parameters if first is not None else {}
        self._cache_kw = "cache" if "cache" in params else "cache_params"

    def __bool__(self) -> bool:
        return bool(self.mixers)

    def begin(self, cache: Any, num_tokens: int) -> None:
        """Before a verify of `num_tokens`: copy each linear layer's conv and recurrent state and start capturing."""
        self._snapshots, self._captured, self._tokens = {}, {}, num_tokens
        for index in self.mixers:
            layer = cache.layers[index]
            self._snapshots[index] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
        for index, mixer in self.mixers.items():
            store = self._captured.setdefault(index, {})
            for name, child in mixer.named_children():
                if isinstance(child, nn.Linear):
                    self._handles.append(child.register_forward_hook(self._keep(store, name)))

    @staticmethod
    def _keep(store: dict[str, torch.Tensor], name: str):
        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
            store[name] = output

        return hook

    def finish(self) -> None:
        """After the verify forward: stop capturing."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def rollback(self, cache: Any, committed: int) -> None:
        """Make every linear layer's state the one after the first `committed` verified tokens."""
        if not self._snapshots:
            raise DecodeError("linear-attention rollback without a verify to roll back (begin() was not called)")
        if not 0 <= committed < self._tokens:
            raise ValueError(f"rollback to {committed} of {self._tokens} verified tokens")
        for index, mixer in self.mixers.items():
            conv, recurrent = self._snapshots[index]
            layer = cache.layers[index]
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(recurrent)
            if committed:
                self._replay(index, mixer, cache, committed)
        self._snapshots, self._captured = {}, {}

    def _replay(self, index: int, mixer: nn.Module, cache: Any, committed: int) -> None:
        captured = self._captured.get(index, {})
        projections = {name: child for name, child in mixer.named_children() if isinstance(child, nn.Linear)}
        stale = [name for name in projections if captured.get(name) is None or captured[name].shape[1] != self._tokens]
        if stale:
            raise DecodeError(
                f"target layer {index} (linear attention) ran the verify without calling its projections {stale} (a "
                "fused kernel?): its state cannot be recomputed, so decoding would not be lossless; load the target "
                "without that kernel"
            )
        device = next(iter(captured.values())).device
        placeholder = torch.empty((1, committed, self.hidden_size), device=device,
                                  dtype=next(iter(captured.values())).dtype)
        try:
            for name in projections:
                setattr(mixer, name, _Replay(captured[name], committed))
            mixer(placeholder, **{self._cache_kw: cache})
        finally:
            for name, child in projections.items():
                setattr(mixer, name, child)
