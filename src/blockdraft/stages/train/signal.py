"""Whether training's figures can be believed: held-out figures, checkpoints decoded for real, and the warnings when
they disagree.

Whether training's figures can be believed (docs/TRAINING-SIGNAL.md): the latest training, held-out and decoded tau
of a run, the warnings when they disagree, and what a checkpoint records of them.

Each warning is one line, said once per run; every checkpoint after it records it (its `signal_warnings` count, which
`status --progress` shows in PROGRESS.md).

Held-out figures during training (docs/TRAINING-SIGNAL.md): the drafter's loss, per-slot accuracies and tau estimate
on a fixed, seeded sample of the held-out rows (train.data's held-out split, or every row of train.eval_data when it is
set), measured as the training figures are (the same batches, target features and loss) but without gradients, so the
two curves are comparable and two evaluations see the same blocks.

Training figures are measured on the rows the drafter trains on; on a few rows seen for many epochs they say how well it
learned those rows, not how it will draft. The held-out figure is the one to read.

A checkpoint decoded for real during training (train.decode_eval_prompts, docs/TRAINING-SIGNAL.md): the checkpoint's
weights draft for the target on a few held-out prompts with the loop eval runs (`blockdraft.decode.speculative`), each
output checked token for token against target-only greedy decoding, and tau and speedup measured as eval measures them.

Prompts are the held-out rows' ids before their first supervised token, in their order (train.data's held-out split, as
eval takes them; with train.eval_data, that artifact's train split and then its held-out split); each is decoded up to
eval.max_new_tokens, stopping at the target's end-of-sequence ids.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from blockdraft.config import EvalConfig
from blockdraft.decode.speculative import DFlashProposer, greedy_decode, run_speculative
from blockdraft.model import DFlashDrafter, TargetHead
from blockdraft.stages.train.data import anchor_generator, build_block_batch
from blockdraft.stages.train.loss import Teacher, block_loss
from blockdraft.stages.train.metrics import Figures, add_sums
from blockdraft.stages.train.ranks import RankPlacement
from blockdraft.stages.train.setup import TrainingSetup

# Held-out tau estimate below this share of the training one: the drafter learned its training rows, not the task.
# Measured on the tiny target's own answers (docs/TRAINING-SIGNAL.md): the full demo (297 rows, 12 epochs, held-out
# still rising) reads 0.72; 48 rows for 33 epochs (held-out flat from the 20th) 0.42.
OVERFIT_RATIO = 0.6
# Decoded tau below this share of the held-out tau estimate (the training one without held-out rows): the teacher-forced
# figure does not carry over to real decoding.
DECODED_RATIO = 0.6
# Neither is judged before the training estimate reaches this (a drafter that learned nothing yet has nothing to lose).
MIN_TRAIN_TAU = 1.5
TRAIN_WINDOW = 20  # training tau is the mean over this many recent steps (one step's batch is noisy)


class TrainingSignal:
    """The run's latest figures: `train_tau` (mean of the recent steps), `held_out` (the last held-out measurement),
    `decoded` (the last checkpoint decoded for real), `agreement` (target agreement of the data, when measured).
    `warn` hears each disagreement once; `warnings` names those said."""

    def __init__(self, warn: Callable[[str], None], rows: int, per_epoch: int) -> None:
        self.warn, self.rows, self.per_epoch = warn, rows, per_epoch
        self._recent: deque[float] = deque(maxlen=TRAIN_WINDOW)
        self.held_out: dict[str, Any] | None = None
        self.decoded: dict[str, Any] | None = None
        self.agreement: dict[str, Any] | None = None
        self.warnings: list[str] = []

    @property
    def train_tau(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None

    def trained(self, entry: dict[str, Any]) -> None:
        self._recent.append(float(entry["tau_estimate"]))

    def measured(self, held_out: dict[str, Any], step: int) -> None:
        """A held-out measurement after `step` steps; warns once when it is far below the training estimate."""
        self.held_out = held_out
        train = self.train_tau
        if train is None or train < MIN_TRAIN_TAU or "overfitting" in self.warnings:
            return
        if held_out["tau_estimate"] < OVERFIT_RATIO * train:
            self.warnings.append("overfitting")
            epochs = step / self.per_epoch
            self.warn(
                f"held-out tau estimate {held_out['tau_estimate']:.2f} is far below the training one {train:.2f} at "
                f"step {step} (under {OVERFIT_RATIO:.0%} of it): the drafter learns its {self.rows:,} training rows "
                f"({epochs:.1f} epochs so far), not to draft; train on more rows (`blockdraft generate` more prompts "
                "with the target) or fewer epochs"
            )

    def decoded_at(self, decoded: dict[str, Any], step: int) -> None:
        """A checkpoint decoded for real; warns once when its tau is far below the teacher-forced estimate."""
        self.decoded = decoded
        estimate = self.held_out["tau_estimate"] if self.held_out else self.train_tau
        which = "held-out" if self.held_out else "training"
        if estimate is None or estimate < MIN_TRAIN_TAU or "decoded" in self.warnings:
            return
        if decoded["tau"] < DECODED_RATIO * estimate:
            self.warnings.append("decoded")
            self.warn(
                f"checkpoint of step {step} decoded for real gives tau {decoded['tau']:.2f}, far below its "
                f"teacher-forced {which} estimate {estimate:.2f} (under {DECODED_RATIO:.0%} of it): the estimate does "
                "not carry over to decoding; check that the data is the target's own output (target agreement) in the "
                "thinking mode it serves with"
            )

    def counts(self) -> dict[str, Any]:
        """What a checkpoint records of the signal, as flat counts (status shows them)."""
        out: dict[str, Any] = {}
        if self.train_tau is not None:
            out["train_tau"] = round(self.train_tau, 3)
        if self.held_out is not None:
            out["held_out_tau"] = round(self.held_out["tau_estimate"], 3)
            out["held_out_loss"] = round(self.held_out["loss"], 4)
        if self.decoded is not None:
            out["decoded_tau"] = round(self.decoded["tau"], 3)
            out["decoded_speedup"] = round(self.decoded["speedup"], 3)
            out["decoded_lossless"] = self.decoded["lossless"]
        if self.agreement is not None:
            out["target_agreement"] = round(self.agreement["agreement"], 3)
        if self.warnings:
            out["signal_warnings"] = ",".join(self.warnings)
        return out

    def summary(self) -> str:
        """The figures for the final line: held-out and decoded tau beside the training estimate."""
        parts = []
        if self.train_tau is not None:
            parts.append(f"tau estimate {self.train_tau:.2f} (training rows)")
        parts.append(f"held-out {self.held_out['tau_estimate']:.2f}" if self.held_out else "held-out -")
        if self.decoded:
            lossless = "" if self.decoded["lossless"] else ", NOT lossless"
            parts.append(f"decoded {self.decoded['tau']:.2f} ({self.decoded['speedup']:.2f}x on "
                         f"{self.decoded['prompts']} prompts{lossless})")
        else:
            parts.append("decoded -")
        return ", ".join(parts)


# The anchors' "epoch" of held-out rows: one fixed draw per row, never one of a training epoch's.
HELD_OUT_EPOCH = 2**20


class HeldOut:
    """A fixed sample of held-out rows (`rows`: (input_ids, loss_mask) pairs, `indices`: where they are in the split)
    whose blocks are drawn once per evaluation from the same seeds; `measure` gives the figures of the drafter as it
    is."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int], seed: int,
                 batch_size: int) -> None:
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
    def measure(
        self, setup: TrainingSetup, place: RankPlacement, num_anchors: int, chunk_blocks: int
    ) -> dict[str, Any]:
        """The drafter's `Figures` now (`Figures.entry`: loss, per-slot accuracy and loss, tau estimate, ... as training
        measures them), with "rows" and "seconds", on this rank alone (it reduces nothing across ranks)."""
        began = time.perf_counter()
        sums: dict[str, torch.Tensor] | None = None
        normaliser = 0.0
        device = place.drafter_device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        for first in range(0, len(self.rows), self.batch_size):
            chosen = list(range(first, min(first + self.batch_size, len(self.rows))))
            batch = build_block_batch(
                [self.rows[i] for i in chosen], num_anchors=num_anchors, block_size=setup.spec.block_size,
                mask_token_id=setup.spec.mask_token_id, gamma=setup.gamma,
                generators=[anchor_generator(self.seed, HELD_OUT_EPOCH, self.indices[i]) for i in chosen],
                attention=setup.attention,
            )
            ids, mask = (
                batch.input_ids.to(place.target_device),
                batch.attention_mask_context.long().to(place.target_device),
            )
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
                out = block_loss(hidden, moved.labels, moved.weights, setup.head.lm_head_weight,
                                 setup.head.lm_head_bias, setup.spec.block_size, chunk_blocks, norm,
                                 objective=setup.objective, teacher=teacher,
                                 walk_scores=(selector.scores
                                              if (selector := setup.drafter.candidate_selector) is not None else None))
            normaliser += float(norm)
            part = {**out.sums(), "tokens": torch.tensor(float(batch.num_tokens)),
                    "positions": torch.tensor(float(batch.num_positions))}
            sums = add_sums(sums, {name: value.cpu().double() for name, value in part.items()})  # on the host, in fp64
        assert sums is not None, "a held-out sample has at least one row"
        figures = Figures.of_sums(sums, normaliser).entry()
        return {**figures, "rows": len(self.rows), "seconds": time.perf_counter() - began}


