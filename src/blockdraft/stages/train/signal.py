"""Whether training's figures can be believed (docs/TRAINING-SIGNAL.md): the latest training, held-out and decoded tau
of a run, the warnings when they disagree, and what a checkpoint records of them.

Each warning is one line, said once per run; every checkpoint after it records it (its `signal_warnings` count, which
`status --progress` shows in PROGRESS.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

# Held-out tau estimate below this share of the training one: the drafter learned its training rows, not the task.
# Measured on the tiny target's own answers (docs/TRAINING-SIGNAL.md): the full demo (297 rows, 12 epochs, held-out still
# rising) reads 0.72; 48 rows for 33 epochs (held-out flat from the 20th) 0.42.
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
                f"held-out tau estimate {held_out['tau_estimate']:.2f} is far below the training one {train:.2f} at step {step} "
                f"(under {OVERFIT_RATIO:.0%} of it): the drafter learns its {self.rows:,} training rows ({epochs:.1f} epochs so far), "
                "not to draft; train on more rows (`blockdraft generate` more prompts with the target) or fewer epochs"
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
                f"checkpoint of step {step} decoded for real gives tau {decoded['tau']:.2f}, far below its teacher-forced {which} "
                f"estimate {estimate:.2f} (under {DECODED_RATIO:.0%} of it): the estimate does not carry over to decoding; check "
                "that the data is the target's own output (target agreement) in the thinking mode it serves with"
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
            parts.append(f"decoded {self.decoded['tau']:.2f} ({self.decoded['speedup']:.2f}x on {self.decoded['prompts']} prompts{lossless})")
        else:
            parts.append("decoded -")
        return ", ".join(parts)


__all__ = ["DECODED_RATIO", "MIN_TRAIN_TAU", "OVERFIT_RATIO", "TrainingSignal"]
