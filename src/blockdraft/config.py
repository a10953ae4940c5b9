"""The one blockdraft config: a TOML file validated by one pydantic model.

Every stage reads its options from its own section. The resolved config (defaults filled in) is written into
every manifest and every export, so an artifact can always be traced to the settings that made it.
Precedence: command-line overrides (`--set section.key=value`, or a stage flag that spells one; `overrides.py`), then
this file, then the defaults below.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from blockdraft.added_tokens import folder_spare_row, mask_token_problem, tokenizer_added_tokens
from blockdraft.errors import ConfigError, redact_settings, safe_url
from blockdraft.overrides import Overrides, apply, flag_overrides, set_overrides, validation_line


class _Section(BaseModel):
    # No setting is infinite or NaN: `inf` as a learning rate trains to NaN, as a timeout or a memory size overflows
    # later.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def resolved(self) -> dict:
        """This section (the whole config, for `BlockdraftConfig`) with every default filled in, as plain JSON data,
        each credential a setting carries replaced by its fingerprint (`redact_settings`: a URL's userinfo and query
        values, `--hf-token X` in eval.engine_args, an `hf_...` token): this is what manifests, checkpoints and exports
        record, and what every stage key is read from. A section's is its part of the whole config's."""
        return redact_settings(self.model_dump(mode="json"))


class TargetEngineConfig(_Section):
    """`[target.engine]`: the vLLM engine that serves the target's features when train.target_engine = "vllm"
    (docs/TRAINING.md, "The target served by vLLM"), with these parallel sizes (vLLM's own settings, as its command line
    spells them) and `args` after them. Train starts it in eval.engine_python's environment, or, with `url`, reads
    from one already serving, started with the same config by `blockdraft features-server` (on its own machines).
    `features_dir`: the folder the engine writes each row's features to; with `url`, where this machine sees that
    folder (the same machine, or a shared filesystem)."""

    url: str | None = None  # an engine already serving, e.g. "http://10.0.0.5:8000"; None: train starts one
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)
    enable_expert_parallel: bool = False
    args: list[str] = Field(default_factory=list)  # more of vLLM's options, appended last
    features_dir: str | None = None  # None: a new folder in /dev/shm (Linux) or the temporary folder
    timeout_s: float = Field(default=300.0, gt=0)  # the longest wait for one row's features

    def launch_args(self) -> list[str]:
        """The parallel sizes and `args` as vLLM's command line takes them (sizes of 1 left to vLLM's default)."""
        sizes = {"--tensor-parallel-size": self.tensor_parallel_size,
                 "--pipeline-parallel-size": self.pipeline_parallel_size,
                 "--data-parallel-size": self.data_parallel_size}
        out = [part for flag, size in sizes.items() if size > 1 for part in (flag, str(size))]
        return out + (["--enable-expert-parallel"] if self.enable_expert_parallel else []) + list(self.args)

    @model_validator(mode="after")
    def _url_is_a_servers_root(self) -> TargetEngineConfig:
        if self.url is None:
            return self
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target.engine.url must be the http(s) URL of a vLLM server, e.g. http://10.0.0.5:8000 "
                             f"(got {self.url!r})")
        if parts.path.strip("/") or parts.query or parts.username or parts.password:
            raise ValueError("target.engine.url must be the server's root, http(s)://host:port, with no path (/v1 is "
                             "added per request), query or user:password (got another form)")
        return self


class TargetConfig(_Section):
    """The frozen target model; its tokenizer and chat template are the defaults for tokenize.

    `dtype` is what the target runs in and what the export is stored in; None: the dtype the target's own config.json
    names (`dtype`, or `torch_dtype` in older configs), float32 when it names none."""

    path: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    engine: TargetEngineConfig = Field(default_factory=TargetEngineConfig)


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
    return (f"{ids} must be strictly ascending and unique ({why}): the engines read the target's layers in order, once "
            "each")


def accumulation_steps(global_batch: int, batch_size: int, ranks: int) -> int:
    """Micro-batches each rank accumulates per optimizer step; a global batch that does not split evenly is a
    ConfigError."""
    per_pass = batch_size * ranks
    if global_batch % per_pass:
        lower, upper = max(per_pass, global_batch // per_pass * per_pass), (global_batch // per_pass + 1) * per_pass
        raise ConfigError(
            f"train.global_batch_size {global_batch} is not a multiple of train.batch_size {batch_size} x {ranks} "
            f"drafter rank(s) = {per_pass}; set train.global_batch_size to {lower} or {upper}, or change "
            "train.batch_size"
        )
    return global_batch // per_pass


# Device strings a placement may name: checked at load by form only; whether this machine has the device is checked
# where a stage places its models (`check_device`), since a config is often written on another machine than it runs on.
DEVICE_FORMS = "cpu, cuda, cuda:N or mps"
_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")


def device_problem(value: str) -> str | None:
    """Why `value` is not a device string blockdraft places models on, or None."""
    return None if _DEVICE.fullmatch(value) else f"'{value}' is not a device; use {DEVICE_FORMS}"


def check_device(field: str, value: str) -> str:
    """`value` when this machine has that device; else ConfigError naming the field, what torch sees here, and the fix.

    Imports torch on call: only the stages that place models need it, loading a config must not."""
    import torch

    if problem := device_problem(value):
        raise ConfigError(f"{field}: {problem}")
    kind, _, index = value.partition(":")
    count = torch.cuda.device_count() if kind == "cuda" and torch.cuda.is_available() else 0
    if kind == "cuda" and not count:
        has, use = (
            "torch sees no CUDA device" + (" (a CPU-only torch build)" if torch.version.cuda is None else ""),
            "'cpu'",
        )
    elif kind == "cuda" and index and int(index) >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        has = f"torch sees {count} CUDA device(s)" + (
            f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        )
        use = f"cuda:0 to cuda:{count - 1}"
    elif kind == "mps" and not torch.backends.mps.is_available():
        has, use = "torch sees no MPS device", "'cpu'"
    else:
        return value
    raise ConfigError(f"{field} lists '{value}' but {has}; list devices this machine has ({use}) in the config")


def is_s3_url(url: str) -> bool:
    """Whether `url` names an S3 location (`s3://bucket/prefix`): the one test that picks the S3 backend over a local
    folder. Here, with the store URL rule (`store_url_problem`), because the config checks URLs before any store is
    opened and may not import the store package."""
    return url.startswith("s3://")


def store_url_problem(url: str) -> str | None:
    """Why `url` is not a store URL (s3://bucket/prefix, file://path or a plain path), or None. A scheme of two or more
    letters followed by ':' marks a URL, so 'gs://b', 'http://h' and the typo 's3:/b' fail here, not at the first
    request."""
    accepted = "use s3://bucket/prefix, file://path or a plain path"
    if is_s3_url(url):
        bucket = url[5:].split("/", 1)[0]
        if "?" in url or "@" in bucket:
            return (f"store URL '{safe_url(url)}' carries a query string or user info, which manifests and leases "
                    "would record; drop it: S3 credentials come from AWS_* variables or store.profile")
        return None if bucket else f"no bucket in '{url}'; {accepted}"
    if url.startswith("file://"):
        return None if url[7:] else f"no path in '{url}'; {accepted}"
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", url)
    if scheme:
        typo = " (lower case, two slashes)" if scheme.group(1).lower() in ("s3", "file") else ""
        return f"unsupported store URL '{url}' (scheme '{scheme.group(1)}:'); {accepted}{typo}"
    return None


MAX_ROW_BYTES = 64 << 20  # tokenize.max_row_bytes by default


class TokenizeConfig(_Section):
    thinking: Literal["auto", "on", "off"] = "auto"
    max_length: int = Field(default=4096, ge=2)
    held_out_fraction: float = Field(default=0.01, ge=0.0, lt=1.0)
    workers: int = Field(default=1, ge=1)
    # The most input bytes per task. A run sizes its tasks for `workers` (about 4 tasks a worker over all its input
    # bytes), within [min_task_bytes, task_bytes]; a larger file is cut into 2, 4, 8, ... parts of at most that size, a
    # file of at most that size stays whole (docs/TOKENIZATION.md, "Tasks").
    task_bytes: int = Field(default=16 << 20, ge=1024)
    # The least input bytes per task, so that a small input is not cut into slivers (task_bytes wins when it is
    # smaller).
    min_task_bytes: int = Field(default=1 << 20, ge=1024)
    # An Arrow file is closed once it holds this many bytes (a task's last file is smaller), or rows_per_shard rows if
    # set.
    file_bytes: int = Field(default=256 << 20, ge=1)
    rows_per_shard: int | None = Field(default=None, ge=1)
    # A row (a JSON Lines line, a Parquet row) larger than this is quarantined as `row_too_large` without being held
    # whole.
    max_row_bytes: int = Field(default=MAX_ROW_BYTES, ge=1024)
    # The token that ends an assistant turn; supervision runs through it (Qwen: <|im_end|>).
    end_of_turn: str = "<|im_end|>"


class DFlashConfig(_Section):
    """DFlash parameters (docs/DFLASH.md). None means: derive from the target's config."""

    block_size: int = Field(default=16, ge=2)
    mask_token_id: int | None = Field(default=None, ge=0)
    target_layer_ids: list[Annotated[int, Field(ge=0)]] | None = None
    num_draft_layers: int = Field(default=5, ge=1)
    gamma: float | None = Field(default=None, gt=0)
    num_anchors: int = Field(default=512, ge=1)
    intermediate_size: int | None = Field(default=None, ge=1)
    num_attention_heads: int | None = Field(default=None, ge=1)
    num_key_value_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)
    # One kind per drafter layer (None: all full attention); sliding layers need sliding_window >= block_size.
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: int | None = Field(default=None, ge=1)
    # How slots weigh in the loss: "exponential" (exp(-(k-1)/gamma), the paper's) or "dpace" (D-PACE: weights that
    # follow the drafter's own per-slot confidence, smoothed by dpace_alpha). Pinned in checkpoints like gamma
    # (docs/DFLASH.md).
    loss_weighting: Literal["exponential", "dpace"] = "exponential"
    dpace_alpha: float = Field(default=0.5, gt=0.0, le=1.0)
    # "dflash2" (the default: it drafted better than DFlash on both tiny fixtures at equal steps and equal wall time,
    # docs/PERFORMANCE.md "DFlash2 against DFlash"): DFlash plus a grouped dynamic causal convolution around every
    # attention and MLP and a candidate selector that walks a path through each slot's top-K (docs/DFLASH.md,
    # "DFlash2"); or "dflash". The fields below are DFlash2's, with the published drafter's values as defaults; a DFlash
    # config that sets one is refused.
    architecture: Literal["dflash", "dflash2"] = "dflash2"
    # taps per convolution; at most block_size (taps never cross a block)
    conv_kernel_size: int = Field(default=2, ge=1)
    conv_group_size: int = Field(default=16, ge=1)  # channels sharing one dynamic tap; must divide the hidden size
    selector_rank: int = Field(default=256, ge=1)  # width of the predecessor/successor codebooks
    selector_top_k: int = Field(default=16, ge=1)  # candidates per slot; at most the vocabulary
    selector_loss_alpha: float = Field(default=1.0, ge=0.0)  # weight of the selector's K-way cross-entropy in the loss
    # A slot whose gold token is not among its top-K: "inject" it into that slot's selector loss, or "skip" the slot's
    # selector loss (docs/DFLASH.md, "DFlash2 training"; measured in docs/PERFORMANCE.md)
    selector_missing_gold: Literal["inject", "skip"] = "inject"
    input_embedding_scale: float = Field(default=1.0, gt=0.0)  # multiplies the block's token embeddings
    output_multiplier: float = Field(default=1.0, gt=0.0)  # multiplies the unary logits
    final_logit_softcapping: float | None = Field(default=None, gt=0.0)  # cap * tanh(unary / cap) when set

    @field_validator("target_layer_ids")
    @classmethod
    def _ascending_unique(cls, ids: list[int] | None) -> list[int] | None:
        if problem := None if ids is None else layer_ids_problem(ids):
            raise ValueError(f"{problem}; use {sorted(set(ids or []))}")
        return ids

    @model_validator(mode="after")
    def _dflash2_fields(self) -> DFlashConfig:
        # a resolved config (every default written out) validates again, so only a value other than the default counts
        set_here = sorted(
            name for name in DFLASH2_FIELDS if getattr(self, name) != DFlashConfig.model_fields[name].default
        )
        if self.architecture == "dflash" and set_here:
            raise ValueError(
                f"dflash.{set_here[0]} is a DFlash2 setting but dflash.architecture is 'dflash'; set "
                f"dflash.architecture = \"dflash2\" or drop dflash.{set_here[0]}"
            )
        if self.architecture == "dflash2" and self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"dflash.conv_kernel_size {self.conv_kernel_size} is more taps than dflash.block_size "
                f"{self.block_size} (a tap never crosses a block); set conv_kernel_size to at most block_size"
            )
        return self


