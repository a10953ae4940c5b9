"""The frozen target: hidden-state features for the drafter, and drafter-side copies of its embedding and LM head.

Works for any HF causal LM, hybrid-attention ones included: only the outputs of decoder layers are read.
Layer id i means the output of decoder layer i, which is `hidden_states[i + 1]` in HF's output_hidden_states tuple.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.config import layer_ids_problem
from blockdraft.errors import ConfigError, SpecError
from blockdraft.model.spec import TargetShape
from blockdraft.model.split import decoder_layers, meta_target, split_target
from blockdraft.reporter import Reporter

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TargetHead(nn.Module):
    """Frozen, bit-equal copies of the target's embedding [V, H] and LM head [V, H] (+ bias if any) on the drafter's
    device.

    Held as buffers: never parameters, so never in an optimizer or a DDP gradient bucket, and never exported.
    """

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    lm_head_bias: torch.Tensor | None

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("embed_weight", embed_tokens.weight.detach().to(device=device, copy=True))
        self.register_buffer("lm_head_weight", lm_head.weight.detach().to(device=device, copy=True))
        bias = getattr(lm_head, "bias", None)
        self.register_buffer("lm_head_bias", None if bias is None else bias.detach().to(device=device, copy=True))

    @classmethod
    def from_target(cls, hf_model: PreTrainedModel, device: torch.device | str | None = None) -> TargetHead:
        return cls(cast(nn.Embedding, hf_model.get_input_embeddings()),
                   cast(nn.Linear, hf_model.get_output_embeddings()), device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] long -> embeddings [..., H]."""
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [..., H] -> logits [..., V]; the caller chunks over positions where V is large."""
        return F.linear(hidden, self.lm_head_weight, self.lm_head_bias)


class _StopForward(Exception):
    """Raised by a hook once the deepest needed layer has run: the remaining layers and the LM head are skipped."""


class TargetModel:
    """Wraps an HF AutoModelForCausalLM (frozen, eval mode) and returns the hidden states at `layer_ids`."""

    def __init__(self, hf_model: nn.Module, layer_ids: list[int]) -> None:
        self.model = hf_model.eval().requires_grad_(False)
        self.shape = TargetShape.from_config(hf_model.config)
        bad = [i for i in layer_ids if not 0 <= i <= self.shape.num_layers - 2]
        if bad:
            raise SpecError(
                f"target layer ids {bad} outside 0..{self.shape.num_layers - 2} for a {self.shape.num_layers}-layer "
                "target; fix dflash.target_layer_ids"
            )
        problem = layer_ids_problem(layer_ids)
        if problem:
            raise SpecError(f"dflash.target_layer_ids {problem}; use {sorted(set(layer_ids))}")
        self.layer_ids = list(layer_ids)
        self.layers = decoder_layers(hf_model, self.shape.num_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [b, S] -> concatenated outputs of decoder layers `layer_ids` [b, S, K*H]; the layers after the
        deepest of them and the LM head do not run. With `position_ids` [b, S] the sequences are packed rows (positions
        restart at 0 where a row starts) and each row is computed alone (`packed`; `attention_mask` then marks the
        rows' tokens)."""
        if position_ids is not None:
            return self.packed(input_ids, position_ids, False, attention_mask)[0]
        return self._run(input_ids, attention_mask, final=False)[0]

    @torch.no_grad()
    def features_and_final(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`features`, and the final normed hidden states [b, S, H]: exactly what the LM head reads (captured at its
        input; the [b, S, V] logits are never computed), from which the loss makes the target's own next-token
        distribution (`train.distill_weight`). Every decoder layer runs."""
        if position_ids is not None:
            feats, final = self.packed(input_ids, position_ids, True, attention_mask)
        else:
            feats, final = self._run(input_ids, attention_mask, final=True)
        assert final is not None
        return feats, final

    @property
    def packs_in_one_forward(self) -> bool:
        """Whether packed sequences run in one forward (`packed`): only a full-attention target whose attention kernel
        takes variable-length sequences (flash attention reads them from the position ids), which then computes no
        more than each row alone. SDPA and eager attention compute every score of the packed sequence and mask the
        other rows' (measured on the CPU: a packed forward gains less over a padded one than each row run alone), and a
        hybrid target's linear-attention layers would carry their state from one row into the next."""
        implementation = str(getattr(self.model.config, "_attn_implementation", "") or "")
        return not self.shape.is_hybrid and implementation.startswith("flash_attention")

    def packed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, final: bool, real: torch.Tensor | None = None,
        one_forward: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features (and the final states) of packed sequences [p, T], every row seen alone; `position_ids` restart at 0
        where a row (or the padding) begins, `real` [p, T] marks the rows' tokens (None: all). `one_forward` (None:
        `packs_in_one_forward`): the sequences run as one, laid end to end in a batch of one (flash attention takes
        rows from the position ids only then), with those position ids and no attention mask, from which transformers
        builds a block-diagonal causal mask on the eager and SDPA paths; else each row runs on its own, unpadded, and
        its states are laid in place (the padding's stay 0)."""
        b, s = input_ids.shape
        if self.packs_in_one_forward if one_forward is None else one_forward:
            feats, last = self._run(input_ids.reshape(1, b * s), None, final, position_ids.reshape(1, b * s))
            return feats.reshape(b, s, -1), None if last is None else last.reshape(b, s, -1)
        starts = (position_ids == 0).cpu()  # one copy to the host, not one per sequence
        feats: torch.Tensor | None = None
        finals: torch.Tensor | None = None
        for i in range(b):
            bounds = torch.nonzero(starts[i]).flatten().tolist() + [s]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                if real is not None and not bool(real[i, lo]):
                    continue  # the padding after the last row
                part, part_final = self._run(input_ids[i : i + 1, lo:hi], None, final)
                if feats is None:
                    feats = part.new_zeros(b, s, part.shape[-1])
                feats[i, lo:hi] = part[0]
                if part_final is not None:
                    if finals is None:
                        finals = part_final.new_zeros(b, s, part_final.shape[-1])
                    finals[i, lo:hi] = part_final[0]
        assert feats is not None, "a packed batch holds at least one row"
        return feats, finals

    def _run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, final: bool,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward that captures the feature layers (and with `final` the LM head's input), stopping as early as it
        can."""
        captured: dict[Any, torch.Tensor] = {}
        deepest = None if final else max(self.layer_ids)
        # else the layers come from output_hidden_states, and the model must return
        hooked_layers = self.layers is not None

        def capture(index: int):
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                captured[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _StopForward

            return hook

        def capture_head_input(_module: nn.Module, args: Any) -> None:
            captured["final"] = args[0]
            if hooked_layers:
                raise _StopForward

        handles = []
        if final:
            head: nn.Module | None = cast(Any, self.model).get_output_embeddings()
            if head is None:
                raise SpecError("the target has no output embeddings (LM head); train.distill_weight needs one, set it "
                                "to 0")
            handles.append(head.register_forward_pre_hook(capture_head_input))
        if self.layers is not None:
            handles += [self.layers[i].register_forward_hook(capture(i)) for i in set(self.layer_ids)]
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             output_hidden_states=not hooked_layers, use_cache=False)
            if not hooked_layers:
                captured.update({i: out.hidden_states[i + 1] for i in self.layer_ids})
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        # a target split over devices (device_map) leaves layer outputs on different devices: gather on the input's
        feats = torch.cat([captured[i].to(input_ids.device) for i in self.layer_ids], dim=-1)
        return feats, captured["final"].to(input_ids.device) if final else None


# The fast kernels transformers uses for linear-attention layers when they are importable
# (`pip install blockdraft[gpu]`).
LINEAR_ATTENTION_KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def missing_kernels_warning(hf_config: Any, device: torch.device | str) -> str | None:
    """One line when a hybrid-attention target runs on CUDA without the linear-attention kernels (correct, but slow)."""
    from importlib.util import find_spec

    if torch.device(device).type != "cuda" or not TargetShape.from_config(hf_config).is_hybrid:
        return None
    missing = [package for module, package in LINEAR_ATTENTION_KERNELS.items() if find_spec(module) is None]
    if not missing:
        return None
    return (
        f"the target has linear-attention layers and {', '.join(missing)} is not installed: transformers runs them "
        "with slow reference PyTorch kernels on the GPU; install them with `pip install 'blockdraft[gpu]'`"
    )


TARGET_DTYPES = ("float32", "bfloat16", "float16")


def target_dtype(configured: str | None, hf_config: Any) -> str:
    """The dtype the target runs in and the drafter is exported in: `target.dtype` when set, else the one the target's
    config names (`dtype`, or `torch_dtype` in older configs; a composite config's text part when only it names one),
    else float32 (what transformers loads such a checkpoint in). The same rule for train, eval, generate and export."""
    if configured:
        return configured
    for cfg in (hf_config, getattr(hf_config, "get_text_config", lambda: hf_config)()):
        named = getattr(cfg, "dtype", None) or getattr(cfg, "__dict__", {}).get("torch_dtype")
        if named is None:
            continue
        name = str(named).removeprefix("torch.")
        if name not in TARGET_DTYPES:
            raise ConfigError(f"the target's config names dtype {name}; set target.dtype to one of "
                              f"{', '.join(TARGET_DTYPES)}")
        return name
    return "float32"


def load_target(
    path: str,
    device: torch.device | str | Sequence[torch.device | str] = "cpu",
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    reporter: Reporter | None = None,
) -> PreTrainedModel:
    """An HF causal LM from a local folder or hub id, frozen, in eval mode, on `device` (or split by layer over a
    sequence of devices, `split_target`: the inputs go to the first), in `dtype` (None: `target_dtype` of its config);
    warns through `reporter` when a hybrid target on CUDA lacks its fast kernels.

    The weights are read straight onto their devices in `dtype` (`device_map`): a 27B target never passes through host
    RAM whole, as it would if loaded on the CPU and then moved, once per rank. A split is checked after loading: the
    model's own `hf_device_map` must place every layer where the split says."""
    from transformers import AutoModelForCausalLM

    hf_config = load_target_config(path)  # a wrong path fails here with one line, not a loader traceback
    torch_dtype: torch.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, target_dtype(dtype,
                                                                                                         hf_config))
    devices = [str(d) for d in device] if isinstance(device, Sequence) and not isinstance(device, str) else [
        str(device)]
    split = None
    if len(devices) > 1:
        split = split_target(meta_target(hf_config, torch_dtype), TargetShape.from_config(hf_config).num_layers,
                             devices)
    kwargs: dict[str, Any] = {"dtype": torch_dtype,
                              "device_map": split.device_map() if split else torch.device(devices[0])}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    warning = next(filter(None, (missing_kernels_warning(hf_config, d) for d in dict.fromkeys(devices))), None)
    if warning and reporter is not None:
        reporter.warn(warning)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if split is not None and not hasattr(model, "hf_device_map"):
        # transformers hooks the layers only where the map names two devices or more; a group that names one device
        # several times (the CPU's) still runs through the same per-layer hooks, so the split is what runs.
        from accelerate import dispatch_model

        quiet = logging.getLogger("accelerate.big_modeling")  # it calls weights on the CPU offloaded: these are not
        level, quiet.level = quiet.level, logging.ERROR
        try:
            mapping: dict[str, str | int | torch.device] = dict(split.device_map())
            # main_device as the string "cpu": accelerate compares it with that string to tell the CPU from offloading
            dispatch_model(model, mapping, main_device=cast(Any, devices[0]), force_hooks=True)
        finally:
            quiet.setLevel(level)
    if split is not None:
        placed = {name: str(torch.device(d)) for name, d in getattr(model, "hf_device_map", {}).items()}
        wanted = {name: str(torch.device(d)) for name, d in split.device_map().items()}
        if placed != wanted:
            moved = sorted(name for name in wanted.keys() | placed.keys() if placed.get(name) != wanted.get(name))
            raise SpecError(f"the target loaded with another split than planned ({len(moved)} modules differ, first "
                            f"{moved[0]}); report this with the target's config.json")
        if reporter is not None:
            reporter.say(split.describe())
    cast(nn.Module, model).eval().requires_grad_(False)
    return cast("PreTrainedModel", model)


def load_target_head(path: str, dtype: torch.dtype, device: torch.device | str) -> TargetHead:
    """The target's embedding and LM head (and its bias, if any) alone, read from its safetensors files onto `device` in
    `dtype`: what the
    drafter side needs when the target itself runs elsewhere (an inference engine). Their tensors are found by the
    names the model gives them (a tied head is the embedding), or as the one tensor whose name ends like it (a
    composite checkpoint's text model); a folder without them is a SpecError."""
    import json

    from safetensors import safe_open

    hf_config = load_target_config(path)
    meta: Any = meta_target(hf_config, dtype)  # a PreTrainedModel
    named = list(meta.named_parameters(remove_duplicate=False))
    head_module = meta.get_output_embeddings()
    parts = {"embedding": getattr(meta.get_input_embeddings(), "weight", None),
             "LM head": getattr(head_module, "weight", None)}
    if getattr(head_module, "bias", None) is not None:
        parts["LM head bias"] = head_module.bias
    wanted = {role: [name for name, p in named if p is tensor] for role, tensor in parts.items()}
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    files = (json.loads(index.read_text())["weight_map"] if index.is_file()
             else {key: "model.safetensors" for key in _keys(folder / "model.safetensors")})
    tensors = {}
    for role, names in wanted.items():
        key = next((name for name in names if name in files), None)
        if key is None:  # a composite checkpoint nests the text model (model.language_model.embed_tokens.weight)
            ends = {"." + name.split(".", 1)[-1] for name in names}
            nested = [k for k in files if any(k.endswith(end) for end in ends)]
            key = nested[0] if len(nested) == 1 else None
        if key is None:
            raise SpecError(f"the target's {role} ({' or '.join(names) or 'no weight'}) is not in the safetensors "
                            f"files at {path}; set train.target_engine = 'hf'")
        with safe_open(str(folder / files[key]), framework="pt") as f:
            tensors[role] = f.get_tensor(key).to(dtype)
    embed = nn.Embedding(*tensors["embedding"].shape, _weight=tensors["embedding"], _freeze=True)
    head = nn.Linear(tensors["LM head"].shape[1], tensors["LM head"].shape[0], bias="LM head bias" in tensors)
    head.weight = nn.Parameter(tensors["LM head"], requires_grad=False)
    if "LM head bias" in tensors:
        head.bias = nn.Parameter(tensors["LM head bias"], requires_grad=False)
    return TargetHead(embed, head, device)


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def load_target_config(path: str | None):
    """The target's HF config; a missing or unreadable target is a ConfigError naming target.path."""
    from transformers import AutoConfig

    if not path:
        raise ConfigError("target.path is not set; set it in the config to the target model's folder or hub id")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the target model's config at target.path = {path} ({type(exc).__name__}); set target.path to "
            "a folder with config.json (or a hub id available offline)"
        ) from None
