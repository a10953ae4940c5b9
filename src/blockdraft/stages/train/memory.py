"""The memory plan of a training run, from the target's config.json alone: no weights loaded, no data, no GPU needed.

Per device of the placement: each target replica (its weights, counted exactly by building the target on the meta
device, and its forward), and each drafter rank (fp32 weights, gradients, AdamW moments, DDP buckets, the frozen
embedding and LM head copy, activations at train.max_length x train.batch_size). A plan that does not fit a device's
memory is refused with one line before the target loads. docs/PERFORMANCE.md ("memory plan") derives every formula.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from blockdraft.config import BlockdraftConfig, TrainConfig, accumulation_steps
from blockdraft.errors import redact
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.model.block_sparse import resolve_attention
from blockdraft.model.split import TargetSplit, meta_target, split_target
from blockdraft.model.target import load_target_config, target_dtype
from blockdraft.stages.train.ranks import register_grad_allreduce, target_group_of

GB = 1e9
# A CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's first blocks: per process on each GPU it uses
# (0.3-1 GB depending on driver and CUDA version; an allowance, not a measurement).
CUDA_RUNTIME_BYTES = 500_000_000
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class DevicePlan:
    """What one device holds: (label, bytes each, how many) per item; `capacity` None when unknown."""

    device: str
    capacity: int | None
    items: dict[str, list[int]] = field(default_factory=dict)
    target_replicas: int = 0
    drafter_ranks: int = 0

    def add(self, label: str, nbytes: int) -> None:
        entry = self.items.setdefault(label, [nbytes, 0])
        entry[1] += 1

    @property
    def total(self) -> int:
        return sum(each * count for each, count in self.items.values())

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def largest(self, n: int = 3) -> str:
        ranked = sorted(self.items.items(), key=lambda kv: -kv[1][0] * kv[1][1])[:n]
        return ", ".join(f"{label} {_times(count)}{each / GB:.2f}" for label, (each, count) in ranked)


def _times(count: int) -> str:
    return f"{count} x " if count > 1 else ""


@dataclass
class MemoryPlan:
    """The plan of every device (cpu, then cuda:0, cuda:1, ...) and the facts it was computed from."""

    devices: list[DevicePlan]
    facts: list[str]
    checkpointing: bool = False  # train.activation_checkpointing, for the fix a refusal suggests

    def lines(self) -> list[str]:
        """The plan as printed: facts, then per device its items in GB, total, capacity and verdict."""
        out = [*self.facts, f"{'device':<8} {'item':<54} {'GB':>9}"]
        for plan in self.devices:
            for label, (each, count) in plan.items.items():
                shown = f"{_times(count)}{each / GB:.2f}" if count > 1 else f"{each / GB:.2f}"
                out.append(f"{plan.device:<8} {label:<54} {shown:>9}")
            cap = (
                "capacity unknown (set train.device_memory_gb)"
                if plan.capacity is None
                else f"of {plan.capacity / GB:.2f}"
            )
            verdict = {None: "", True: "  fits", False: "  DOES NOT FIT"}[plan.fits]
            out.append(f"{plan.device:<8} {'total':<54} {plan.total / GB:>9.2f}  {cap}{verdict}")
        return out + self.warnings()

    def warnings(self) -> list[str]:
        """Devices that hold several target replicas (one per rank that names them) while the fit is unknown."""
        return [
            f"note: {p.device} holds {p.target_replicas} target replicas, one per rank using it ({p.total / GB:.2f} GB "
            "in all); list one target device per drafter device unless that fits"
            for p in self.devices
            if p.target_replicas > 1 and p.fits is None
        ]

    def problem(self) -> str | None:
        """One line for the first device the plan does not fit, or None."""
        for p in self.devices:
            if p.fits is False:
                assert p.capacity is not None
                fixes = (
                    ["list one target device (or device group) per drafter device (placement.target_devices)"]
                    if p.target_replicas > 1
                    else []
                )
                if p.drafter_ranks:
                    fixes.append("lower train.batch_size or train.max_length")
                    fixes += [] if self.checkpointing else ["set train.activation_checkpointing = true"]
                fixes.append("use devices with more memory")
                return (f"memory plan: {p.device} needs {p.total / GB:.2f} GB ({p.largest()}) but has "
                        f"{p.capacity / GB:.2f} GB; "
                        f"{', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}")
        return None


def count_target(hf_config: Any, dtype: torch.dtype) -> tuple[nn.Module, int, int]:
    """The target built on the meta device (no memory, no weights read) as the trainer loads it (`meta_target`, which
    keeps it per config and dtype), its parameter count, and its bytes (parameters and buffers, each in the dtype the
    model keeps it in)."""
    model = meta_target(hf_config, dtype)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return model, params, nbytes


def count_drafter(spec: DrafterSpec) -> tuple[int, int]:
    """(parameters, elements of the nn.Linear weights: those bf16 autocast copies) of the drafter built on meta."""
    with torch.device("meta"):
        drafter = DFlashDrafter(spec)
    linear = sum(m.weight.numel() for m in drafter.modules() if isinstance(m, nn.Linear))
    return sum(p.numel() for p in drafter.parameters()), linear


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for one drafter step's backward: `kept` in all, `layer` one decoder layer's share."""

    kept: int
    layer: int


