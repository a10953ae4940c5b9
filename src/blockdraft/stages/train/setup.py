"""What one rank's training run is made of, built before its first step: the frozen target on its device, the drafter
(its spec derived from the target, its first weights from train.init_from or train.init) wrapped for DDP with the memory
options applied, the objective, the optimizer and its schedule, the order of the rows, and the run's checkpoints (its
resolved config and run identity). `Trainer` runs the loop over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from blockdraft.config import BlockdraftConfig, accumulation_steps
from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead, TargetModel, load_target
from blockdraft.model.block_sparse import resolve_attention
from blockdraft.model.weight_init import init_drafter
from blockdraft.reporter import Reporter
from blockdraft.stages.train.checkpoint import Checkpoints, resolved_training_config, run_identity
from blockdraft.stages.train.data import RowOrder, TrainRows, steps_per_epoch
from blockdraft.stages.train.init_from import check_init_spec, load_init_drafter, load_init_weights
from blockdraft.stages.train.loss import Objective
from blockdraft.stages.train.memory import apply_memory_options
from blockdraft.stages.train.placement import RankPlacement
from blockdraft.stages.train.schedule import new_scheduler, planned_steps
from blockdraft.stages.train.step import DraftForward
from blockdraft.store import Store


@dataclass
class TrainingSetup:
    """One rank's run, ready for its first step. `model` is what the step calls (the drafter's forward, DDP-wrapped with
    several ranks); `drafter` the module itself; `head` the target's embedding and LM head on the drafter's device;
    `per_epoch` optimizer steps per epoch; `total_steps` the run's; `gamma` the loss decay the batches are built with."""

    attention: Literal["dense", "flex"]
    spec: DrafterSpec
    gamma: float
    target: TargetModel
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
    config: BlockdraftConfig, place: RankPlacement, rows: TrainRows, out_store: Store, output_url: str, reporter: Reporter,
    start_over: bool = False,
) -> TrainingSetup:
    """Build one rank's run: `out_store`/`output_url` where its checkpoints go, `rows` the verified training rows,
    `start_over` (`train --force`) for its checkpoints."""
    tc = config.train
    attention = resolve_attention(tc.attention, place.drafter_device)  # fails before the target loads
    assert config.target.path is not None  # the stage checked it (load_target_config) before any data moved
    hf_target = load_target(config.target.path, place.target_device, config.target.dtype, reporter=reporter)
    spec = DrafterSpec.from_target_config(hf_target.config, config.dflash)
    init = load_init_drafter(tc.init_from, config.store) if tc.init_from else None
    if init is not None:  # train.init_from: its weights and shapes, checked against what this run derives
        spec = check_init_spec(init.spec, spec, config.dflash, hf_target.config, str(tc.init_from))
    assert spec.gamma is not None  # from_target_config resolves dflash.gamma or its default
    resolved = resolved_training_config(config, spec, output_url, rows.tokenize_run)
    resolved["target"]["dtype"] = str(hf_target.dtype).removeprefix("torch.")  # what target.dtype resolved to
    identity = run_identity(resolved, rows.lineage.sha256)
    keep_every = tc.keep_checkpoint_every * tc.checkpoint_every if tc.keep_checkpoint_every else None
    checkpoints = Checkpoints(out_store, resolved, identity, rows.lineage, tc.keep_checkpoints, keep_every, reporter,
                              tc.max_checkpoint_failures, start_over, eval_data=rows.eval_lineage)

    torch.manual_seed(tc.seed)  # the drafter's initial weights (when not train.init_from's; DFlash2's modules from DFlash)
    drafter = DFlashDrafter(spec)
    if init is not None:
        load_init_weights(drafter, init)
    else:
        init_drafter(drafter, tc.init, hf_target.config)  # train.init: PyTorch's defaults or HF's normal(0, range)
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
        target=TargetModel(hf_target, spec.target_layer_ids),
        head=TargetHead.from_target(hf_target, place.drafter_device),
        checkpoints=checkpoints,
        drafter=drafter,
        objective=Objective.of(config.dflash, tc),  # the loss: weighting (D-PACE or gamma's decay) and distillation
        model=model,
        optimizer=optimizer,
        scheduler=new_scheduler(optimizer, tc, per_epoch),
        per_epoch=per_epoch,
        order=order,
        total_steps=planned_steps(tc, per_epoch),
    )


__all__ = ["TrainingSetup", "build_training"]
