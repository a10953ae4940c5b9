"""The trackers people already watch: each logged step's metrics also go to TensorBoard and W&B (`train.report_to`).

Only rank 0 feeds them, the same entries it appends to metrics.jsonl. Both write into `train.log_dir`, the local folder
beside metrics.jsonl that no artifact holds: TensorBoard's event files in it, W&B's run folder under its `wandb/`.
A tracker that cannot start (its package is not installed, W&B has no login) or fails while logging is one warning
line, and training goes on without it: metrics.jsonl stays the record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

INSTALL_HINT = "pip install 'blockdraft[trackers]'"


def tracked_scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics entry that the trackers get, by their name there (slot k's accuracy is
    `train/slot_accuracy/k`, k from 1; the same for every per-slot list; the held-out figures of a step that has them are
    `eval/...` beside them). A DFlash2 run's selector figures come along."""
    names = ("loss", "tau_estimate", "lr", "grad_norm", "tokens_per_s", "step_time_s", *_SELECTOR_SCALARS)
    scalars = {f"train/{name}": float(entry[name]) for name in names if name in entry}
    for listed in ("slot_accuracy", "slot_loss", *_SELECTOR_SLOTS):
        scalars.update({f"train/{listed}/{k}": float(value) for k, value in enumerate(entry.get(listed, ()), start=1)})
    if (held := entry.get("eval")) is not None:  # the held-out figures measured after this step, under eval/
        scalars.update({f"eval/{name}": float(held[name]) for name in ("loss", "tau_estimate")})
        scalars.update({f"eval/slot_accuracy/{k}": float(acc) for k, acc in enumerate(held["slot_accuracy"], start=1)})
    return scalars


_SELECTOR_SCALARS = ("selector_loss", "candidate_recall", "selector_accuracy", "walk_tau_estimate")
_SELECTOR_SLOTS = ("slot_candidate_recall", "slot_selector_accuracy")


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardTracker:
    """Event files in `folder`. `first_step`: the first step this run logs; a reader drops what an earlier run in the
    same folder logged from that step on (a resumed run redoes those steps, a fresh one all of them)."""

    def __init__(self, folder: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=first_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run whose folder is `folder/wandb`, started with `settings` (train.wandb: project, entity, group, name,
    mode) and the run's resolved config. W&B neither prints nor wraps the terminal (the reporter owns it) and records
    no command line."""

    def __init__(self, folder: Path, settings: Mapping[str, str], config: dict[str, Any]) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        arguments: dict[str, Any] = dict(settings)  # wandb.init checks the values (a bad mode fails there: one warning)
        # W&B's run metadata holds the raw command line, which may carry a secret (`--set store.endpoint_url=http://u:pw@h`):
        # it is not collected; `config` (the resolved config, its URLs redacted) says what ran.
        quiet = wandb.Settings(silent=True, console="off", x_disable_meta=True)
        self.run = wandb.init(dir=str(folder), config=config, settings=quiet, **arguments)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a run that raised shows as failed


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Trackers:
    """The trackers `names` (train.report_to) on rank 0, none on the others; `log` feeds each a metrics entry, `close`
    (or leaving the `with` block; `failed` when it raised) ends them. `warn` hears each one that fails, once, and it is
    dropped."""

    def __init__(self, names: Sequence[str], folder: Path, first_step: int, wandb_settings: Mapping[str, str],
                 config: dict[str, Any], warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.active: dict[str, Tracker] = {}
        starts: dict[str, Callable[[], Tracker]] = {
            "tensorboard": lambda: TensorBoardTracker(folder, first_step),
            "wandb": lambda: WandbTracker(folder, wandb_settings, config),
        }
        for name in names:
            try:
                self.active[name] = starts[name]()
            except ImportError as exc:
                warn(f"train.report_to: {name} did not start ({_first_line(exc)}); install it with {INSTALL_HINT}; "
                     "training goes on without it")
            except Exception as exc:  # a tracker never stops training: no login, a bad project, an unwritable folder
                warn(f"train.report_to: {name} did not start ({_first_line(exc)}); training goes on without it")

    def log(self, entry: Mapping[str, Any]) -> None:
        scalars = tracked_scalars(entry) if self.active else {}
        for name, tracker in list(self.active.items()):
            try:
                tracker.log(scalars, int(entry["step"]))
            except Exception as exc:
                self._drop(name, f"failed at step {entry['step']} ({_first_line(exc)})")

    def close(self, failed: bool = False) -> None:
        for name, tracker in list(self.active.items()):
            try:
                tracker.close(failed)
            except Exception as exc:
                self.warn(f"train.report_to: {name} did not close ({_first_line(exc)}); its last steps may be missing there")
        self.active.clear()

    def _drop(self, name: str, why: str) -> None:
        self.active.pop(name, None)
        self.warn(f"train.report_to: {name} {why}; training goes on without it")

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=exc is not None)


__all__ = ["INSTALL_HINT", "TensorBoardTracker", "Tracker", "Trackers", "WandbTracker", "tracked_scalars"]