def drafter_activations(
    spec: DrafterSpec, batch: int, context: int, anchors: int, autocast: bool, attention: str = "dense",
    repeat_kv: bool = False, checkpointing: bool = False,
) -> Activations:
    """What the drafter's forward (and the chunked loss) keep for backward: b rows of S context tokens and Q = N*B
    block queries, T = S + Q keys; `attention` "dense" (SDPA with the block mask) or "flex" (block-sparse).

    Bytes a = 2 under bf16 autocast (CUDA), 4 in fp32; RMSNorm statistics are fp32 either way. Per layer and query
    row: two norms of the fp32 residual (8H + 4 each), the linear layers' inputs (5 casts of H under autocast, 2
    shared fp32 copies otherwise), q_norm (h*d*(4 + a) + 4h), k_norm (g*d*(4 + a) + 4g), attention (mask bias T*a,
    q and output 2*h*d*a, log-sum-exp 4h), MLP (gate, up, silu, product: 4*I*a); per key row K and V (2*g*d*a);
    per context row k_norm (g*d*(4 + a) + 4g) and under autocast the two casts of C for k/v_proj (2*H*a).
    Once: fc's input cast (K*H*a, autocast), hidden_norm (H*(4 + a) + 4), C in fp32 mode (4H), RoPE cos/sin (8d per
    row), the final norm (8H + 4) and the loss's hidden-state gradient (4H) per query row, less what layer 0's input
    norm does not keep (its input needs no gradient: 4H + 4 per query row). `attention` "flex" keeps no mask bias;
    `repeat_kv` (dense on CUDA) keeps K and V per query head (2*h*d*a per key row) instead of per KV head. With
    `checkpointing` a layer keeps only its inputs (the fp32 residual 4H per query row, context K in fp32 and V in a:
    g*d*(4 + a) per context row). tests/test_plan.py checks all of this against what autograd saves, to the byte.
    A DFlash2 layer's four convolution sides keep, per query row and tap, the shifted input and its kernel (8 x 4H in
    fp32, 32H per tap) and per tap after the first a block-boundary mask (8): exact in fp32, an upper bound under
    autocast (where part of them is bf16). Checkpointing keeps none of it (a layer's inputs are the same).
    """
    a = 2 if autocast else 4
    hidden, inner, heads, kv, d, n_feat = (spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                                           spec.num_key_value_heads, spec.head_dim, spec.num_target_features)
    b, s, q = batch, context, anchors * spec.block_size
    keys = s + q
    per_query = (2 * (8 * hidden + 4) + (5 if autocast else 2) * hidden * a + heads * d * (4 + a) + 4 * heads
                 + kv * d * (4 + a) + 4 * kv + (keys * a if attention == "dense" else 0) + 2 * heads * d * a + 4 * heads
                 + 4 * inner * a)
    if spec.dflash2 is not None:
        taps = spec.dflash2.conv_kernel_size
        per_query += taps * 32 * hidden + (taps - 1) * 8
    per_key = 2 * (heads if repeat_kv else kv) * d * a
    per_context = kv * d * (4 + a) + 4 * kv + (2 * hidden * a if autocast else 0)
    layer = b * (q * per_query + keys * per_key + s * per_context)
    once = (b * s * ((n_feat * hidden * a if autocast else 0) + hidden * (4 + a) + 4 + (0 if autocast else 4 * hidden)
                     + 8 * d)
            + b * q * (8 * d + (8 * hidden + 4) + 4 * hidden) + 4)  # + the loss's scalar denominator
    if checkpointing:  # layer 0's input is the block embeddings themselves (counted with the batch)
        kept_layer = b * (q * 4 * hidden + s * (kv * d * (4 + a) + per_context))
        return Activations(once + spec.num_layers * kept_layer - b * q * 4 * hidden, layer)
    return Activations(once + spec.num_layers * layer - b * q * (4 * hidden + 4), layer)


