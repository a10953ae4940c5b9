"""`train(config)`: the frozen target on its devices, one drafter replica per drafter device, verified checkpoints.

One process per drafter device (torchrun sets RANK/WORLD_SIZE); ranks are data-parallel (DDP: gloo on CPU, nccl on
GPU). Each rank trains on its own slice of every global batch; see `blockdraft.stages.train.loss` for why the loss is
scaled so that DDP equals one process on the global batch.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.errors import ArtifactError, ConfigError, StoreError
from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead, TargetModel, load_target
from blockdraft.model.formats import find_resumable
from blockdraft.model.target import load_target_config
from blockdraft.stages.train.batch import BlockBatch, anchor_generator, build_block_batch, expected_acceptance
from blockdraft.stages.train.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from blockdraft.stages.train.data import TrainRows, load_train_rows, step_rows, steps_per_epoch
from blockdraft.stages.train.loss import LossOutput, block_loss
from blockdraft.stages.train.metrics import MetricsLog
from blockdraft.store import Store, open_store

console = Console(stderr=True)


@dataclass
class RankPlacement:
    rank: int
    world_size: int
    local_rank: int
    drafter_device: torch.device
    target_device: torch.device


def resolve_placement(config: BlockdraftConfig) -> RankPlacement:
    """This process's devices: drafter_devices[local rank], and target_devices[local rank] (one each) or the single
    target device. The device lists describe one machine; torchrun across machines runs the same lists on each."""
    drafters, targets = config.placement.drafter_devices, config.placement.target_devices
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if local_world != len(drafters):
        raise ConfigError(
            f"placement.drafter_devices lists {len(drafters)} device(s) but {local_world} process(es) run on this machine; "
            f"launch one process per drafter device (blockdraft train --nproc {len(drafters)})"
        )
    if len(targets) == len(drafters):
        target = targets[local_rank]
    elif len(targets) == 1:
        target = targets[0]
    else:
        raise ConfigError(
            f"placement.target_devices lists {len(targets)} devices for {len(drafters)} drafter devices; "
            "give one target device per drafter device, or a single one that every rank uses"
        )
    return RankPlacement(rank, world, local_rank, torch.device(drafters[local_rank]), torch.device(target))


class DraftForward(nn.Module):
    """The drafter's whole differentiable path in one forward, so DDP sees every parameter use."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, features, block_hidden, block_positions, context_positions, attention_mask):
        context = self.drafter.project_context(features)
        return self.drafter(block_hidden, context, block_positions, context_positions, attention_mask)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


PINNED_DATA_FIELDS = ("template_sha256", "thinking", "tokenizer_sha256", "end_of_turn_id")


