"""The train stage: a verified tokenized artifact in, verified checkpoints out, resumed from the newest that verifies.

`run` trains on this process's rank: the only one, or one of the torchrun ranks that `blockdraft.stages.train.launch`
starts (see `placement` for how a rank finds its devices).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from blockdraft.config import BlockdraftConfig
from blockdraft.data.formats import TOKENIZED_KIND
from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter, TargetHead
from blockdraft.model.spec import DrafterSpec
from blockdraft.model.target import load_target_config, target_dtype
from blockdraft.reporter import Reporter
from blockdraft.stages import StageResult
from blockdraft.stages.train.data import check_eval_data, check_mask_in_rows, load_train_rows
from blockdraft.stages.train.engine_features import feature_server
from blockdraft.stages.train.metrics import check_log_dir
from blockdraft.stages.train.ranks import (
    RankPlacement,
    barrier,
    check_same_config,
    check_same_data,
    rank_session,
    resolve_placement,
)
from blockdraft.stages.train.setup import build_training
from blockdraft.stages.train.trainer import Trainer
from blockdraft.store import open_store
from blockdraft.store.artifact import VerifyReport
from blockdraft.store.inputs import open_input
from blockdraft.store.lease import writer_lease
from blockdraft.store.output import refuse_nested
from blockdraft.store.preflight import preflight

STAGE = "train"


@dataclass
class TrainResult:
    """steps: optimizer steps done in total; resumed_from: the step this run started from (None: from scratch);
    checkpoint_url: the final checkpoint; metrics: the last `Trainer.RECENT_METRICS` steps of this run (all ranks; the
    whole log is train.log_dir/metrics.jsonl); drafter: the trained module; head: the frozen drafter-side embedding and
    LM head; steps_run: the steps this run did (0: the checkpoint already held them all); signal: the held-out, decoded
    and target-agreement figures and warnings (`TrainingSignal.counts`), and `summary` the line that says them."""

    steps: int
    resumed_from: int | None
    checkpoint_url: str
    metrics: list[dict[str, Any]]
    drafter: DFlashDrafter
    head: TargetHead
    steps_run: int
    signal: dict[str, Any]
    summary: str


def run(
    config: BlockdraftConfig, input: str | None = None, output: str | None = None, reporter: Reporter | None = None, *,
    force: bool = False,
) -> StageResult:
    """Train a drafter per `config` on `input` (default train.data) into `output` (default train.output, else
    `<store.url>/train`); returns after the final checkpoint verified at the destination, on every rank.

    Resumes from the newest checkpoint that verifies; when checkpoints are there but none verifies, raises ArtifactError
    naming them rather than overwrite them from step 0, unless `force`, which starts over.

    `details` is a TrainResult; `already_done` when the final checkpoint of this run was already there, verified.
    """
    started = time.perf_counter()
    config = _with_paths(config, input, output)
    place = resolve_placement(config.placement)
    reporter = (reporter or Reporter()).for_rank(place.rank)
    with rank_session(place, config.train.deterministic, config.train.dist_timeout_minutes), ExitStack() as held:
        trainer = _prepare(config, place, reporter, held, force)
        # Already done when the final checkpoint of this run is there and verifies, as its StageOutput says (rank 0
        # asks).
        done = place.is_main and trainer.setup.checkpoints.has_checkpoint(trainer.setup.total_steps)
        trainer.train()
        final, done = _final_report(trainer, place, done)
    result = TrainResult(
        trainer.setup.total_steps, trainer.resumed_from, final.url, list(trainer.metrics), trainer.setup.drafter,
        trainer.setup.head, trainer.steps_run, trainer.signal.counts(), trainer.signal.summary(),
    )
    return StageResult(STAGE, final.url, final, already_done=done, seconds=time.perf_counter() - started,
                       details=result)


def _with_paths(config: BlockdraftConfig, input: str | None, output: str | None) -> BlockdraftConfig:
    """`config` with train.data and train.output set to what this run reads and writes (pinned into every
    checkpoint)."""
    data = input or config.train.data
    if data is None:
        raise ConfigError("train.data is not set; set it to a tokenized artifact (a folder, file:// or s3:// URL)")
    out = output or config.train.output or config.store.url.rstrip("/") + "/train"
    return config.model_copy(update={"train": config.train.model_copy(update={"data": data, "output": out})})


def _prepare(config: BlockdraftConfig, place: RankPlacement, reporter: Reporter, held: ExitStack,
             force: bool = False) -> Trainer:
    """Check what fails fast (every rank runs rank 0's config on rank 0's data, the target's config, a writable output
    store that no other run writes, a log folder apart from them, verified inputs: train.data, and train.eval_data when
    set, tokenized as train.data was; a mask id train.data's rows never hold), open the rows, build the trainer (which
    claims the log folder for this run). Rank 0 takes the output's lease (one run per train.output: another run's
    checkpoints never interleave with this one's, and a resume never picks another run's step) and `held` gives it back
    when training ends. Of the processes on one machine only local rank 0 pulls a remote input."""
    tc = config.train
    assert tc.data is not None and tc.output is not None  # set by _with_paths
    check_same_config(config, place)  # every node runs rank 0's settings, or none trains
    target_config = load_target_config(config.target.path)  # a missing target fails in seconds, before any data moves
    out_store = open_store(tc.output, config.store)
    inputs = {"train.data": open_store(tc.data, config.store)}
    if tc.eval_data is not None:  # the held-out rows' own artifact: read like train.data, never written
        inputs["train.eval_data"] = open_store(tc.eval_data, config.store)
    for role, store in inputs.items():
        refuse_nested(store, out_store, role)
    log_dir = check_log_dir(tc.log_dir, {**inputs, "train.output": out_store})
    if place.is_main:
        preflight(out_store)  # fail before step 1 when checkpoints cannot be written (docs/STORE.md, credentials)
        held.enter_context(writer_lease(out_store, force=force, reporter=reporter))
    data = open_input(inputs["train.data"], config.store, kinds=[TOKENIZED_KIND], role="train.data")
    eval_data = None
    if "train.eval_data" in inputs:
        eval_data = open_input(inputs["train.eval_data"], config.store, kinds=[TOKENIZED_KIND], role="train.eval_data")
    eval_sha256 = (eval_data.ref.sha256 or "") if eval_data is not None else None
    check_same_data(config, data.ref.sha256 or "", place, eval_sha256)  # and rank 0's data
    if eval_data is not None:  # after the ranks agree on both, so every rank refuses alike
        check_eval_data(data, eval_data)
    check_mask_in_rows(config, target_config, data)  # before a row moves or the target's weights load
    rows = load_train_rows(data, config.store, tc.max_length, log_dir, place.local_rank == 0, lambda: barrier(place),
                           eval_data)
    engine = None
    if tc.target_engine == "vllm":  # the target's features from a vLLM server, running until training ends
        spec = DrafterSpec.from_target_config(target_config, config.dflash)
        engine = held.enter_context(feature_server(
            tc, config.target, config.eval, spec.target_layer_ids, spec.hidden_size,
            target_dtype(config.target.dtype, target_config), log_dir, reporter))
    # The one place training's sections are handed out; the whole config goes on only as what checkpoints record.
    setup = build_training(tc, config.dflash, config.target, config.store, place, rows, out_store, reporter,
                           recorded=config.resolved(), start_over=force, engine=engine)
    return Trainer(tc, config.dflash, config.target, config.eval, place, rows, setup, reporter, start_over=force)


def _final_report(trainer: Trainer, place: RankPlacement, done: bool) -> tuple[VerifyReport, bool]:
    """The final checkpoint's verify report and whether it was already done, on every rank: rank 0 wrote (or resumed
    from) it; the others receive both."""
    shared: list[Any] = [trainer.last_checkpoint, done]
    if place.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    assert shared[0] is not None, "the final checkpoint raises when it does not verify"
    return shared[0], shared[1]


__all__ = ["STAGE", "TrainResult", "run"]