def selector_items(spec: DrafterSpec, queries: int, chunk_rows: int, head_bytes: int) -> list[tuple[str, int]]:
    """A DFlash2 drafter's loss-side extras for `queries` block slots per micro-batch (its codebooks' and convolutions'
    weights are in the drafter's parameter count, their activations in `drafter_activations`), with k = K + 1 (the top-K
    and the gold) and r the selector's rank: each slot's candidates (int64 ids, fp32 unary logits: 12k), what the
    selector's scores keep for backward (the slot's hidden state 4H, each candidate's successor-codebook row and id
    k(4r + 8), the predecessor's row, the projection and their product 12r, the scores' fp32 copies 16k, row indices
    32), and in backward one chunk's gathered head rows for the candidates' logits (`chunk_rows` x k x H in the head's
    dtype). An upper estimate for slots that all count (tests/test_plan.py checks it against what autograd keeps)."""
    assert spec.dflash2 is not None
    k, r, hidden = spec.dflash2.selector_top_k + 1, spec.dflash2.selector_rank, spec.hidden_size
    return [
        ("top-K candidates + gold (ids, unary logits)", queries * k * 12),
        ("selector scores (hidden, codebook rows)", queries * (4 * hidden + k * (4 * r + 8) + 12 * r + 16 * k + 32)),
        ("candidates' head rows (backward, one chunk)", chunk_rows * k * hidden * head_bytes),
    ]