# The DFlashConfig fields only a DFlash2 drafter has (`architecture = "dflash2"`).
DFLASH2_FIELDS = frozenset({
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_alpha",
    "selector_missing_gold", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
})


class StoreConfig(_Section):
    """Where artifacts live: a local folder (the default) or s3://bucket/prefix."""

    url: str = Field(default="file://./blockdraft-store", min_length=1)
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    part_size_mib: int = Field(default=64, ge=5, le=5120)  # S3 parts are 5 MiB to 5 GiB
    concurrency: int = Field(default=8, ge=1)
    # A stage whose output is s3:// writes here first (staging_dir/bucket/prefix), pushing pieces as they finish.
    staging_dir: str = "./blockdraft-staging"

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if problem := store_url_problem(url):
            raise ValueError(problem)
        return url

    @field_validator("endpoint_url")
    @classmethod
    def _plain_endpoint(cls, endpoint: str | None) -> str | None:
        """An S3 endpoint is scheme://host[:port][/path]: a query string or fragment is refused here by name (the S3
        client would call the whole URL "not a valid URI")."""
        if endpoint is None:
            return None
        parts = urlsplit(endpoint)
        if parts.query or parts.fragment or endpoint.rstrip().endswith(("?", "#")):
            raise ValueError("has a query string or fragment ('?...' or '#...'), which an S3 endpoint cannot take: "
                             "give scheme://host[:port] only")
        return endpoint


