"""Where a run's figures go: metrics.jsonl and its curves, TensorBoard and W&B, all in the run's own log folder.

What the loss measures, by name: `Figures`, one record per step (and per held-out measurement), made from the named
sums that `LossOutput.sums` gives (`Figures.of_sums`). Its field names are the keys of a metrics entry (and of its
`eval`), the trackers' names (`train/<name>`, `eval/<name>`) and what the curves read; nothing reads a figure by its
position.

Training metrics: one JSON line per logged step, and a PNG of the loss and the per-slot accuracies.

Nothing here grows with the run: the log is appended to and never held in memory, a checkpoint takes only the entries
since the one before (its window), and the curves are redrawn from the file in a background thread at most every
`plot_every_s` seconds (and once at the end), from a fixed number of bin-averaged points.

The trackers people already watch: each logged step's metrics also go to TensorBoard and W&B (`train.report_to`).

Only rank 0 feeds them, the same entries it appends to metrics.jsonl. Both write into `train.log_dir`, the local folder
beside metrics.jsonl that no artifact holds: TensorBoard's event files in it, W&B's run folder under its `wandb/`.
A tracker that cannot start (its package is not installed, W&B has no login) or fails while logging is one warning
line, and training goes on without it: metrics.jsonl stays the record.

train.log_dir: the local folder of one run's metrics log, curves, trackers' files and pulled-data cache.

It is checked before anything loads, like train.output: it must be a folder this process can write, and lie neither in
the run's input or output nor inside any artifact (its files would change an artifact that verified, or be read as
data). A log folder belongs to one run: the first run to write it records who it is in `blockdraft-log.json` (the
run identity's digest and its train.output), a rerun of that run (a resume, `--force`) continues it, and any other run
is refused with one line naming the run that owns it, so no run replaces another's metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

from blockdraft.errors import ConfigError, safe_url
from blockdraft.stages.train.data import teacher_forced_tau
from blockdraft.store import Store
from blockdraft.store.manifest import MANIFEST_NAME

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "training-curves.png"
PLOT_POINTS = 2000  # a curve has between this many and twice as many points, whatever the log's length


@dataclass(frozen=True)
class Figures:
    """What the loss measured over a step's rows (every micro-batch, every rank) or over the held-out sample.

    `loss`: the whole objective, sum(w * term) / the denominator; per slot 1..B-1 of the unary term: `slot_accuracy`
    (argmax = label) and `slot_loss` (mean CE); `tau_estimate` (`data.teacher_forced_tau`); `tokens`: the real context
    tokens; `supervised`: the supervised slots; `padding_share`: the share of the entries the target's forwards computed
    that were padding (the held-out sample's rows are always padded). Distilling: `distill_kl`, the KL(p_T || q_T) part
    alone, weighted and divided like the loss (0 where the drafter's distribution is the target's; the loss mixes it
    with CE). DFlash2: `selector_loss` (its term before selector_loss_alpha), `candidate_recall` (gold among the top-K),
    `selector_accuracy` (the walk's choice given the gold predecessor is the gold), over all slots and per slot
    (`slot_...`), and `walk_tau_estimate` of those choices.
    A figure the run does not compute is None, and left out of `entry`."""

    loss: float
    slot_accuracy: list[float]
    slot_loss: list[float]
    tau_estimate: float
    tokens: int
    supervised: int
    padding_share: float | None = None
    distill_kl: float | None = None
    selector_loss: float | None = None
    candidate_recall: float | None = None
    slot_candidate_recall: list[float] | None = None
    selector_accuracy: float | None = None
    slot_selector_accuracy: list[float] | None = None
    walk_tau_estimate: float | None = None

    @classmethod
    def of_sums(cls, sums: Mapping[str, torch.Tensor], denominator: torch.Tensor | float) -> Figures:
        """The figures of `sums` (`LossOutput.sums`, plus "tokens", added up over what they measure; on the host) and
        the loss's denominator (sum(w), or D-PACE's supervised slot count, over the same)."""
        d = torch.as_tensor(denominator).cpu().clamp_min(1e-12)
        counted = sums["slot_counted"]
        slots = counted.clamp_min(1)
        blocks = float(counted[0])  # every block has a slot 1: the blocks whose slot 1 is supervised
        named: dict[str, Any] = {
            "loss": float(sums["weighted_term"] / d),
            "slot_accuracy": (sums["slot_correct"] / slots).tolist(),
            "slot_loss": (sums["slot_ce"] / slots).tolist(),
            "tau_estimate": teacher_forced_tau(sums["slot_leading"].tolist(), blocks),
            "tokens": int(sums["tokens"]),
            "supervised": int(counted.sum()),
        }
        if "positions" in sums:
            named["padding_share"] = 1.0 - float(sums["tokens"]) / max(float(sums["positions"]), 1.0)
        if "weighted_kl" in sums:
            named["distill_kl"] = float(sums["weighted_kl"] / d)
        if "selector_weighted" in sums:
            all_slots = float(counted.sum().clamp_min(1))
            named |= {
                "selector_loss": float(sums["selector_weighted"] / d),
                "candidate_recall": float(sums["slot_recall"].sum()) / all_slots,
                "slot_candidate_recall": (sums["slot_recall"] / slots).tolist(),
                "selector_accuracy": float(sums["slot_selector_correct"].sum()) / all_slots,
                "slot_selector_accuracy": (sums["slot_selector_correct"] / slots).tolist(),
                "walk_tau_estimate": teacher_forced_tau(sums["slot_walk_leading"].tolist(), blocks),
            }
        return cls(**named)

    def entry(self) -> dict[str, Any]:
        """The figures a metrics entry holds: every field that is not None, by its name."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}


def add_sums(total: dict[str, torch.Tensor] | None, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`total` + `part`, name by name (None: nothing yet); both must hold the same names."""
    if total is None:
        return dict(part)
    if total.keys() != part.keys():
        raise ValueError(f"figures to add hold different names: {sorted(total)} and {sorted(part)}")
    return {name: total[name] + part[name] for name in total}


# The keys of a metrics entry (and of its `eval`) that count or place it rather than measure: no tracker curve.
NOT_TRACKED = frozenset({"step", "epoch", "tokens", "supervised", "rows", "seconds"})


def scalars_of(entry: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a metrics entry (or of its `eval`) by name, a per-slot list's as `<name>/<k>` (k from 1); what
    counts or places it (`NOT_TRACKED`) and nested entries are left out."""
    scalars: dict[str, float] = {}
    for name, value in entry.items():
        if name in NOT_TRACKED or isinstance(value, Mapping):
            continue
        if isinstance(value, list):
            scalars.update({f"{name}/{k}": float(v) for k, v in enumerate(value, start=1)})
        else:
            scalars[name] = float(value)
    return scalars


def _whole_lines(path: Path) -> Iterator[str]:
    """The lines of `path` that end in a newline (a last line still being written is left out), read one at a time."""
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                return
            yield line


# The figures the curves draw (`Figures`' names): the loss, the tau estimate and the per-slot accuracy.
PLOTTED = ("loss", "tau_estimate", "slot_accuracy")


def read_curves(path: Path, max_points: int = PLOT_POINTS, held_out: bool = False) -> list[dict[str, float]]:
    """{"step", "loss", "tau_estimate", "slot_accuracy/1", ...} per point (`PLOTTED`, by `scalars_of`'s names), read
    from the log at `path` in one pass, in memory bounded by `max_points`: consecutive entries are averaged in bins that
    double in size whenever 2 * max_points bins are full. `held_out`: the same of the held-out figures, from the entries
    that have them."""
    points: list[dict[str, float]] = []
    size, total, count = 1, None, 0
    for line in _whole_lines(path):
        e = json.loads(line)
        if held_out and "eval" not in e:
            continue
        f = e["eval"] if held_out else e
        row = {"step": float(e["step"]), **scalars_of({name: f[name] for name in PLOTTED})}
        total = row if total is None else {name: total[name] + value for name, value in row.items()}
        count += 1
        if count == size:
            points.append({name: value / count for name, value in total.items()})
            total, count = None, 0
            if len(points) == 2 * max_points:
                pairs = zip(points[::2], points[1::2], strict=True)
                points = [{name: (p[name] + q[name]) / 2 for name in p} for p, q in pairs]
                size *= 2
    if total is not None:
        points.append({name: value / count for name, value in total.items()})
    return points


def draw_curves(source: Path, target: Path) -> None:
    """Loss (log scale), tau estimate and accuracy of each draft slot against the step (training and held-out), from the
    log `source`, into the PNG `target` (written beside it and renamed, so a reader never sees half a file). Uses no
    pyplot state: safe off the main thread."""
    import matplotlib
    from matplotlib.figure import Figure

    points, held = read_curves(source), read_curves(source, held_out=True)
    steps, held_steps = [p["step"] for p in points], [p["step"] for p in held]
    fig = Figure(figsize=(15, 4))
    ax_loss, ax_tau, ax_acc = fig.subplots(1, 3)
    ax_loss.plot(steps, [p["loss"] for p in points], color="black", label="training rows")
    ax_tau.plot(steps, [p["tau_estimate"] for p in points], color="black", label="training rows")
    if held:  # the held-out figures (docs/TRAINING-SIGNAL.md), beside the training ones
        ax_loss.plot(held_steps, [p["loss"] for p in held], color="tab:orange", marker=".", label="held-out")
        ax_tau.plot(held_steps, [p["tau_estimate"] for p in held], color="tab:orange", marker=".", label="held-out")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("loss (weighted CE)")
    ax_loss.legend(fontsize=7)
    ax_tau.set_xlabel("step")
    ax_tau.set_title("tau estimate (teacher forced)")
    ax_tau.legend(fontsize=7)
    if points:
        accuracy = [name for name in points[0] if name.startswith("slot_accuracy/")]  # slot_accuracy/1 .. /B-1
        cmap = matplotlib.colormaps["viridis"].resampled(max(len(accuracy), 2))
        for k, name in enumerate(accuracy):
            ax_acc.plot(steps, [p[name] for p in points], color=cmap(k), label=f"slot {k + 1}")
            if held:
                ax_acc.plot(held_steps, [p[name] for p in held], color=cmap(k), linestyle="--")
        ax_acc.legend(fontsize=7, ncol=2, title="dashed: held-out" if held else None, title_fontsize=7)
    ax_acc.set_ylim(0, 1)
    ax_acc.set_xlabel("step")
    ax_acc.set_title("per-slot accuracy")
    fig.tight_layout()
    partial = target.with_name(target.name + ".partial")
    fig.savefig(partial, dpi=90, format="png")
    os.replace(partial, target)


class Plotter:
    """Redraws the curves from the log: `maybe` starts a background redraw when `every_s` seconds passed since the last
    one began (never two at once); `now` waits for it and draws on the caller's thread. `draws` counts finished ones."""

    def __init__(self, source: Path, target: Path, every_s: float, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source, self.target, self.every_s, self.warn, self.clock = source, target, every_s, warn, clock
        self.draws = 0
        self._started = clock()
        self._thread: threading.Thread | None = None

    def maybe(self) -> None:
        if (self._thread is not None and self._thread.is_alive()) or self.clock() - self._started < self.every_s:
            return
        self._started = self.clock()
        self._thread = threading.Thread(target=self._draw_in_background, name="blockdraft-plot", daemon=True)
        self._thread.start()

    def now(self) -> None:
        self.wait()
        self._started = self.clock()
        draw_curves(self.source, self.target)
        self.draws += 1

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _draw_in_background(self) -> None:
        try:
            draw_curves(self.source, self.target)
            self.draws += 1
        except Exception as exc:  # a plot never stops training; the final one (`now`) raises
            self.warn(f"redrawing {self.target} failed: {exc}")


class MetricsLog:
    """Appends entries to `folder/metrics.jsonl`; keeps only the last entry, and where the current checkpoint window
    starts in the file (the entries no checkpoint holds yet)."""

    def __init__(self, folder: Path, plot_every_s: float = 600.0, warn: Callable[[str], None] = lambda _: None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / METRICS_NAME
        self.plot_path = folder / PLOT_NAME
        self.plotter = Plotter(self.path, self.plot_path, plot_every_s, warn)
        self.last: dict[str, Any] | None = None
        self._window_start = 0  # byte offset of the first entry not in a saved checkpoint

    def start_fresh(self) -> None:
        self.path.write_text("")
        self.plot_path.unlink(missing_ok=True)
        self.last, self._window_start = None, 0

    def restart_from(self, checkpoint_folder: Path, step: int) -> int | None:
        """Continue the log of a run resumed at `step`: the local log's entries up to `step` (none that a crashed run
        wrote after) when it is this run's (it holds the checkpoint's last entry), else the checkpoint's window alone.

        One streaming pass. Returns None when the log is whole, else the first step it holds: a checkpoint carries only
        the entries since the one before, so a log lost with its machine restarts there."""
        window = checkpoint_folder / METRICS_NAME
        lines = list(_whole_lines(window)) if window.is_file() else []
        anchor = lines[-1] if lines else None
        kept, found = self.path.with_name(self.path.name + ".partial"), anchor is None
        with open(kept, "w") as out:
            for line in _whole_lines(self.path) if self.path.is_file() else ():
                entry = json.loads(line)
                if entry["step"] > step:
                    break
                out.write(line)
                self.last, found = entry, found or line == anchor
        if not found:
            kept.write_text("".join(lines))
            self.last = json.loads(lines[-1])
        os.replace(kept, self.path)
        self._window_start = self.path.stat().st_size
        return None if found else json.loads(lines[0])["step"]

    def append(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, allow_nan=False) + "\n")  # JSON has no NaN: a non-finite step stops the run first
        self.last = entry
        self.plotter.maybe()

    def write_window(self, folder: Path) -> tuple[Path, int]:
        """`folder/metrics.jsonl` holding the entries since the last saved checkpoint; returns it and the log's length
        then (pass it to `window_saved` once that checkpoint verified)."""
        target = folder / METRICS_NAME
        with open(self.path, "rb") as src, open(target, "wb") as dst:
            src.seek(self._window_start)
            shutil.copyfileobj(src, dst)
            end = src.tell()
        return target, end

    def window_saved(self, end: int) -> None:
        self._window_start = end


INSTALL_HINT = "pip install 'blockdraft[trackers]'"


def tracked_scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """What the trackers get of a metrics entry: each of its numbers as `train/<name>` (`scalars_of`: slot k's accuracy
    is `train/slot_accuracy/k`), and the held-out figures of a step that has them as `eval/<name>` beside them."""
    scalars = {f"train/{name}": value for name, value in scalars_of(entry).items()}
    if (held := entry.get("eval")) is not None:  # the held-out figures measured after this step
        scalars.update({f"eval/{name}": value for name, value in scalars_of(held).items()})
    return scalars


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
        # W&B's run metadata holds the raw command line, which may carry a secret
        # (`--set store.endpoint_url=http://u:pw@h`): it is not collected; `config` (the resolved config, its URLs
        # redacted) says what ran.
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
                self.warn(f"train.report_to: {name} did not close ({_first_line(exc)}); its last steps may be missing "
                          "there")
        self.active.clear()

    def _drop(self, name: str, why: str) -> None:
        self.active.pop(name, None)
        self.warn(f"train.report_to: {name} {why}; training goes on without it")

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=exc is not None)


OWNER_NAME = "blockdraft-log.json"
OWNER_FORMAT = "blockdraft-log/1"
_FIX = "set train.log_dir to a folder of this run's own"


def check_log_dir(log_dir: str, places: dict[str, Store]) -> Path:
    """The log folder `log_dir` (absolute), created when missing; ConfigError (one line) when it is a file, cannot be
    written, lies inside one of `places` ({"train.data": store, "train.output": store}: where the run reads and writes)
    or inside an artifact."""
    folder = Path(log_dir).expanduser().absolute()
    real = folder.resolve()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"train.log_dir {folder} is a file, not a folder; {_FIX}")
    for role, store in places.items():
        local = store.local_path()
        if local is not None and real.is_relative_to(root := local.resolve()):
            where = f"is {role}" if real == root else f"lies inside {role} {root}"
            raise ConfigError(f"train.log_dir {folder} {where}: the run's metrics and curves would be written into it; "
                              f"{_FIX}")
    if (artifact := _artifact_holding(real)) is not None:
        raise ConfigError(f"train.log_dir {folder} lies inside the artifact at {artifact}: writing there would change "
                          f"files that verified; {_FIX}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"train.log_dir {folder} cannot be written ({exc.strerror or exc}); {_FIX}, one this user "
                          "may write") from None
    return folder


def _artifact_holding(path: Path) -> Path | None:
    """The nearest folder at or above `path` that holds an artifact's manifest, or None."""
    return next((p for p in (path, *path.parents) if (p / MANIFEST_NAME).is_file()), None)


def log_owner(identity: dict[str, Any], output_url: str) -> dict[str, str]:
    """What a log folder records about the run that writes it: the digest of its run identity and its train.output."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return {"format": OWNER_FORMAT, "run": digest, "output": safe_url(output_url)}


def claim_log_dir(folder: Path, identity: dict[str, Any], output_url: str) -> Path:
    """Make `folder` this run's log folder (rank 0, before the first entry is written): record the owner when there is
    none yet; ConfigError when another run owns it, or when it holds a metrics log that records no owner. Returns the
    metrics log's path (absolute), which the run names at start."""
    folder = folder.absolute()
    owner, mine = folder / OWNER_NAME, log_owner(identity, output_url)
    if owner.is_file():
        try:
            recorded = json.loads(owner.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"train.log_dir {folder}: {OWNER_NAME} is unreadable ({exc}); {_FIX}, or delete {folder}"
            ) from None
        if recorded == mine:
            return folder / METRICS_NAME
        if not isinstance(recorded, dict) or recorded.get("format") != OWNER_FORMAT:
            raise ConfigError(f"train.log_dir {folder} is a log folder of format "
                              f"{recorded.get('format') if isinstance(recorded, dict) else None}, this blockdraft "
                              f"writes {OWNER_FORMAT}; {_FIX}, or delete {folder}")
        other = "the same train.output with another run identity (settings, data or target)" if (
            recorded.get("output") == mine["output"]) else f"train.output {recorded.get('output')}"
        raise ConfigError(f"train.log_dir {folder} holds the metrics of another run ({other}); a log folder belongs to "
                          f"one run: {_FIX}, or delete {folder} to reuse it")
    if (folder / METRICS_NAME).exists():
        raise ConfigError(f"train.log_dir {folder} holds a {METRICS_NAME} that no run recorded as its own "
                          f"({OWNER_NAME} is missing); {_FIX}, or delete {folder} to reuse it")
    partial = owner.with_name(owner.name + ".partial")
    partial.write_text(json.dumps(mine, indent=2) + "\n")
    os.replace(partial, owner)
    return folder / METRICS_NAME


__all__ = [
    "INSTALL_HINT", "METRICS_NAME", "NOT_TRACKED", "PLOTTED", "PLOT_NAME", "PLOT_POINTS", "OWNER_FORMAT", "OWNER_NAME",
    "Figures", "MetricsLog", "Plotter", "TensorBoardTracker", "Tracker", "Trackers", "WandbTracker", "add_sums",
    "check_log_dir", "claim_log_dir", "draw_curves", "log_owner", "read_curves", "scalars_of", "tracked_scalars",
]