def device_capacity(device: str, configured_gb: float | None) -> int | None:
    """Bytes a device holds: train.device_memory_gb when set, else what torch reports for a CUDA device, the machine's
    RAM for the CPU, None (unknown) otherwise. Asks for device properties only: no CUDA context is created."""
    if configured_gb is not None:
        return int(configured_gb * GB)
    kind, _, index = device.partition(":")
    if kind == "cuda" and torch.cuda.is_available():
        i = int(index or 0)
        return torch.cuda.get_device_properties(i).total_memory if i < torch.cuda.device_count() else None
    if kind == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def memory_plan(config: BlockdraftConfig, hf_config: Any = None,
                capacity: Callable[[str], int | None] | None = None) -> MemoryPlan:
    """The plan of `config`'s placement on this machine (one rank per drafter device) from the target's config
    (`hf_config`, default: read from target.path); `capacity` maps a device to its bytes (default `device_capacity`)."""
    hf_config = hf_config if hf_config is not None else load_target_config(config.target.path)
    tc, placement = config.train, config.placement
    spec = DrafterSpec.from_target_config(hf_config, config.dflash)
    t_name = target_dtype(config.target.dtype, hf_config)
    t_bytes = _DTYPE_BYTES[t_name]
    target, target_params, target_bytes = count_target(hf_config, getattr(torch, t_name))
    hf_model: Any = target  # a PreTrainedModel: its embedding and LM head are what TargetHead copies
    head = [*hf_model.get_input_embeddings().parameters(), *hf_model.get_output_embeddings().parameters()]
    head_bytes = sum(p.numel() for p in head) * t_bytes
    d_params, d_linear = count_drafter(spec)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    inner = int(getattr(text, "intermediate_size", None) or 4 * spec.hidden_size)
    b, s, q = tc.batch_size, tc.max_length, config.dflash.num_anchors * spec.block_size
    feat = b * s * spec.num_target_features * spec.hidden_size

    def target_forward(features: int) -> int:
        """A forward's bytes on a device that keeps `features` hidden states per token: the captured layers (and
        where the inputs enter, their concatenation), one decoder layer's working set and the causal mask."""
        return b * s * (features * spec.hidden_size + 4 * spec.hidden_size + 3 * inner) * t_bytes + b * s * s * t_bytes

    world = int(os.environ.get("WORLD_SIZE", str(len(placement.drafter_devices) * placement.nnodes)))
    # A step's inputs hold the features of all its micro-batches, and `pipeline_depth` steps wait ahead of the drafter.
    micro = accumulation_steps(tc.global_batch_size, b, world) * (1 + tc.pipeline_depth)
    sizer = capacity or (lambda device: device_capacity(device, tc.device_memory_gb))
    plans: dict[str, DevicePlan] = {}

    def on(device: str) -> DevicePlan:
        return plans.setdefault(device, DevicePlan(device, sizer(device)))

    splits: dict[tuple[str, ...], TargetSplit] = {}
    for rank, drafter_device in enumerate(placement.drafter_devices):
        group = target_group_of(placement, rank)
        target_device = group[0]
        if tc.target_engine != "hf":  # the engine holds the target, on its own devices: nothing of it here
            group = ()
        elif len(group) == 1:
            target_plan = on(target_device)
            target_plan.target_replicas += 1
            target_plan.add(f"target weights ({t_name})", target_bytes)
            target_plan.add("target forward (features, one layer, mask)",
                            target_forward(2 * spec.num_target_features))
        else:
            split = splits.get(group) or splits.setdefault(group, split_target(target, spec.num_target_layers, group))
            for index, device in enumerate(group):
                layers = split.layers_on(index)
                part = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
                share = on(device)
                share.target_replicas += 1
                share.add(f"target weights ({t_name}, {part}" + (" + embedding)" if index == 0 else ")"),
                          split.weight_bytes(index))
                captured = sum(i in layers for i in spec.target_layer_ids)
                share.add("target forward (features, one layer, mask)",
                          target_forward(2 * spec.num_target_features if index == 0 else captured))
        drafter_plan = on(drafter_device)
        drafter_plan.drafter_ranks += 1
        autocast = drafter_device.startswith("cuda")  # the trainer's bf16 autocast; fp32 elsewhere
        attention = resolve_attention(tc.attention, torch.device(drafter_device))
        repeat_kv = attention == "dense" and autocast and spec.num_attention_heads != spec.num_key_value_heads
        act = drafter_activations(spec, b, s, config.dflash.num_anchors, autocast, attention, repeat_kv,
                                  tc.activation_checkpointing)
        drafter_plan.add("drafter weights (fp32)", 4 * d_params)
        drafter_plan.add("drafter gradients (fp32)", 4 * d_params)
        drafter_plan.add("AdamW moments (fp32, 2 per parameter)", 8 * d_params)
        if world > 1:
            drafter_plan.add("DDP gradient buckets (fp32)", 4 * d_params)
        drafter_plan.add(f"frozen embedding + LM head copy ({t_name})", head_bytes)
        if autocast:
            drafter_plan.add("bf16 weight copies (autocast)", 2 * d_linear)
        copy = ", fp32 copy" if t_bytes != 4 else ""  # a micro-batch's forward makes one of a bf16 target's features
        drafter_plan.add(f"target features ({micro} micro-batches{copy})",
                         feat * (t_bytes * micro + (4 if copy else 0)))
        masks = (1 + spec.has_sliding) * (s + q) if attention == "dense" else 0  # bool [b, 1, Q, T] per layer kind
        drafter_plan.add("block embeddings" + (" + attention masks" if masks else ""),
                         b * q * (4 * spec.hidden_size + masks))
        drafter_plan.add("activations kept for backward" + (" (checkpointed)" if tc.activation_checkpointing else ""),
                         act.kept)
        drafter_plan.add("backward working space (one layer)", act.layer)
        rows = min(tc.lm_head_chunk_blocks * spec.block_size, b * q)
        chunk = rows * spec.vocab_size * (4 + (t_bytes if t_bytes != 4 else 0))
        distill = tc.distill_weight > 0  # the target's final hidden states come along, its logits per chunk
        drafter_plan.add("LM-head chunk (logits, probabilities)" + (" x 2 (distillation)" if distill else ""),
                         chunk * (2 if distill else 1))
        if distill:
            drafter_plan.add(f"target final hidden states ({micro} micro-batches)",
                             b * s * spec.hidden_size * t_bytes * micro)
        if spec.dflash2 is not None:
            for label, nbytes in selector_items(spec, b * q, rows, t_bytes):
                drafter_plan.add(label, nbytes)
        for device in {*group, drafter_device}:
            if device.startswith("cuda"):
                on(device).add("CUDA runtime (per process)", CUDA_RUNTIME_BYTES)
    facts = [
        f"target: {type(target).__name__}, {target_params:,} parameters in {t_name} ({target_bytes / GB:.2f} GB); "
        f"drafter: {d_params:,} parameters ({spec.num_layers} layers), fp32 masters",
        f"step: batch {b} x {s} tokens, {config.dflash.num_anchors} anchors x block {spec.block_size} = {q} queries "
        f"per row; {len(placement.drafter_devices)} rank(s) on this machine, world size {world}, "
        f"{micro // (1 + tc.pipeline_depth)} micro-batch(es) per rank per step, {tc.pipeline_depth} step(s) ahead; "
        f"activation checkpointing {'on' if tc.activation_checkpointing else 'off'}",
    ]
    facts += [split.describe() for split in splits.values()]
    if tc.target_engine != "hf":
        facts.append(f"target: served by {tc.target_engine} (train.target_engine), {engine_where(config, target_bytes)}"
                     ", which plans its own devices; only its embedding and LM head are held here, beside each "
                     "drafter")
    if placement.nnodes > 1:
        facts.append(node_traffic(placement.nnodes, world, d_params, tc.grad_allreduce_dtype))
    return MemoryPlan(sorted(plans.values(), key=lambda p: _device_order(p.device)), facts, tc.activation_checkpointing)