class PlacementConfig(_Section):
    """Devices: the frozen target on its own devices, one drafter replica per drafter device (one rank each)."""

    # One entry per drafter device (or one for all): a device, or a list of devices the target is split over by layer.
    target_devices: list[str | list[str]] = Field(default_factory=lambda: ["cpu"], min_length=1)
    drafter_devices: list[str] = Field(default_factory=lambda: ["cpu"], min_length=1)
    # Several machines, each listing the same devices, meeting at node 0's HOST:PORT (docs/TRAINING.md, "More than one
    # node").
    nnodes: int = Field(default=1, ge=1)
    node_rank: int = Field(default=0, ge=0)
    rdzv_endpoint: str | None = None

    @field_validator("target_devices", "drafter_devices")
    @classmethod
    def _device_forms(cls, devices: list[str | list[str]]) -> list[str | list[str]]:
        if any(isinstance(entry, list) and not entry for entry in devices):
            raise ValueError("has an empty device group; list at least one device in each")
        flat = [d for entry in devices for d in ([entry] if isinstance(entry, str) else entry)]
        if problem := next(filter(None, map(device_problem, flat)), None):
            raise ValueError(problem)
        return devices

    @property
    def target_groups(self) -> list[tuple[str, ...]]:
        """`target_devices` with every entry as a group: a device alone is a group of one."""
        return [(entry,) if isinstance(entry, str) else tuple(entry) for entry in self.target_devices]


