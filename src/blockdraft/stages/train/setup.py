"""Everything one rank builds before its first step: the drafter (new, or from train.init_from), the objective, the
optimizer and its learning-rate schedule.

What one rank's training run is made of, built before its first step: the frozen target on its device, the drafter
(its spec derived from the target, its first weights from train.init_from or train.init) wrapped for DDP with the memory
options applied, the objective, the optimizer and its schedule, the order of the rows, and the run's checkpoints (its
resolved config and run identity). `Trainer` runs the loop over it.

The learning-rate schedule, and saying which limit sets its length (docs/TRAINING-SIGNAL.md, "Schedule").

The schedule is linear warmup then cosine decay to 0 at the run's last step. Its plan (warmup, total, and where a new
cosine restarted it) rides in the scheduler's state in every checkpoint, so a resumed run knows the plan it continues.
A resume whose config plans another length (train.max_steps raised, train.epochs changed) is refused in one line unless
`--force`, which continues with a new cosine: the full learning rate at the resumed step, decaying to 0 at the new end.

`train.init_from`: start training from a drafter in the export format (a published drafter, an export, a checkpoint
or a training output) instead of random weights.

The drafter must be one this run would build: its mask id, target layer ids, block size, layer kinds and window, target
layer count and hidden size agree with the config and the target (one ConfigError or SpecError line per disagreement).
Its other shapes (heads, MLP width) and its RoPE are taken from it, unless the config sets them otherwise.

Architectures: a DFlash drafter starts a DFlash or a DFlash2 run. Into DFlash2, its tensors are the DFlash2 drafter's
backbone and the DFlash2 modules keep their own initialisation: the convolutions start as the identity, so the first
forward is the DFlash drafter's, and the selector starts from its codebooks' initialisation. A DFlash2 drafter starts
only a DFlash2 run with its own DFlash2 settings (taps, groups, rank, top-K, scales: one ConfigError line per
disagreement).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from blockdraft.config import DFlashConfig, StoreConfig, TargetConfig, TrainConfig, accumulation_steps
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead, TargetModel, load_target
from blockdraft.model.block_sparse import resolve_attention
from blockdraft.model.formats import CONFIG_NAME, WEIGHTS_NAME, open_drafter_artifact, plain_drafter_folder
from blockdraft.model.spec import TargetShape
from blockdraft.model.target import load_target_config, load_target_head, target_dtype
from blockdraft.model.weight_init import init_drafter
from blockdraft.reporter import Reporter
from blockdraft.stages.train.checkpoint import Checkpoints, RunIdentity, checkpoint_config, pinned_dflash
from blockdraft.stages.train.data import RowOrder, TrainRows, steps_per_epoch
from blockdraft.stages.train.engine_features import EngineFeatures, EngineTarget
from blockdraft.stages.train.loss import Objective
from blockdraft.stages.train.memory import apply_memory_options
from blockdraft.stages.train.ranks import RankPlacement
from blockdraft.stages.train.step import DraftForward
from blockdraft.store import Store, open_store


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class WarmupCosine:
    """The LR multiplier of step `step`: `warmup_cosine`, or from `restart_at` on a cosine from 1 to 0 at `total`.
    Its attributes are its plan: `torch.optim.lr_scheduler.LambdaLR` saves and loads them with its state."""

    def __init__(self, warmup: int, total: int, restart_at: int | None = None) -> None:
        self.warmup, self.total, self.restart_at = warmup, total, restart_at

    def __call__(self, step: int) -> float:
        if self.restart_at is not None and step >= self.restart_at:
            return 0.5 * (1.0 + math.cos(math.pi * (step - self.restart_at) / max(1, self.total - self.restart_at)))
        return warmup_cosine(step, self.warmup, self.total)


def planned_steps(tc: TrainConfig, per_epoch: int) -> int:
    """train.max_steps when set (train.epochs is then not used), else train.epochs x the steps of one epoch."""
    return tc.max_steps or tc.epochs * per_epoch


def describe_limit(tc: TrainConfig, per_epoch: int, rows: int) -> str:
    """One line saying which limit sets the run's length, and what it is in the other unit."""
    total = planned_steps(tc, per_epoch)
    if tc.max_steps:
        return (f"schedule: {total:,} steps from train.max_steps ({total / per_epoch:.1f} epochs of {rows:,} rows; "
                f"train.epochs = {tc.epochs} is not used while train.max_steps is set)")
    return (f"schedule: {total:,} steps = train.epochs {tc.epochs} x {per_epoch:,} steps per epoch ({rows:,} rows; "
            "train.max_steps unset)")


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, planned: dict[str, Any], step: int,
                    force: bool) -> str | None:
    """After a checkpoint's scheduler state was loaded into `scheduler` (its plan now the recorded one), compare it with
    `planned` (this config's, `vars` of its `WarmupCosine` before the load). The same length and warmup, or a restarted
    cosine to the same total, go on as recorded; another plan raises ConfigError unless `force`, which restarts a cosine
    at `step` to the new total. Returns the line to say about a restart, else None."""
    fn = scheduler.lr_lambdas[0]
    assert isinstance(fn, WarmupCosine)
    recorded = dict(vars(fn))
    total, warmup = planned["total"], planned["warmup"]
    if recorded["total"] == total and (recorded["warmup"] == warmup or recorded["restart_at"] is not None):
        return None
    base = scheduler.base_lrs[0]
    if not force:
        raise ConfigError(
            f"the learning-rate schedule changed since the checkpoint of step {step}: it was planned for "
            f"{recorded['total']:,} steps ({recorded['warmup']:,} of warmup), this config plans {total:,} "
            f"({warmup:,}); resuming would move the learning rate from {base * fn(step):.3g} to "
            f"{base * WarmupCosine(warmup, total)(step):.3g} at once. Restore train.max_steps / train.epochs / "
            f"train.warmup_ratio, or rerun with --force to continue with a new cosine from step {step} to {total:,}"
        )
    if step >= total:
        raise ConfigError(f"the checkpoint of step {step} is past this config's {total:,} steps; raise train.max_steps "
                          "or train.epochs")
    fn.warmup, fn.total, fn.restart_at = warmup, total, step
    lrs = [b * fn(step) for b in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reads: the learning rate of step `step`
    return (f"--force: a new cosine from step {step} (learning rate {lrs[0]:.3g}) to 0 at step {total:,} replaces the "
            f"schedule planned for {recorded['total']:,} steps")


def new_scheduler(
    optimizer: torch.optim.Optimizer, tc: TrainConfig, per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's LambdaLR over `optimizer`: warmup over train.warmup_ratio of the planned steps, then cosine."""
    total = planned_steps(tc, per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(round(tc.warmup_ratio * total), total))


# (spec field, what the config calls it): must equal what this run derives from the config and the target.
_PINNED = (
    ("num_layers", "dflash.num_draft_layers"),
    ("mask_token_id", "dflash.mask_token_id"),
    ("target_layer_ids", "dflash.target_layer_ids"),
    ("block_size", "dflash.block_size"),
    ("layer_types", "dflash.layer_types"),
    ("sliding_window", "dflash.sliding_window"),
    ("num_target_layers", "the target's layer count"),
    ("hidden_size", "the target's hidden_size"),
)
# Shapes the config may leave unset (None: take the drafter's); set, they must agree.
_OPTIONAL = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def load_init_drafter(init_from: str, store_config: StoreConfig | None) -> DFlashDrafter:
    """The drafter at `init_from` in fp32: a plain local export-format folder (config.json + model.safetensors, e.g. a
    downloaded published drafter), else a verified drafter artifact at that folder or store URL."""
    if (plain := plain_drafter_folder(init_from)) is not None:
        return DFlashDrafter.from_pretrained(plain).float()
    artifact = open_drafter_artifact(open_store(init_from, store_config))
    with tempfile.TemporaryDirectory(prefix="blockdraft-init-") as tmp:
        return DFlashDrafter.from_pretrained(artifact.fetch([CONFIG_NAME, WEIGHTS_NAME], Path(tmp))).float()


def check_init_spec(init: DrafterSpec, derived: DrafterSpec, dflash: DFlashConfig, hf_target_config: Any,
                    source: str) -> DrafterSpec:
    """The spec to train with: `init`'s, with this run's gamma, after checking it against `derived` (what the config and
    the target give) and the target itself. Raises ConfigError naming the first field that disagrees."""
    for name, where in _PINNED:
        ours, theirs = getattr(derived, name), getattr(init, name)
        if ours != theirs:
            raise ConfigError(
                f"train.init_from {source} has {name} {theirs} but {where} gives {ours}; set it to the drafter's value "
                "or start from another drafter"
            )
    for name in _OPTIONAL:
        ours = getattr(dflash, name)
        if ours is not None and ours != getattr(init, name):
            raise ConfigError(
                f"train.init_from {source} has {name} {getattr(init, name)} but dflash.{name} is {ours}; unset it or "
                "set it to the drafter's value"
            )
    if init.dflash2 is not None and derived.dflash2 is None:
        raise ConfigError(
            f"train.init_from {source} is a DFlash2 drafter but dflash.architecture is 'dflash'; set "
            'dflash.architecture = "dflash2" or start from a DFlash drafter'
        )
    if init.dflash2 is not None and derived.dflash2 is not None:
        for name in (f.name for f in dataclasses.fields(init.dflash2)):
            ours, theirs = getattr(derived.dflash2, name), getattr(init.dflash2, name)
            if ours != theirs:
                raise ConfigError(
                    f"train.init_from {source} has {name} {theirs} but dflash.{name} is {ours}; set it to the "
                    "drafter's value or start from another drafter"
                )
    init.check_target(hf_target_config)
    return dataclasses.replace(init, gamma=derived.gamma, dflash2=derived.dflash2)


def load_init_weights(drafter: DFlashDrafter, init: DFlashDrafter) -> None:
    """Copy `init`'s tensors into `drafter` (built from `check_init_spec`'s spec): all of them for the same
    architecture; from a DFlash drafter into a DFlash2 one, every tensor but the convolutions' and the selector's, which
    stay as `drafter` initialised them. Strict otherwise: a missing or extra tensor raises."""
    missing, unexpected = drafter.load_state_dict(init.state_dict(),
                                                  strict=init.spec.architecture == drafter.spec.architecture)
    own = [name for name in missing if not _dflash2_only(name)]
    if own or unexpected:
        raise ConfigError(f"train.init_from: the drafter's tensors do not fit this run's drafter (missing {own[:3]}, "
                          f"unexpected {unexpected[:3]})")


def _dflash2_only(name: str) -> bool:
    """Whether a tensor is one of DFlash2's modules (a DFlash drafter has none)."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


@dataclass
class TrainingSetup:
    """One rank's run, ready for its first step. `model` is what the step calls (the drafter's forward, DDP-wrapped with
    several ranks); `drafter` the module itself; `head` the target's embedding and LM head on the drafter's device;
    `per_epoch` optimizer steps per epoch; `total_steps` the run's; `gamma` the loss decay the batches are built
    with."""

    attention: Literal["dense", "flex"]
    spec: DrafterSpec
    gamma: float
    target: TargetModel | EngineTarget
    head: TargetHead
    checkpoints: Checkpoints
    drafter: DFlashDrafter
    objective: Objective
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    per_epoch: int
    order: RowOrder
    total_steps: int


def build_training(
    tc: TrainConfig, dflash: DFlashConfig, target: TargetConfig, store: StoreConfig, place: RankPlacement,
    rows: TrainRows, out_store: Store, reporter: Reporter, *, recorded: dict[str, Any], start_over: bool = False,
    engine: EngineFeatures | None = None,
) -> TrainingSetup:
    """Build one rank's run from the sections it reads: `tc` ([train], train.output set to where its checkpoints go,
    `out_store`), `dflash`, `target`, and `store` for train.init_from. `rows`: the verified training rows; `recorded`:
    the whole config resolved (`BlockdraftConfig.resolved`), which every checkpoint records with the sections this run
    resolves further in their place (`checkpoint_config`); `start_over` (`train --force`) for its checkpoints;
    `engine`: the target's features from a feature server (train.target_engine = "vllm"), whose weights then never
    load here but for the embedding and LM head."""
    attention = resolve_attention(tc.attention, place.drafter_device)  # fails before the target loads
    assert target.path is not None  # the stage checked it (load_target_config) before any data moved
    hf_target = None if engine is not None else load_target(target.path, place.target_devices, target.dtype,
                                                            reporter=reporter)
    hf_config = hf_target.config if hf_target is not None else load_target_config(target.path)
    dtype = (str(hf_target.dtype).removeprefix("torch.") if hf_target is not None
             else target_dtype(target.dtype, hf_config))
    spec = DrafterSpec.from_target_config(hf_config, dflash)
    init = load_init_drafter(tc.init_from, store) if tc.init_from else None
    if init is not None:  # train.init_from: its weights and shapes, checked against what this run derives
        spec = check_init_spec(init.spec, spec, dflash, hf_config, str(tc.init_from))
    assert spec.gamma is not None  # from_target_config resolves dflash.gamma or its default
    pinned = pinned_dflash(dflash, spec)
    ran_as = target.model_copy(update={"dtype": dtype})  # target.dtype resolved
    identity = RunIdentity.of(tc, pinned, target.path, rows.lineage.sha256)
    keep_every = tc.keep_checkpoint_every * tc.checkpoint_every if tc.keep_checkpoint_every else None
    checkpoints = Checkpoints(
        out_store, checkpoint_config(recorded, pinned, ran_as, rows.tokenize_run), identity.record(), rows.lineage,
        tc.keep_checkpoints, keep_every, reporter, tc.max_checkpoint_failures, start_over, eval_data=rows.eval_lineage,
    )

    # the drafter's initial weights (when not train.init_from's; DFlash2's modules from DFlash)
    torch.manual_seed(tc.seed)
    drafter = DFlashDrafter(spec)
    if init is not None:
        load_init_weights(drafter, init)
    else:
        init_drafter(drafter, tc.init, hf_config)  # train.init: PyTorch's defaults or HF's normal(0, range)
    drafter.to(place.drafter_device)
    model: nn.Module = DraftForward(drafter)
    if place.world_size > 1:
        device_ids = [place.drafter_device] if place.drafter_device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    apply_memory_options(drafter, model, tc)  # activation checkpointing, bf16 gradient all-reduce
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    accumulation = accumulation_steps(tc.global_batch_size, tc.batch_size, place.world_size)
    per_epoch = steps_per_epoch(len(rows), tc.global_batch_size)
    order = RowOrder(len(rows), tc.seed, tc.global_batch_size, tc.batch_size * accumulation)
    return TrainingSetup(
        attention=attention,
        spec=spec,
        gamma=spec.gamma,
        target=(TargetModel(hf_target, spec.target_layer_ids) if hf_target is not None
                else EngineTarget(cast(EngineFeatures, engine), TargetShape.from_config(hf_config))),
        head=(TargetHead.from_target(hf_target, place.drafter_device) if hf_target is not None
              else load_target_head(target.path, getattr(torch, dtype), place.drafter_device)),
        checkpoints=checkpoints,
        drafter=drafter,
        objective=Objective.of(dflash, tc),  # the loss: weighting (D-PACE or gamma's decay) and distillation
        model=model,
        optimizer=optimizer,
        scheduler=new_scheduler(optimizer, tc, per_epoch),
        per_epoch=per_epoch,
        order=order,
        total_steps=planned_steps(tc, per_epoch),
    )


__all__ = [
    "TrainingSetup", "WarmupCosine", "build_training", "check_init_spec", "describe_limit", "load_init_drafter",
    "load_init_weights", "new_scheduler", "planned_steps", "resume_schedule", "warmup_cosine",
]