def resolved_training_config(
    config: BlockdraftConfig, spec: DrafterSpec, output_url: str, tokenize_run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config with every derived DFlash value pinned (mask id, layer ids, gamma, shapes), as written into checkpoints.

    `tokenize_run` (what the tokenized data's manifest records: chat-template hash, thinking mode, tokenizer hash) is
    pinned under "data", so eval and export read the template a drafter was trained for from the checkpoint itself.
    """
    data = config.resolved()
    data["data"] = {key: (tokenize_run or {}).get(key) for key in PINNED_DATA_FIELDS}
    data["dflash"].update(
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        gamma=spec.gamma,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
    )
    data["train"]["output"] = output_url
    return data


def _run_identity(resolved: dict[str, Any], world_size: int, data_sha256: str | None) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint for its next steps to be the ones the first run would take."""
    t = resolved["train"]
    return {
        "target": resolved["target"]["path"],
        "dflash": resolved["dflash"],
        "data_sha256": data_sha256,
        "seed": t["seed"],
        "global_batch": t["batch_size"] * world_size,
        "max_length": t["max_length"],
    }


def parameter_fingerprint(module: nn.Module) -> torch.Tensor:
    """[2] int64 over the exact bits of every parameter: equal on two ranks iff (practically) their parameters are bit-equal.

    Integer arithmetic (wrapping on overflow) so that no rounding can hide a one-ulp difference.
    """
    total = None
    for i, p in enumerate(module.parameters()):
        bits = p.detach().float().flatten().view(torch.int32).long()
        weights = torch.arange(1, bits.numel() + 1, device=bits.device) * (2 * i + 1)
        part = torch.stack([bits.sum(), (bits * weights).sum()])
        total = part if total is None else total + part
    return total


def _check_ranks_in_sync(drafter: nn.Module, world_size: int) -> None:
    """Refuse to checkpoint replicas that drifted apart (a DDP bug would otherwise train world_size different models)."""
    mine = parameter_fingerprint(drafter)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(everyone[0], other) for other in everyone[1:]):
        raise RuntimeError("drafter replicas differ across ranks after the optimizer step; DDP lost synchronisation")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _preflight(store: Store) -> None:
    """Fail in seconds, before step 1, when the checkpoint store cannot be written (docs/STORE.md, credentials)."""
    from blockdraft.store.preflight import preflight

    preflight(store)


def forward_backward(
    model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: BlockBatch,
    features: torch.Tensor,
    chunk_blocks: int,
    grad_clip: float,
) -> tuple[LossOutput, torch.Tensor]:
    """One step's gradients: drafter forward (bf16 autocast on GPU), chunked loss, backward, clipping.

    model is the drafter's `DraftForward` (DDP-wrapped under torchrun); features [b, S, K*H] on the drafter's device.
    Returns the loss and the total gradient norm before clipping; the caller steps the optimizer.
    """
    device = features.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    block_hidden = head.embed(batch.block_ids).float()
    with autocast:
        hidden = model(features.float(), block_hidden, batch.block_positions, batch.context_positions, batch.attention_mask)
        out = block_loss(
            hidden, batch.labels, batch.weights, head.lm_head_weight, head.lm_head_bias, drafter.spec.block_size, chunk_blocks
        )
    for p in drafter.parameters():
        p.grad = None
    out.loss.backward()
    return out, torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)


@dataclass
class TrainResult:
    """steps: optimizer steps done in total; metrics: every step of this run (all ranks); drafter: the trained module;
    head: the frozen drafter-side embedding and LM head."""

    steps: int
    resumed_from: int | None
    checkpoint_url: str | None
    metrics: list[dict[str, Any]]
    drafter: DFlashDrafter
    head: TargetHead


def train(config: BlockdraftConfig, step_callback: Callable[[int, dict[str, Any]], None] | None = None) -> TrainResult:
    """Train a drafter per `config`; returns after the final checkpoint verified at the destination.

    `step_callback(step, metrics)` runs after each optimizer step on every rank.
    """
    placement = resolve_placement(config)
    owns_group = placement.world_size > 1 and not dist.is_initialized()
    if owns_group:
        if placement.drafter_device.type == "cuda":
            torch.cuda.set_device(placement.drafter_device)
        dist.init_process_group("nccl" if placement.drafter_device.type == "cuda" else "gloo")
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if config.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        return _train(config, placement, step_callback)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if owns_group:
            dist.destroy_process_group()