def prompts_before_supervision(dataset: Dataset | None, count: int) -> list[list[int]]:
    """Up to `count` prompts of the held-out rows: each row's ids before its first supervised token (a row supervised
    from token 0 has none and is skipped)."""
    prompts: list[list[int]] = []
    for r in dataset if dataset is not None and count else ():
        assert isinstance(r, dict)  # a Dataset's row
        supervised = np.flatnonzero(np.asarray(r["loss_mask"]))
        if supervised.size and supervised[0]:
            prompts.append(list(r["input_ids"][: supervised[0]]))
        if len(prompts) >= count:
            break
    return prompts


@functools.lru_cache(maxsize=4)
def _eos_of_tokenizer(folder: str | None) -> int | None:
    """The eos id of the tokenizer in `folder`, or None when none loads from it."""
    try:
        return AutoTokenizer.from_pretrained(folder).eos_token_id if folder else None
    except (OSError, ValueError):
        return None


def target_stop_ids(hf_model: Any, tokenizer_folder: str | None) -> list[int]:
    """The target's end-of-sequence ids: its generation config's and its tokenizer's, the ids eval stops on."""
    ids: set[int] = set()
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if (tokenizer_eos := _eos_of_tokenizer(tokenizer_folder)) is not None:
        ids.add(tokenizer_eos)
    return sorted(ids)