def engine_where(config: BlockdraftConfig, target_bytes: int) -> str:
    """Where the engine that serves the target runs, and the weights each of its devices holds, in the plan's words."""
    engine = config.target.engine
    if engine.url is not None:
        return f"already serving at {redact(engine.url)} (target.engine.url)"
    tp, pp, dp = engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.data_parallel_size
    return (f"started by each rank on {tp * pp * dp} device(s) (tensor x pipeline x data parallel {tp} x {pp} x {dp}"
            f"{', experts spread over them' if engine.enable_expert_parallel else ''}), about "
            f"{target_bytes / (tp * pp) / 1e9:.2f} GB of weights on each (its {target_bytes / 1e9:.2f} GB over "
            "tensor x pipeline)")


def node_traffic(nodes: int, world: int, params: int, dtype: str) -> str:
    """The plan's line for several nodes: each holds the devices listed (the same on every node), and per optimizer step
    the drafter's gradients cross between nodes once (one DDP all-reduce; accumulation's other micro-batches skip it).
    A ring all-reduce of G bytes over W ranks sends 2 x (W - 1) / W x G over every link of the ring; with each node's
    ranks next to each other in the ring, that is what leaves each node."""
    grads = params * _DTYPE_BYTES[dtype]
    sent = 2 * (world - 1) * grads / world
    return (f"{nodes} nodes, each with the devices below; inter-node gradient all-reduce per step: {grads / 1e6:.1f} "
            f"MB of gradients ({dtype}, train.grad_allreduce_dtype), about {sent / 1e6:.1f} MB out of each node (ring "
            f"over {world} ranks)")


def _device_order(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    return kind, int(index or -1)


def apply_memory_options(drafter: DFlashDrafter, model: nn.Module, train: TrainConfig) -> None:
    """train.activation_checkpointing (each drafter layer recomputed in backward) and train.grad_allreduce_dtype (the
    DDP gradient all-reduce in bf16); call right after the DDP wrap, `model` being the wrapped module or the bare
    one."""
    drafter.checkpoint_layers = train.activation_checkpointing
    if isinstance(model, nn.parallel.DistributedDataParallel):
        register_grad_allreduce(model, train.grad_allreduce_dtype)


__all__ = [
    "Activations",
    "DevicePlan",
    "MemoryPlan",
    "apply_memory_options",
    "count_drafter",
    "count_target",
    "device_capacity",
    "drafter_activations",
    "memory_plan",
    "node_traffic",
    "selector_items",
]