def _train(config: BlockdraftConfig, place: RankPlacement, step_callback) -> TrainResult:
    tc = config.train
    is_main = place.rank == 0
    if tc.data is None:
        raise ConfigError("train.data is not set; set it to a tokenized artifact (a folder, file:// or s3:// URL)")
    load_target_config(config.target.path)  # a missing target fails in seconds, before any data moves
    output_url = tc.output or config.store.url.rstrip("/") + "/train"
    out_store = open_store(output_url, config.store)
    if is_main:
        _preflight(out_store)

    barrier = dist.barrier if place.world_size > 1 else (lambda: None)
    rows: TrainRows = load_train_rows(tc.data, config.store, tc.max_length, Path(tc.log_dir), place.local_rank == 0, barrier)
    hf_target = load_target(config.target.path, place.target_device, config.target.dtype)
    spec = DrafterSpec.from_target_config(hf_target.config, config.dflash)
    target = TargetModel(hf_target, spec.target_layer_ids)
    head = TargetHead.from_target(hf_target, place.drafter_device)
    resolved = resolved_training_config(config, spec, output_url, rows.tokenize_run)
    identity = _run_identity(resolved, place.world_size, rows.lineage.sha256)

    torch.manual_seed(tc.seed)
    drafter = DFlashDrafter(spec).to(place.drafter_device)
    model: nn.Module = DraftForward(drafter)
    if place.world_size > 1:
        device_ids = [place.drafter_device] if place.drafter_device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    per_epoch = steps_per_epoch(len(rows), tc.batch_size * place.world_size)
    total_steps = tc.max_steps or tc.epochs * per_epoch
    warmup = round(tc.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, total=total_steps))

    log = MetricsLog(Path(tc.log_dir))
    start_step, resumed_from, last_url = _resume(out_store, config.store, drafter, optimizer, scheduler, identity, log, place)
    if start_step == 0 and is_main:
        log.start_fresh()

    def inputs_of(step: int) -> tuple[BlockBatch, torch.Tensor]:
        """The batch of `step` on the drafter's device, and its target features [b, S, K*H] fp32 (queued, not awaited)."""
        epoch, in_epoch = divmod(step, per_epoch)
        idx = step_rows(len(rows), tc.seed, epoch, in_epoch, tc.batch_size * place.world_size, place.rank, tc.batch_size)
        batch = build_block_batch(
            [rows.row(i) for i in idx],
            num_anchors=config.dflash.num_anchors,
            block_size=spec.block_size,
            mask_token_id=spec.mask_token_id,
            gamma=spec.gamma,
            generators=[anchor_generator(tc.seed, epoch, i) for i in idx],
        ).to(place.drafter_device)
        features = target.features(
            batch.input_ids.to(place.target_device), batch.attention_mask_context.long().to(place.target_device)
        ).to(place.drafter_device, torch.float32)
        return batch, features

    metrics: list[dict[str, Any]] = []
    progress = _progress(is_main)
    next_inputs = inputs_of(start_step) if start_step < total_steps else None
    with progress:
        task = progress.add_task("train", total=total_steps, completed=start_step)
        for step in range(start_step, total_steps):
            t0 = time.perf_counter()
            epoch = step // per_epoch
            batch, features = next_inputs
            out, grad_norm = forward_backward(model, drafter, head, batch, features, tc.lm_head_chunk_blocks, tc.grad_clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            # The next step's target forward is queued before this step's metrics wait for the drafter's device, so a
            # target on its own GPUs runs while the drafter finishes its backward and optimizer step.
            next_inputs = inputs_of(step + 1) if step + 1 < total_steps else None

            totals = torch.cat([out.weighted_ce.reshape(1), out.slots.correct, out.slots.total,
                                torch.tensor([float(batch.num_tokens)], device=out.weighted_ce.device)])
            if place.world_size > 1:
                dist.all_reduce(totals)
            if place.drafter_device.type == "cuda":
                torch.cuda.synchronize(place.drafter_device)
            step_time = time.perf_counter() - t0
            nslots = spec.block_size - 1
            correct, counted = totals[1 : 1 + nslots], totals[1 + nslots : 1 + 2 * nslots]
            acc = (correct / counted.clamp_min(1)).tolist()
            tokens = int(totals[-1])
            entry = {
                "step": step + 1,
                "epoch": epoch,
                "loss": float(totals[0] / out.weight_sum.clamp_min(1e-12)),
                "lr": lr,
                "grad_norm": float(grad_norm),
                "slot_accuracy": acc,
                "tau_estimate": expected_acceptance(acc),
                "tokens": tokens,
                "step_time_s": step_time,
                "tokens_per_s": tokens / step_time,
            }
            metrics.append(entry)
            done = step + 1
            if is_main:
                if done % tc.log_every == 0 or done == total_steps:
                    log.append(entry)
                progress.update(task, completed=done, description=f"loss {entry['loss']:.4f} tau~{entry['tau_estimate']:.2f}")
            if step_callback is not None:
                step_callback(done, entry)
            checkpoint_now = done % tc.checkpoint_every == 0 or done == total_steps
            if checkpoint_now and place.world_size > 1:
                _check_ranks_in_sync(drafter, place.world_size)
            if is_main and checkpoint_now:
                state = {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": _rng_state(),
                    "data": {"step": done, "epoch": done // per_epoch, "step_in_epoch": done % per_epoch},
                    "world_size": place.world_size,
                }
                url = _push_checkpoint(
                    out_store, done, drafter, state, resolved, rows, identity, log, final=done == total_steps,
                    ranks_in_sync=place.world_size, keep=tc.keep_checkpoints,
                )
                last_url = url or last_url
    return TrainResult(total_steps, resumed_from, last_url, metrics, drafter, head)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled, transient=False,
    )


def _push_checkpoint(
    out_store, step, drafter, state, resolved, rows, identity, log: MetricsLog, final: bool, ranks_in_sync: int, keep: int | None
) -> str | None:
    """Save and verify one checkpoint; a failed intermediate push is reported and training goes on, a failed final one raises.

    `ranks_in_sync`: how many replicas were checked bit-equal just before (1 without DDP); `keep`: train.keep_checkpoints.
    """
    log.plot()
    counts = {"step": step, "run": identity, "ranks_in_sync": ranks_in_sync, "last": log.entries[-1] if log.entries else None}
    try:
        report = save_checkpoint(out_store, step, drafter, state, resolved, [rows.lineage], counts, [log.path, log.plot_path])
    except (ArtifactError, StoreError, OSError) as exc:
        if final:
            raise ArtifactError(f"final checkpoint of step {step} did not verify at {out_store.url}: {exc}") from exc
        console.print(f"[yellow]checkpoint of step {step} did not verify ({exc}); it will not be resumed from[/]", highlight=False)
        return None
    console.print(f"checkpoint step {step}: {report.summary()} at {report.url}", highlight=False)
    if keep is not None:
        pruned = prune_checkpoints(out_store, keep)
        if pruned:
            console.print(f"removed older checkpoints of steps {pruned} (train.keep_checkpoints = {keep})", highlight=False)
    return report.url


def _resume(
    out_store, settings, drafter, optimizer, scheduler, identity, log: MetricsLog, place: RankPlacement
) -> tuple[int, int | None, str | None]:
    """Load the newest verified checkpoint into every rank; returns (start step, resumed step or None, its URL or None)."""
    found = find_resumable(out_store)
    if place.rank == 0:
        for skipped in found.skipped if found else []:
            console.print(f"[yellow]not resuming from {skipped}[/]", highlight=False)
    if found is None:
        return 0, None, None
    manifest = found.report.manifest
    if manifest.counts.get("run") != identity:
        old, new = manifest.counts.get("run") or {}, identity
        differs = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ConfigError(
            f"{found.store.url} is a checkpoint of another run (differs in {', '.join(differs)}); "
            "set train.output to a new location, or rerun with the original config"
        )
    loaded = load_checkpoint(found, settings)
    try:
        drafter.load_state_dict({k: v.to(next(drafter.parameters()).device) for k, v in loaded.drafter_state.items()})
        optimizer.load_state_dict(loaded.training_state["optimizer"])
        scheduler.load_state_dict(loaded.training_state["scheduler"])
        _set_rng_state(loaded.training_state["rng"])
        if place.rank == 0:
            log.restart_from(loaded.folder, found.step)
            console.print(f"resuming from verified checkpoint {found.store.url} (step {found.step})", highlight=False)
    finally:
        loaded.close()
    return found.step, found.step, found.store.url


def launch(config_path: str | None, nproc: int | None = None) -> int:
    """`blockdraft train`: run in this process when it is a torchrun rank or the only rank; otherwise start
    `torch.distributed.run` with one process per drafter device and return its exit status."""
    config = load_config(config_path)
    wanted = len(config.placement.drafter_devices)
    if nproc is not None and nproc != wanted:
        raise ConfigError(
            f"--nproc {nproc} but placement.drafter_devices lists {wanted} device(s); one process runs per drafter device, "
            "so list the devices in the config"
        )
    if "LOCAL_RANK" in os.environ or wanted == 1:
        result = train(config)
        if int(os.environ.get("RANK", "0")) == 0:
            if result.metrics:
                last = result.metrics[-1]
                console.print(
                    f"trained {result.steps} steps; loss {last['loss']:.4f}, tau estimate {last['tau_estimate']:.2f}", highlight=False
                )
            else:
                console.print(f"nothing to train: the verified checkpoint already holds all {result.steps} steps", highlight=False)
            print(result.checkpoint_url)
        return 0
    if config_path is None:
        raise ConfigError("training on several drafter devices needs the config as a file; pass --config FILE")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={wanted}",
        "-m", "blockdraft", "train", "--config", str(config_path),
    ]
    return subprocess.call(command)


__all__ = ["DraftForward", "RankPlacement", "TrainResult", "forward_backward", "launch", "parameter_fingerprint", "resolve_placement", "train", "warmup_cosine"]
