"""The one blockdraft config: a TOML file validated by one pydantic model.

Every stage reads its options from its own section. The resolved config (defaults filled in) is written into
every manifest and every export, so an artifact can always be traced to the settings that made it.
Precedence: command-line flag, then this file, then the environment, then the defaults below.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blockdraft.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetConfig(_Section):
    """The frozen target model; its tokenizer and chat template are the defaults for tokenize.

    `dtype` is what the target runs in and what the export is stored in; None: the dtype the target's own config.json
    names (`dtype`, or `torch_dtype` in older configs), float32 when it names none."""

    path: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None


def layer_ids_problem(ids: Sequence[int]) -> str | None:
    """Why target layer ids cannot be served, or None. The engines capture the target's hidden states while walking its
    layers, in layer order and once each, so the ids must be strictly ascending and unique: unsorted ids would silently
    permute `fc`'s input, repeated ones crash at the first request."""
    ids = list(ids)
    pair = next(((a, b) for a, b in zip(ids, ids[1:]) if a >= b), None)
    if pair is None:
        return None
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    why = f"{', '.join(map(str, repeated))} repeated" if repeated else f"{pair[0]} before {pair[1]}"
    return f"{ids} must be strictly ascending and unique ({why}): the engines read the target's layers in order, once each"


class TokenizeConfig(_Section):
    thinking: Literal["auto", "on", "off"] = "auto"
    max_length: int = Field(default=4096, ge=2)
    held_out_fraction: float = Field(default=0.01, ge=0.0, lt=1.0)
    workers: int = Field(default=1, ge=1)
    rows_per_shard: int = Field(default=20000, ge=1)
    # The token that ends an assistant turn; supervision runs through it (Qwen: <|im_end|>).
    end_of_turn: str = "<|im_end|>"


class DFlashConfig(_Section):
    """DFlash parameters (docs/DFLASH.md). None means: derive from the target's config."""

    block_size: int = Field(default=16, ge=2)
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_draft_layers: int = Field(default=5, ge=1)
    gamma: float | None = None
    num_anchors: int = Field(default=512, ge=1)
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # One kind per drafter layer (None: all full attention); sliding layers need sliding_window >= block_size.
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: int | None = Field(default=None, ge=1)

    @field_validator("target_layer_ids")
    @classmethod
    def _ascending_unique(cls, ids: list[int] | None) -> list[int] | None:
        problem = None if ids is None else layer_ids_problem(ids)
        if problem:
            raise ValueError(f"{problem}; use {sorted(set(ids or []))}")
        return ids


class StoreConfig(_Section):
    """Where artifacts live: a local folder (the default) or s3://bucket/prefix."""

    url: str = "file://./blockdraft-store"
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    part_size_mib: int = Field(default=64, ge=5)
    concurrency: int = Field(default=8, ge=1)
    # A stage whose output is s3:// writes here first (staging_dir/bucket/prefix), pushing pieces as they finish.
    staging_dir: str = "./blockdraft-staging"


class PlacementConfig(_Section):
    """Devices: the frozen target on its own devices, one drafter replica per drafter device (one rank each)."""

    target_devices: list[str] = Field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = Field(default_factory=lambda: ["cpu"])


class TrainConfig(_Section):
    data: str | None = None
    output: str | None = None
    epochs: int = Field(default=6, ge=1)
    max_steps: int | None = None
    batch_size: int = Field(default=1, ge=1)
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = Field(default=0.04, ge=0.0, le=1.0)
    grad_clip: float = 1.0
    max_length: int = Field(default=3072, ge=2)
    checkpoint_every: int = Field(default=500, ge=1)
    seed: int = 0
    deterministic: bool = False
    lm_head_chunk_blocks: int = Field(default=64, ge=1)
    log_every: int = Field(default=10, ge=1)
    log_dir: str = "blockdraft-train-logs"  # local metrics.jsonl and curves PNG (also copied into each checkpoint)
    keep_checkpoints: int | None = Field(default=None, ge=1)  # newest verified checkpoints kept; None keeps all
    # A drafter in the export format (a folder or store URL: an export, checkpoint or training output) to start from
    # instead of random weights; its DFlash parameters must match this config and the target.
    init_from: str | None = None


class EvalConfig(_Section):
    prompts: str | None = None
    max_new_tokens: int = Field(default=256, ge=1)
    num_prompts: int = Field(default=32, ge=1)
    divergence_margin_fp32: float = 1e-4
    divergence_margin_bf16: float = 0.5
    # Also decode with a freshly initialised drafter of the same shape: the floor a trained drafter must clearly beat.
    untrained_baseline: bool = True
    # A drafter folder in the export format (config.json + model.safetensors, e.g. a published one) decoded beside the
    # drafter under test as "baseline", on the same prompts; checked against the target first.
    baseline: str | None = None


class GenerateConfig(_Section):
    """Regenerating completions with the target: `hf` runs it locally; `openai` calls vLLM/SGLang at `base_url` (.../v1).

    `model` None: the served model (openai) or target.path (hf). `thinking` auto follows the dropped final turn (on when it
    had reasoning), else the template's default. The API key is read from the environment variable `api_key_env`.
    """

    engine: Literal["hf", "openai"] = "hf"
    base_url: str | None = None
    model: str | None = None
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    concurrency: int = Field(default=8, ge=1)
    timeout_s: float = Field(default=120.0, gt=0)
    max_retries: int = Field(default=4, ge=0)
    retry_backoff_s: float = Field(default=1.0, ge=0.0)
    request_token_ids: bool = True
    api_key_env: str = "OPENAI_API_KEY"
    batch_size: int = Field(default=8, ge=1)
    thinking: Literal["auto", "on", "off"] = "auto"
    rows_per_shard: int = Field(default=1000, ge=1)


class BlockdraftConfig(_Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    dflash: DFlashConfig = Field(default_factory=DFlashConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)

    def resolved(self) -> dict:
        """The full config with every default filled in, as plain JSON data."""
        return self.model_dump(mode="json")

    def digest(self, *sections: str) -> str:
        """sha256 of the resolved config (or of the named sections only), stable across runs."""
        data = self.resolved()
        if sections:
            data = {name: data[name] for name in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _format_validation_error(path: str, err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return f"config {path}: field '{where}': {first['msg']}; fix that field in the file"


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> BlockdraftConfig:
    """Load and validate a TOML config; `overrides` ({"section": {"field": value}}) are command-line flags.

    Flags that are None are ignored, so a CLI can pass every option and let the file decide the unset ones.
    """
    data: dict = {}
    label = str(path) if path else "(defaults)"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file with --config")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {p} is not valid TOML ({exc}); fix the syntax at that line") from None
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is not None:
                data.setdefault(section, {})[key] = value
    try:
        return BlockdraftConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(label, exc)) from None
