"""Held-out figures during training (docs/TRAINING-SIGNAL.md): the drafter's loss, per-slot accuracies and tau estimate
on a fixed, seeded sample of the held-out rows (train.data's held-out split, or every row of train.eval_data when it is
set), measured as the training figures are (the same batches, target features and loss) but without gradients, so the
two curves are comparable and two evaluations see the same blocks.

Training figures are measured on the rows the drafter trains on; on a few rows seen for many epochs they say how well it
learned those rows, not how it will draft. The held-out figure is the one to read.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch
from datasets import Dataset

from blockdraft.stages.train.batch import anchor_generator, build_block_batch, teacher_forced_tau
from blockdraft.stages.train.loss import Teacher, block_loss
from blockdraft.stages.train.placement import RankPlacement
from blockdraft.stages.train.setup import TrainingSetup

# The anchors' "epoch" of held-out rows: one fixed draw per row, never one of a training epoch's.
HELD_OUT_EPOCH = 2**20


class HeldOut:
    """A fixed sample of held-out rows (`rows`: (input_ids, loss_mask) pairs, `indices`: where they are in the split)
    whose blocks are drawn once per evaluation from the same seeds; `measure` gives the figures of the drafter as it is."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int], seed: int, batch_size: int) -> None:
        self.rows, self.indices, self.seed, self.batch_size = rows, indices, seed, batch_size

    @classmethod
    def sample(cls, dataset: Dataset | None, count: int, seed: int, max_length: int, batch_size: int) -> HeldOut | None:
        """`count` rows of the held-out rows `dataset`, drawn with `seed` (all of them when it holds fewer), clipped to
        `max_length`; None when there are none."""
        if dataset is None or len(dataset) == 0:
            return None
        g = torch.Generator().manual_seed(seed)
        indices = sorted(torch.randperm(len(dataset), generator=g)[:count].tolist())
        rows = []
        for i in indices:
            r = dataset[i]
            ids = torch.as_tensor(r["input_ids"][:max_length], dtype=torch.long)
            rows.append((ids, torch.as_tensor(r["loss_mask"][:max_length], dtype=torch.long)))
        return cls(rows, indices, seed, batch_size)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def measure(self, setup: TrainingSetup, place: RankPlacement, num_anchors: int, chunk_blocks: int) -> dict[str, Any]:
        """{"loss", "slot_accuracy", "tau_estimate", "rows", "seconds"} of the drafter now, on this rank alone (it
        reduces nothing across ranks): the weighted loss of the run's objective, each slot's share of argmax hits."""
        began = time.perf_counter()
        nslots = setup.spec.block_size - 1
        weighted, normaliser = 0.0, 0.0
        correct, counted, leading = torch.zeros(nslots), torch.zeros(nslots), torch.zeros(nslots)
        device = place.drafter_device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        for first in range(0, len(self.rows), self.batch_size):
            chosen = list(range(first, min(first + self.batch_size, len(self.rows))))
            batch = build_block_batch(
                [self.rows[i] for i in chosen], num_anchors=num_anchors, block_size=setup.spec.block_size,
                mask_token_id=setup.spec.mask_token_id, gamma=setup.gamma,
                generators=[anchor_generator(self.seed, HELD_OUT_EPOCH, self.indices[i]) for i in chosen], attention=setup.attention,
            )
            ids, mask = batch.input_ids.to(place.target_device), batch.attention_mask_context.long().to(place.target_device)
            teacher = None
            if setup.objective.distills:
                features, final = setup.target.features_and_final(ids, mask)
                teacher = Teacher.for_blocks(final.to(device), batch.block_positions.to(device))
            else:
                features = setup.target.features(ids, mask)
            moved = batch.to(device)
            norm = setup.objective.normaliser(moved.weights)  # this batch's own denominator: nothing is all-reduced
            with autocast:
                context = setup.drafter.project_context(features.to(device).float())
                hidden = setup.drafter(setup.head.embed(moved.block_ids).float(), context, moved.block_positions,
                                       moved.context_positions, moved.drafter_attention)
                out = block_loss(hidden, moved.labels, moved.weights, setup.head.lm_head_weight, setup.head.lm_head_bias,
                                 setup.spec.block_size, chunk_blocks, norm, objective=setup.objective, teacher=teacher,
                                 walk_scores=selector.scores if (selector := setup.drafter.candidate_selector) is not None else None)
            weighted += float(out.weighted_ce)
            normaliser += float(norm)
            correct += out.slots.correct.cpu()
            counted += out.slots.total.cpu()
            leading += out.slots.leading.cpu()
        accuracy = (correct / counted.clamp_min(1)).tolist()
        return {
            "loss": weighted / max(normaliser, 1e-12),
            "slot_accuracy": accuracy,
            "tau_estimate": teacher_forced_tau(leading.tolist(), float(counted[0])),
            "rows": len(self.rows),
            "seconds": time.perf_counter() - began,
        }


__all__ = ["HELD_OUT_EPOCH", "HeldOut"]