MAX_DEVICE_MEMORY_GB = 1e6  # a petabyte: more is a typo, and the plan's byte counts would leave float range
MAX_DIST_TIMEOUT_MINUTES = 7 * 24 * 60.0  # a week; torch's timeout is a timedelta, which a larger value overflows


class TrainConfig(_Section):
    data: str | None = None
    output: str | None = None
    epochs: int = Field(default=6, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=1, ge=1)  # rows per rank per forward (a micro-batch)
    # Rows per optimizer step across all ranks: each rank accumulates global / (batch_size * ranks) micro-batches.
    global_batch_size: int = Field(default=32, ge=1)
    pipeline_depth: int = Field(default=1, ge=0)  # steps the target runs ahead of the drafter (0: one after the other)
    lr: float = Field(default=6e-4, ge=0.0)  # 0 keeps the weights as they start (a check of init_from)
    weight_decay: float = Field(default=0.0, ge=0.0)
    warmup_ratio: float = Field(default=0.04, ge=0.0, le=1.0)
    grad_clip: float = Field(default=1.0, gt=0)  # the max gradient norm; 0 would zero every update
    max_length: int = Field(default=3072, ge=2)
    # Lay each micro-batch's batch_size rows back to back in sequences of up to max_length tokens instead of padding
    # them to the longest, every conversation seen alone (docs/TRAINING.md, "Packing").
    packing: bool = False
    checkpoint_every: int = Field(default=500, ge=1)
    seed: int = Field(default=0, ge=-(2**63), lt=2**64)  # what torch.manual_seed takes (64 bits)
    deterministic: bool = False
    lm_head_chunk_blocks: int = Field(default=64, ge=1)
    # The drafter's training attention: block-sparse FlexAttention ("flex", CUDA only: no CPU backward) or the dense
    # masked SDPA reference ("dense"); "auto" = flex on CUDA, dense elsewhere.
    attention: Literal["auto", "dense", "flex"] = "auto"
    # Memory (docs/PERFORMANCE.md, "memory plan"): recompute each drafter layer in backward instead of keeping its
    # activations; all-reduce the gradients in bf16 (half the bytes; the optimizer still steps fp32 masters); each
    # device's memory in GB for the plan (None: what torch reports for a GPU, the RAM for the CPU, else unknown).
    activation_checkpointing: bool = False
    grad_allreduce_dtype: Literal["float32", "bfloat16"] = "float32"
    device_memory_gb: float | None = Field(default=None, gt=0, le=MAX_DEVICE_MEMORY_GB)
    log_every: int = Field(default=10, ge=1)
    # Local metrics.jsonl and curves PNG (each checkpoint: its window of entries, the PNG); one run's own
    # (blockdraft-log.json names it: another run is refused), apart from train.data, train.output and any artifact
    # (stages/train/metrics.py).
    log_dir: str = "blockdraft-train-logs"
    # also fed every logged step, by rank 0 (docs/TRAINING.md)
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    # wandb.init's arguments
    wandb: dict[Literal["project", "entity", "group", "name", "mode"], str] = Field(default_factory=dict)
    # curves redrawn in the background at most this often, and at the end
    plot_every_minutes: float = Field(default=10.0, ge=0)
    keep_checkpoints: int | None = Field(default=3, ge=1)  # newest verified checkpoints kept; None keeps all
    # Also kept for good: every Nth checkpoint (its step a multiple of N * checkpoint_every); 1 keeps all, None none.
    keep_checkpoint_every: int | None = Field(default=10, ge=1)
    # Checkpoints are pushed in the background while training goes on; this many failed pushes in a row stop the run.
    max_checkpoint_failures: int = Field(default=3, ge=1)
    # How long a rank waits for the others in a collective (rank 1 while rank 0 awaits a slow push) before the run
    # fails.
    dist_timeout_minutes: float = Field(default=60.0, gt=0, le=MAX_DIST_TIMEOUT_MINUTES)
    # A drafter in the export format (a folder or store URL: an export, checkpoint or training output) to start from
    # instead of random weights; its DFlash parameters must match this config and the target.
    init_from: str | None = None
    # Initial weights when not init_from: "pytorch" (each layer's default) or "hf_normal" (normal(0, the target config's
    # initializer_range) for linear weights, zero biases, norms at 1, as HF initialises its models).
    init: Literal["pytorch", "hf_normal"] = "pytorch"
    # Soft targets: each slot's loss is (1 - w) * CE + w * T^2 * KL(target || drafter) at temperature T; 0 trains on the
    # hard labels only (the paper's objective) and never runs the target past its feature layers.
    distill_weight: float = Field(default=0.0, ge=0.0, le=1.0)
    distill_temperature: float = Field(default=1.0, gt=0.0)
    # The training signal (docs/TRAINING-SIGNAL.md). Every eval_every steps and at each checkpoint, rank 0 measures the
    # loss, per-slot accuracies and tau estimate on a fixed, seeded sample of eval_rows held-out rows, without
    # gradients.
    eval_every: int = Field(default=100, ge=1)
    eval_rows: int = Field(default=32, ge=1)
    # The held-out rows for those figures and for the decoded checkpoints' prompts: None takes train.data's held-out
    # split; a tokenized artifact (a folder, file:// or s3:// URL, tokenized like train.data) gives all of its rows,
    # both splits.
    eval_data: str | None = None
    # Each checkpoint is also decoded for real (eval's loop, lossless check) on this many held-out prompts; 0: none.
    decode_eval_prompts: int = Field(default=2, ge=0)
    # Before step 1 the target is run over this many training rows: the share of supervised positions where its greedy
    # next token is the label (target agreement); below min_target_agreement is one warning line. 0 rows: not measured.
    target_agreement_rows: int = Field(default=32, ge=0)
    min_target_agreement: float = Field(default=0.7, ge=0.0, le=1.0)
    log_every_s: float = Field(default=30.0, gt=0)  # one plain progress line this often when stderr is not a terminal
    # Where the target's features come from: "hf", its forward inside the trainer; "vllm", a vLLM engine that serves
    # the target as [target.engine] says (docs/TRAINING.md, "The target served by vLLM").
    target_engine: Literal["hf", "vllm"] = "hf"

    @model_validator(mode="after")
    def _packing_has_rows_to_pack(self) -> TrainConfig:
        if self.packing and self.batch_size == 1:
            raise ValueError("train.packing lays each forward's train.batch_size rows back to back, and batch_size 1 "
                             "gives it one row; raise train.batch_size (rows per forward, e.g. 8) or set "
                             "train.packing = false")
        if self.target_engine == "vllm" and (self.packing or self.distill_weight > 0):
            setting = "train.packing" if self.packing else "train.distill_weight"
            raise ValueError(f"{setting} needs the target's forward in the trainer, and train.target_engine = 'vllm' "
                             f"reads features from the engine, one row at a time and without the final hidden "
                             f"states; turn {setting} off or set train.target_engine = 'hf'")
        return self


