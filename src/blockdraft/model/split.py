"""A target split over several devices by layer: which decoder layers each device holds, and the `device_map` that
loads them there.

The decoder layers go to the devices in order, in contiguous runs of about equal weight; everything else (the
embedding, rotary tables, final norm, LM head, a multimodal target's other towers) stays on the first device, where
the inputs enter and the features are gathered. transformers loads the weights straight onto those devices and moves
each layer's inputs to its device as the forward passes through (accelerate's hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.errors import SpecError

_META: dict[tuple[str, torch.dtype], nn.Module] = {}


def meta_target(hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """The target as `AutoModelForCausalLM` builds it, on the meta device (no memory, no weights read); kept per config
    and dtype."""
    from transformers import AutoModelForCausalLM

    key = (hf_config.to_json_string(), dtype)
    if key not in _META:
        with torch.device("meta"):
            _META[key] = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return _META[key]


def decoder_layers(hf_model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's stack of decoder layers: the text decoder's `layers` where HF names it (multimodal targets also hold
    vision blocks), else the first ModuleList with one entry per layer."""
    get_decoder = getattr(hf_model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in hf_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@dataclass(frozen=True)
class TargetSplit:
    """`devices` (the first takes the inputs), the device index of each decoder layer (`layer_devices`, contiguous
    and non-decreasing), the layers' module path (`layers_path`), the bytes of each layer and of the rest."""

    devices: tuple[str, ...]
    layer_devices: tuple[int, ...]
    layers_path: str
    layer_bytes: tuple[int, ...]
    rest_bytes: int
    rest_paths: tuple[str, ...]

    def device_map(self) -> dict[str, str]:
        """What `from_pretrained(device_map=...)` takes: every module (or loose parameter) outside the layers on the
        first device, layer i on its device."""
        placed = dict.fromkeys(self.rest_paths, self.devices[0])
        placed.update({f"{self.layers_path}.{i}": self.devices[d] for i, d in enumerate(self.layer_devices)})
        return placed

    def weight_bytes(self, index: int) -> int:
        """The target's bytes on device `index` of the group."""
        own = sum(b for b, d in zip(self.layer_bytes, self.layer_devices, strict=True) if d == index)
        return own + (self.rest_bytes if index == 0 else 0)

    def layers_on(self, index: int) -> list[int]:
        return [i for i, d in enumerate(self.layer_devices) if d == index]

    def describe(self) -> str:
        """One line: which layers each device holds."""
        parts = []
        for index, device in enumerate(self.devices):
            layers = self.layers_on(index)
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
            parts.append(f"{span} on {device}" + (" (+ embedding, norm, LM head)" if index == 0 else ""))
        return "target split by layer: " + ", ".join(parts)


def split_target(model: nn.Module, num_layers: int, devices: Sequence[str]) -> TargetSplit:
    """The split of `model` (real or on the meta device) over `devices`: layer i goes to the device whose equal share
    of the weights holds the middle of that layer, counting the first device's other modules before the layers."""
    layers = decoder_layers(model, num_layers)
    if layers is None:
        raise SpecError(f"cannot find the target's {num_layers} decoder layers to split them over {list(devices)}; "
                        "give placement.target_devices one device per entry for this target")
    layers_path = next(name for name, module in model.named_modules() if module is layers)
    rest_paths: list[str] = []

    def outside(module: nn.Module, path: str) -> None:
        """Every part of `module` that does not hold the layers, as module paths (and loose parameters)."""
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            rest_paths.append(f"{path}.{name}" if path else name)
        for name, child in module.named_children():
            full = f"{path}.{name}" if path else name
            if child is layers:
                continue
            if layers_path.startswith(full + "."):
                outside(child, full)
            else:
                rest_paths.append(full)

    outside(model, "")
    layer_bytes = tuple(_nbytes(layer) for layer in layers)
    rest = _nbytes(model) - sum(layer_bytes)
    share = (rest + sum(layer_bytes)) / len(devices)
    placed, before = [], rest
    for nbytes in layer_bytes:
        placed.append(min(len(devices) - 1, int((before + nbytes / 2) // share)))
        before += nbytes
    return TargetSplit(tuple(devices), tuple(placed), layers_path, layer_bytes, rest, tuple(rest_paths))


__all__ = ["TargetSplit", "decoder_layers", "meta_target", "split_target"]