def _lossless(spec_tokens: list[int], greedy_tokens: list[int], prompt_len: int, margins: list[float],
              tolerance: float) -> bool:
    """Whether the speculative output is the greedy one, or first departs from it at a rounding near-tie (a top-2
    margin within `tolerance` there), as eval's check counts it."""
    if spec_tokens == greedy_tokens:
        return True
    common = min(len(spec_tokens), len(greedy_tokens))
    position = next((i for i in range(common) if spec_tokens[i] != greedy_tokens[i]), common)
    new_index = position - prompt_len
    return 0 <= new_index < len(margins) and margins[new_index] <= tolerance


def decode_checkpoint(
    drafter: DFlashDrafter, hf_model: Any, prompts: list[list[int]], settings: EvalConfig, stops: list[int],
) -> dict[str, Any]:
    """{"tau", "speedup", "lossless", "prompts", "new_tokens", "seconds"} of `drafter`'s current weights, copied in the
    target's dtype (as eval loads a checkpoint), over `prompts`. speedup: greedy wall time / speculative wall time."""
    param = next(hf_model.parameters())
    copy = DFlashDrafter(drafter.spec)
    copy.load_state_dict(drafter.state_dict())
    device = next(drafter.parameters()).device
    copy = copy.to(device=device, dtype=param.dtype).eval()
    head = TargetHead.from_target(hf_model, device=device).to(param.dtype)
    tolerance = settings.divergence_margin_fp32 if param.dtype == torch.float32 else settings.divergence_margin_bf16
    greedy_decode(hf_model, prompts[0], 2)  # one-time costs out of the timings, as eval's warm-up
    run_speculative(hf_model, DFlashProposer(copy, head), prompts[0], 2)
    lengths: list[int] = []
    greedy_s = spec_s = 0.0
    lossless, new_tokens = True, 0
    for prompt in prompts:
        reference = greedy_decode(hf_model, prompt, settings.max_new_tokens, stops)
        result = run_speculative(hf_model, DFlashProposer(copy, head), prompt, settings.max_new_tokens, stops)
        lengths += result.acceptance_lengths
        greedy_s, spec_s = greedy_s + reference.wall_s, spec_s + result.wall_s
        new_tokens += len(result.new_tokens)
        lossless &= _lossless(result.tokens, reference.tokens, reference.prompt_len, reference.margins, tolerance)
    return {
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "speedup": greedy_s / spec_s if spec_s else 0.0,
        "lossless": lossless,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "seconds": greedy_s + spec_s,
    }


__all__ = [
    "DECODED_RATIO", "HELD_OUT_EPOCH", "HeldOut", "MIN_TRAIN_TAU", "OVERFIT_RATIO", "TrainingSignal",
    "decode_checkpoint", "prompts_before_supervision", "target_stop_ids",
]