# The lowest sampling temperature eval decodes at: vLLM raises any temperature in (0, 0.01) to 0.01 (its _MAX_TEMP,
# warning of NaN or inf), so a lower one measures what no vLLM serves; and logits / T stay finite in float32 for any
# logit below 3.4e36 (at 1e-45 they overflow, softmax gives NaN and sampling fails after the greedy decodes ran).
MIN_TEMPERATURE = 0.01


class EvalConfig(_Section):
    # Prompt sources, one set each: a prompts file (.jsonl, .jsonl.gz, .json, .parquet), a folder of Parquet files or
    # one `datasets` saved, hf://datasets/NAME, or a tokenized artifact (its held-out rows); none: train.data's
    # held-out rows.
    prompts: list[str] = Field(default_factory=list)
    # One layout per source (`auto`: recognised from its columns), or none: every layout recognised.
    prompt_sets: list[str] = Field(default_factory=list)
    max_new_tokens: int = Field(default=256, ge=1)
    num_prompts: int = Field(default=32, ge=1)
    divergence_margin_fp32: float = Field(default=1e-4, ge=0.0)
    divergence_margin_bf16: float = Field(default=0.5, ge=0.0)
    # Also decode with a freshly initialised drafter of the same shape: the floor a trained drafter must clearly beat.
    untrained_baseline: bool = True
    # An export-format drafter folder (e.g. a published one) decoded beside it as "baseline"; checked against the
    # target.
    baseline: str | None = None
    # `vllm`: also serve the export in the engine and compare (`eval --engine`)
    engine: Literal["none", "vllm", "sglang"] = "none"
    engine_python: str = ".venv-engine/bin/python"  # the engine's own environment (`make engine`)
    engine_start_timeout_s: float = Field(default=600.0, gt=0)
    engine_tolerance_fp32: float = Field(default=0.02, ge=0.0)  # per-position acceptance rate and relative tau, float32
    engine_tolerance: float = Field(default=0.03, ge=0.0)  # the same below float32 (docs/PERFORMANCE.md, "engine")
    engine_args: list[str] = Field(default_factory=list)  # more arguments for the engine's server, appended last
    # At temperature > 0 the engine's acceptance is a sample too: the chance that the check fails an engine that agrees.
    engine_alpha: float = Field(default=0.01, gt=0.0, lt=1.0)
    # Sampling (docs/EVAL.md, "Measuring a drafter"): temperature 0 decodes greedy only; above 0, eval also decodes each
    # prompt `samples_per_prompt` times with these settings (decode i seeded with seed + i) and reports acceptance
    # there.
    temperature: float = Field(default=0.0, ge=0.0)  # 0, or at least MIN_TEMPERATURE
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)  # 1.0: off
    top_k: int = Field(default=0, ge=0)  # 0: off
    seed: int = Field(default=0, ge=0, lt=2**64)  # what torch's generators take; eval checks seed + decodes fits too
    samples_per_prompt: int = Field(default=1, ge=1)
    # The serving engine's draft rule at temperature > 0 (docs/EVAL.md, "Draft rules"): `vllm` (vLLM's default,
    # greedy drafts), `vllm-probabilistic` (vLLM's draft_sample_method probabilistic) or `sglang`. Greedy is one rule.
    proposal: Literal["vllm", "vllm-probabilistic", "sglang"] = "vllm"

    @field_validator("prompts", "prompt_sets", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # `prompts = "file"` in a file or `--set`: one source

    @field_validator("temperature")
    @classmethod
    def _greedy_or_servable(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (vLLM samples any lower temperature "
                             f"at {MIN_TEMPERATURE:g}, and near 0 logits / T overflow float32)")
        return value


class GenerateConfig(_Section):
    """Regenerating completions with the target: `hf` runs it locally; `openai` calls vLLM/SGLang at `base_url`
    (.../v1), one server or several (a list: requests are spread over them, `concurrency` in flight on each).

    `model` None: the served model (openai) or target.path (hf). `thinking` auto follows the dropped final turn (on when
    it had reasoning), else the template's default; a row's own `enable_thinking` (and its other settings:
    docs/GENERATE.md, "Per-row settings") overrides these. The API key is read from the environment variable
    `api_key_env`. A server that fails or stalls rests (backoff) while the others take its prompts; when no server has
    answered for `servers_down_timeout_s` (or `timeout_s`, the longer), the run stops, keeping what is done.
    """

    engine: Literal["hf", "openai"] = "hf"
    base_url: list[str] = Field(default_factory=list)
    model: str | None = None
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    concurrency: int = Field(default=8, ge=1)
    timeout_s: float = Field(default=120.0, gt=0)
    max_retries: int = Field(default=4, ge=0)
    retry_backoff_s: float = Field(default=1.0, ge=0.0)
    servers_down_timeout_s: float = Field(default=600.0, gt=0)
    request_token_ids: bool = True
    api_key_env: str = "OPENAI_API_KEY"
    batch_size: int = Field(default=8, ge=1)
    thinking: Literal["auto", "on", "off"] = "auto"
    # `last`: each row's final assistant turn is dropped and regenerated; `all`: every assistant turn is, in order, each
    # on the history the target wrote (docs/GENERATE.md, "Every turn")
    turns: Literal["last", "all"] = "last"
    rows_per_shard: int = Field(default=1000, ge=1)

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [] if value is None else [value] if isinstance(value, str) else value  # one server: `base_url = "..."`

    @field_validator("base_url")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if twice := next((url for i, url in enumerate(value) if url in value[:i]), None):
            raise ValueError(f"names {safe_url(twice)} twice; list each server once")
        return value


class ExportConfig(_Section):
    # The license the exported weights are published under (usually the target's), written into the model card's front
    # matter as the Hugging Face Hub reads it: a Hub license id such as apache-2.0, mit or llama3.1. None: the card
    # keeps the license it gives (`export --card-only`), else names none (docs/RESULTS.md, "Publishing on the Hub").
    license: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9.+-]*$", max_length=64)


class BlockdraftConfig(_Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    dflash: DFlashConfig = Field(default_factory=DFlashConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)

    @model_validator(mode="after")
    def _global_batch_splits(self) -> BlockdraftConfig:  # over every rank of every node
        ranks = len(self.placement.drafter_devices) * self.placement.nnodes
        accumulation_steps(self.train.global_batch_size, self.train.batch_size, ranks)
        return self

    @model_validator(mode="after")
    def _engine_settings_are_used(self) -> BlockdraftConfig:
        engine = self.target.engine
        if self.train.target_engine == "hf" and engine != TargetEngineConfig():
            changed = next(name for name in TargetEngineConfig.model_fields
                           if getattr(engine, name) != getattr(TargetEngineConfig(), name))
            raise ConfigError(f"target.engine.{changed} is set, and train.target_engine = 'hf' runs the target in the "
                             "trainer, without an engine; set train.target_engine = 'vllm' or drop [target.engine]")
        return self

    def digest(self, *sections: str) -> str:
        """sha256 of the resolved config (or of the named sections only), stable across runs."""
        data = self.resolved()
        if sections:
            data = {name: data[name] for name in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def load_config(
    path: str | Path | None = None, flags: dict | None = None, sets: Sequence[str] = (),
    flag_names: dict[str, str] | None = None,
) -> BlockdraftConfig:
    """Load and validate a TOML config with command-line overrides laid over it: `flags` ({"section": {"key": value}},
    None values ignored, so a CLI can pass every option and let the file decide the unset ones) and `sets`
    (`--set section.key=value` items). A bad override's one line names it as the user spelled it (`--max-length -3`,
    `--set train.max_steps=0`; `flag_names` {"section.key": "--flag"} for a flag not named after its key), a bad field
    of the file names the file and the field.
    """
    return load_with(path, set_overrides(sets, BlockdraftConfig, flag_overrides(flags or {}, names=flag_names)))


def load_with(path: str | Path | None, overrides: Overrides) -> BlockdraftConfig:
    """`load_config` with the overrides already gathered (`blockdraft.overrides`)."""
    label = str(path) if path else "(defaults)"
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file with --config")
        data = _read_toml(p)
    try:
        config = BlockdraftConfig.model_validate(apply(data, overrides, label))
    except ValidationError as exc:
        raise ConfigError(validation_line(label, exc, overrides, BlockdraftConfig)) from None
    _check_mask_token(config, label)
    # remembers each credential a setting carries (`redact_settings`): no message of this run names one
    config.resolved()
    return config


def _read_toml(p: Path) -> dict:
    """The TOML file `p` as data; ConfigError for a file that is not UTF-8 or not TOML, naming where."""
    try:
        return tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {p} is not valid TOML ({exc}); fix the syntax at that line") from None


def _check_mask_token(config: BlockdraftConfig, label: str) -> None:
    """ConfigError when dflash.mask_token_id is one of the target tokenizer's added tokens (when its folder is here)."""
    folder = config.target.tokenizer or config.target.path
    if config.dflash.mask_token_id is None or not folder or not Path(folder).is_dir():
        return
    mask, added = config.dflash.mask_token_id, tokenizer_added_tokens(Path(folder))
    if mask in added:  # the example row is read from the tokenizer's vocabulary only for the error line
        raise ConfigError(f"config {label}: "
                          f"{mask_token_problem(mask, added, folder_spare_row(Path(folder), config.target.path))}")
