"""The drafter's shape and its DFlash parameters, derived from the target's config (docs/DFLASH.md).

A `DrafterSpec` is everything needed to build a `DFlashDrafter` and to write or read the z-lab export `config.json`
that SGLang (`--speculative-algorithm DFLASH`) and vLLM (`method: dflash`) load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from blockdraft.added_tokens import HOW_TO_CHOOSE, known_mask_token_id
from blockdraft.config import DFlashConfig, layer_ids_problem
from blockdraft.errors import SpecError
from blockdraft.model.attention import FULL_ATTENTION, LAYER_KINDS, SLIDING_ATTENTION
from blockdraft.model.rope import DEFAULT_ROPE, clean_scaling, rope_type_of

# Loss decay per block size (docs/DFLASH.md, training batch construction step 5); other sizes need gamma configured.
_DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Layer ids spread evenly over 1..L-3 with Python's round (half to even); one id -> the middle layer L // 2, or
    layer 0 of a 2-layer target (an id is at most L - 2: the last layer's output is the target's own head input).

    The default for every target: a 64-layer hybrid-attention target (Qwen3.5/3.6-27B) gets [1, 16, 31, 46, 61], what
    z-lab's drafters for those targets read.

    Layer id i is the output of decoder layer i, i.e. `hidden_states[i + 1]` of HF's output_hidden_states.
    """
    if num_target_layers < 4 and num_ids > 1:
        raise SpecError(f"target has {num_target_layers} layers, too few to spread {num_ids} feature layers; set "
                        "dflash.target_layer_ids")
    if num_ids == 1:
        return [min(num_target_layers // 2, max(num_target_layers - 2, 0))]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_ids - 1)) for i in range(num_ids)]


def default_gamma(block_size: int) -> float:
    """The loss-weight decay for a block size: 7 for 16, 5 for 10, 4 for 8."""
    if block_size not in _DEFAULT_GAMMA:
        raise SpecError(f"dflash.gamma has no default for block_size {block_size} (defaults exist for 8, 10, 16); set "
                        "dflash.gamma")
    return _DEFAULT_GAMMA[block_size]


def _text_config(hf_config: Any) -> Any:
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if getter is not None else hf_config


def _rope_theta(cfg: Any) -> float:
    """rope_theta from either spelling; a multimodal M-RoPE section is ignored on purpose (the drafter is text-only
    Qwen3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", None) or 10000.0)


def _export_layer_types(config: dict[str, Any], dflash2: bool = False) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of an export config.json; the window only counts when a layer slides (Qwen3 configs
    carry a sliding_window even when no layer uses it). A DFlash2 drafter's layers are all non-causal (its sliding
    layers window the context only), which its config says with `is_causal` false."""
    layer_types = list(config.get("layer_types") or [])
    if not layer_types and config.get("use_sliding_window"):
        raise SpecError("drafter config.json sets use_sliding_window without layer_types; add layer_types (one kind "
                        "per layer)")
    window = config.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    dflash = config.get("dflash_config") or {}
    causal = config.get("is_causal", dflash.get("causal"))
    if dflash2:
        if causal or (causal is None and SLIDING_ATTENTION in layer_types):
            raise SpecError(
                f"drafter config.json is a DFlash2 drafter with is_causal {causal}; blockdraft computes every DFlash2 "
                "layer non-causal (the published drafters set is_causal false), so it cannot load this drafter "
                "faithfully"
            )
    elif causal is not None and any(
        (kind == SLIDING_ATTENTION) != bool(causal) for kind in layer_types or [FULL_ATTENTION]
    ):
        raise SpecError(
            f"drafter config.json sets is_causal {causal}; blockdraft computes sliding layers causal and full layers "
            "non-causal (as SGLang does), so it cannot load this drafter faithfully"
        )
    if dflash.get("use_swa") or dflash.get("swa_window_size") is not None:
        raise SpecError("drafter config.json sets dflash_config.use_swa/swa_window_size; give layer_types and "
                        "sliding_window instead")
    return layer_types, None if window is None else int(window)


def _export_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling fields or None) from either spelling: `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling`. Both are checked; a scaled type in either wins over 'default'."""
    params = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in params and isinstance(params.get(FULL_ATTENTION), dict):  # per-layer-kind rope_parameters
        params = dict(params[FULL_ATTENTION])
    legacy = dict(config.get("rope_scaling") or {})
    parsed = [clean_scaling(params, "drafter config.json rope_parameters"),
              clean_scaling(legacy, "drafter config.json rope_scaling")]
    scaled = [p for p in parsed if p is not None]
    if len(scaled) == 2 and scaled[0] != scaled[1]:
        raise SpecError("drafter config.json has different rope_parameters and rope_scaling; make the two spellings "
                        "agree")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), scaled[0] if scaled else None


@dataclass
class TargetShape:
    """What the drafter must agree with in a target: hidden size, layer count, embedding rows."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_types: list[str] | None = None

    @classmethod
    def from_config(cls, hf_config: Any) -> TargetShape:
        cfg = _text_config(hf_config)
        return cls(cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size,
                   list(getattr(cfg, "layer_types", None) or []) or None)

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None and any(t != "full_attention" for t in self.layer_types)


DFLASH = "dflash"
DFLASH2 = "dflash2"
ARCHITECTURE_NAMES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}  # config.json's `architectures`


@dataclass
class DFlash2Spec:
    """What a DFlash2 drafter adds to DFlash (docs/DFLASH.md, "DFlash2"): per layer two grouped dynamic causal
    convolutions of `conv_kernel_size` taps over groups of `conv_group_size` channels, and a candidate selector of rank
    `selector_rank` over the top `selector_top_k` unary candidates. `input_embedding_scale` multiplies the block's
    embeddings; the unary logits are the head's times `output_multiplier`, soft-capped by `final_logit_softcapping`."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def validate(self, hidden_size: int, block_size: int, vocab_size: int) -> None:
        """Raises SpecError naming the field the drafter's shape cannot take."""
        if self.conv_group_size < 1 or hidden_size % self.conv_group_size:
            raise SpecError(
                f"dflash.conv_group_size {self.conv_group_size} does not divide the hidden size {hidden_size}; pick a "
                "divisor (the published drafters use 16)"
            )
        if not 1 <= self.conv_kernel_size <= block_size:
            raise SpecError(
                f"dflash.conv_kernel_size {self.conv_kernel_size} must be 1..block_size {block_size} (a tap never "
                "crosses a block); lower it"
            )
        if not 1 <= self.selector_top_k <= vocab_size:
            raise SpecError(
                f"dflash.selector_top_k {self.selector_top_k} must be 1..the vocabulary {vocab_size}; lower it"
            )
        if self.selector_rank < 1:
            raise SpecError(f"dflash.selector_rank {self.selector_rank} must be at least 1")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise SpecError(f"dflash.final_logit_softcapping {self.final_logit_softcapping} must be positive or unset")

    @classmethod
    def from_config(cls, dflash_cfg: DFlashConfig) -> DFlash2Spec:
        return cls(
            conv_kernel_size=dflash_cfg.conv_kernel_size,
            conv_group_size=dflash_cfg.conv_group_size,
            selector_rank=dflash_cfg.selector_rank,
            selector_top_k=dflash_cfg.selector_top_k,
            input_embedding_scale=dflash_cfg.input_embedding_scale,
            output_multiplier=dflash_cfg.output_multiplier,
            final_logit_softcapping=dflash_cfg.final_logit_softcapping,
        )

    def export_fields(self) -> dict[str, Any]:
        """The `dflash_config` entries of the export; the three scales only where they are not 1 / unset."""
        fields: dict[str, Any] = {
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }
        if self.input_embedding_scale != 1.0:
            fields["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            fields["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            fields["final_logit_softcapping"] = self.final_logit_softcapping
        return fields

    @classmethod
    def from_export_fields(cls, dflash: dict[str, Any]) -> DFlash2Spec:
        missing = [
            k
            for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            if dflash.get(k) is None
        ]
        if missing:
            raise SpecError(f"drafter config.json is a DFlash2DraftModel but lacks dflash_config.{missing[0]}; it is "
                            "not a DFlash2 export")
        cap = dflash.get("final_logit_softcapping")
        return cls(
            conv_kernel_size=int(dflash["conv_kernel_size"]),
            conv_group_size=int(dflash["conv_group_size"]),
            selector_rank=int(dflash["selector_rank"]),
            selector_top_k=int(dflash["selector_top_k"]),
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            # the reference ignores a cap of 0 or below: the same as unset
            final_logit_softcapping=float(cap) if cap is not None and float(cap) > 0 else None,
        )


def mlp_width(cfg: Any) -> int:
    """The drafter's default MLP width: the target's `intermediate_size`, or for a mixture-of-experts target that names
    none (Qwen3.5-MoE) the width a token's routed experts add up to, num_experts_per_tok x moe_intermediate_size (what
    Qwen3-MoE configs name as their intermediate_size: 8 x 768 = 6144 for Qwen3-30B-A3B)."""
    width = getattr(cfg, "intermediate_size", None)
    if width:
        return int(width)
    per_expert, active = getattr(cfg, "moe_intermediate_size", None), getattr(cfg, "num_experts_per_tok", None)
    if per_expert and active:
        return int(per_expert) * int(active)
    raise SpecError("the target's config names no intermediate_size (nor moe_intermediate_size and "
                    "num_experts_per_tok) for the drafter's MLP width; set dflash.intermediate_size")


@dataclass
class DrafterSpec:
    """Shapes and DFlash parameters of one drafter. vocab_size = the target's embedding rows (config.vocab_size).

    layer_types: one kind per drafter layer ("full_attention" or "sliding_attention"; empty means all full), with
    sliding_window W for the sliding ones. rope_scaling: None for default RoPE, else the scaling fields (e.g. YaRN's
    rope_type, factor, original_max_position_embeddings), never a target's M-RoPE."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    gamma: float | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = None
    dflash2: DFlash2Spec | None = None  # None: a DFlash drafter

    def __post_init__(self) -> None:
        if isinstance(self.dflash2, dict):  # from `to_dict`
            self.dflash2 = DFlash2Spec(**self.dflash2)
        self.layer_types = list(self.layer_types) or [FULL_ATTENTION] * self.num_layers
        self.rope_scaling = clean_scaling(self.rope_scaling, "the drafter's rope_scaling")
        self.validate()

    def validate(self) -> None:
        """Internal consistency; raises SpecError naming the field."""
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise SpecError(
                f"dflash.mask_token_id {self.mask_token_id} is not a row of the target's embedding (vocab_size "
                f"{self.vocab_size}, from the target config, not len(tokenizer)); pick an existing reserved token id "
                "below it"
            )
        if not self.target_layer_ids:
            raise SpecError("dflash.target_layer_ids is empty; give at least one target layer id")
        problem = layer_ids_problem(self.target_layer_ids)
        if problem:
            raise SpecError(f"dflash.target_layer_ids {problem}; use {sorted(set(self.target_layer_ids))}")
        bad = [i for i in self.target_layer_ids if not 0 <= i <= self.num_target_layers - 2]
        if bad:
            raise SpecError(
                f"dflash.target_layer_ids {bad} outside the target's valid ids 0..{self.num_target_layers - 2} "
                f"(target has {self.num_target_layers} layers; id i = output of layer i); fix the ids"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError(
                f"dflash.num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}; fix the head counts"
            )
        if self.head_dim % 2:
            raise SpecError(f"dflash.head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.block_size < 2:
            raise SpecError(f"dflash.block_size {self.block_size} must be at least 2")
        self._validate_layer_types()
        if self.dflash2 is not None:
            self.dflash2.validate(self.hidden_size, self.block_size, self.vocab_size)

    @property
    def architecture(self) -> str:
        """"dflash" or "dflash2"."""
        return DFLASH if self.dflash2 is None else DFLASH2

    def _validate_layer_types(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise SpecError(
                f"dflash.layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers; give "
                "one per layer"
            )
        unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_KINDS})
        if unknown:
            raise SpecError(f"dflash.layer_types has unknown kind '{unknown[0]}'; use {' or '.join(LAYER_KINDS)}")
        if not self.has_sliding:
            if self.sliding_window is not None:
                raise SpecError(
                    f"dflash.sliding_window is {self.sliding_window} but no layer is {SLIDING_ATTENTION}; set "
                    "dflash.layer_types or drop sliding_window"
                )
            return
        if self.sliding_window is None or self.sliding_window < self.block_size:
            raise SpecError(
                f"dflash.sliding_window is {self.sliding_window}; {SLIDING_ATTENTION} layers need a window of at least "
                f"block_size {self.block_size}"
            )

    @property
    def has_sliding(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.rope_scaling)

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    def check_target(self, hf_config: Any) -> None:
        """Refuse a target this drafter cannot serve with: mask id, layer ids, hidden size (one clear line each)."""
        target = TargetShape.from_config(hf_config)
        if self.hidden_size != target.hidden_size:
            raise SpecError(
                f"drafter hidden_size {self.hidden_size} differs from the target's {target.hidden_size}; "
                "the drafter must be built for this target"
            )
        if self.mask_token_id >= target.vocab_size:
            raise SpecError(
                f"dflash.mask_token_id {self.mask_token_id} >= the target's embedding rows {target.vocab_size} "
                "(config.vocab_size, not len(tokenizer)); pick an existing reserved token id"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i <= target.num_layers - 2]
        if bad:
            raise SpecError(
                f"dflash.target_layer_ids {bad} outside the target's valid ids 0..{target.num_layers - 2} "
                f"(target has {target.num_layers} layers); fix the ids"
            )
        if self.num_target_layers != target.num_layers:
            raise SpecError(
                f"drafter num_target_layers {self.num_target_layers} differs from the target's {target.num_layers} "
                "layers; use the target the drafter was trained with"
            )

    @classmethod
    def from_target_config(cls, hf_config: Any, dflash_cfg: DFlashConfig) -> DrafterSpec:
        """Defaults per docs/DFLASH.md from the target's HF config and the [dflash] section."""
        cfg = _text_config(hf_config)
        target = TargetShape.from_config(hf_config)
        mask_token_id = dflash_cfg.mask_token_id
        if mask_token_id is None:  # the family's reserved id when the target is a known one
            fields = {"model_type": getattr(cfg, "model_type", None), "vocab_size": getattr(cfg, "vocab_size", None)}
            mask_token_id = known_mask_token_id(fields)
        if mask_token_id is None:
            raise SpecError(
                f"dflash.mask_token_id is not set and this target (model_type {getattr(cfg, 'model_type', None)}, "
                f"vocab_size {target.vocab_size}) has no known reserved id; {HOW_TO_CHOOSE}"
            )
        num_layers = dflash_cfg.num_draft_layers
        if dflash_cfg.target_layer_ids is not None:
            layer_ids = list(dflash_cfg.target_layer_ids)
        else:  # the even spread for every target, hybrid-attention ones included
            layer_ids = default_layer_ids(target.num_layers, num_layers)
        heads = dflash_cfg.num_attention_heads or cfg.num_attention_heads
        kv_heads = dflash_cfg.num_key_value_heads or getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = dflash_cfg.head_dim or getattr(cfg, "head_dim", None) or target.hidden_size // heads
        gamma = dflash_cfg.gamma if dflash_cfg.gamma is not None else default_gamma(dflash_cfg.block_size)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=dflash_cfg.intermediate_size or mlp_width(cfg),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
            vocab_size=target.vocab_size,
            block_size=dflash_cfg.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=layer_ids,
            num_target_layers=target.num_layers,
            gamma=gamma,
            layer_types=list(dflash_cfg.layer_types or []),
            sliding_window=dflash_cfg.sliding_window,
            dflash2=DFlash2Spec.from_config(dflash_cfg) if dflash_cfg.architecture == DFLASH2 else None,
        )

    def to_export_config(self) -> dict[str, Any]:
        """The z-lab `config.json` (docs/DFLASH.md, export format): Qwen3 fields, both rope spellings, block_size twice;
        a DFlash2 drafter adds its `dflash_config` fields and `is_causal` false (its layers are all non-causal)."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURE_NAMES[self.architecture]],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.has_sliding,
            "sliding_window": self.sliding_window,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": DEFAULT_ROPE, **(self.rope_scaling or {})},
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }
        if self.dflash2 is not None:
            # the reference reads a sliding layer as causal unless is_causal says otherwise
            config["is_causal"] = False
            config["dflash_config"].update(self.dflash2.export_fields())
        return config

    @classmethod
    def from_export_config(cls, config: dict[str, Any], gamma: float | None = None) -> DrafterSpec:
        """Read a z-lab `config.json` dict (either rope spelling, sliding layers, YaRN); refuses what the drafter does
        not implement (attention bias, unknown layer kinds or rope types) by name."""
        dflash = config.get("dflash_config") or {}
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise SpecError(f"drafter config.json lacks dflash_config.{missing[0]}; it is not a DFlash export")
        if config.get("attention_bias"):
            raise SpecError("drafter config.json has attention_bias true; blockdraft drafters have no attention bias")
        if "num_target_layers" not in config:
            raise SpecError("drafter config.json lacks num_target_layers (the target's layer count); add it from the "
                            "target's config")
        block_size = dflash.get("block_size", config.get("block_size"))
        if block_size is None:
            raise SpecError("drafter config.json has no block_size (top level or dflash_config); it is not a DFlash "
                            "export")
        problem = layer_ids_problem([int(i) for i in dflash["target_layer_ids"]])
        if problem:
            raise SpecError(f"drafter config.json dflash_config.target_layer_ids {problem}; this drafter cannot be "
                            "loaded or served")
        heads = config["num_attention_heads"]
        names = list(config.get("architectures") or [ARCHITECTURE_NAMES[DFLASH]])
        unknown = [n for n in names if n not in ARCHITECTURE_NAMES.values()]
        if unknown:
            raise SpecError(
                f"drafter config.json names architecture {unknown[0]}; blockdraft loads "
                f"{' and '.join(ARCHITECTURE_NAMES.values())}"
            )
        dflash2 = DFlash2Spec.from_export_fields(dflash) if ARCHITECTURE_NAMES[DFLASH2] in names else None
        if dflash2 is None and any(k in dflash for k in ("conv_kernel_size", "selector_top_k")):
            raise SpecError(
                "drafter config.json has DFlash2 fields in dflash_config but architectures says DFlashDraftModel; set "
                "architectures to [\"DFlash2DraftModel\"]"
            )
        layer_types, window = _export_layer_types(config, dflash2=dflash2 is not None)
        theta, scaling = _export_rope(config)
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            vocab_size=config["vocab_size"],
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            num_target_layers=int(config["num_target_layers"]),
            gamma=gamma,
            layer_types=layer_types,
            sliding_window=window,
            rope_scaling=scaling,
            dflash2=dflash2,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
