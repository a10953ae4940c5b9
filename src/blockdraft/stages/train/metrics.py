"""Training metrics: one JSON line per logged step, and a PNG of the loss and the per-slot accuracies.

Nothing here grows with the run: the log is appended to and never held in memory, a checkpoint takes only the entries
since the one before (its window), and the curves are redrawn from the file in a background thread at most every
`plot_every_s` seconds (and once at the end), from a fixed number of bin-averaged points.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "training-curves.png"
PLOT_POINTS = 2000  # a curve has between this many and twice as many points, whatever the log's length


def _whole_lines(path: Path) -> Iterator[str]:
    """The lines of `path` that end in a newline (a last line still being written is left out), read one at a time."""
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                return
            yield line


def read_curves(path: Path, max_points: int = PLOT_POINTS, held_out: bool = False) -> list[list[float]]:
    """[step, loss, tau estimate, slot 1 accuracy, ...] per point, read from the log at `path` in one pass, in memory
    bounded by `max_points`: consecutive entries are averaged in bins that double in size whenever 2 * max_points bins
    are full. `held_out`: the same of the held-out figures, from the entries that have them."""
    points: list[list[float]] = []
    size, total, count = 1, None, 0
    for line in _whole_lines(path):
        e = json.loads(line)
        if held_out and "eval" not in e:
            continue
        f = e["eval"] if held_out else e
        row = [float(e["step"]), float(f["loss"]), float(f["tau_estimate"]), *map(float, f["slot_accuracy"])]
        total = row if total is None else [a + b for a, b in zip(total, row, strict=True)]
        count += 1
        if count == size:
            points.append([a / count for a in total])
            total, count = None, 0
            if len(points) == 2 * max_points:
                points = [[(a + b) / 2 for a, b in zip(p, q, strict=True)] for p, q in zip(points[::2], points[1::2], strict=True)]
                size *= 2
    if total is not None:
        points.append([a / count for a in total])
    return points


def draw_curves(source: Path, target: Path) -> None:
    """Loss (log scale), tau estimate and accuracy of each draft slot against the step (training and held-out), from the log `source`, into the PNG `target`
    (written beside it and renamed, so a reader never sees half a file). Uses no pyplot state: safe off the main thread."""
    import matplotlib
    from matplotlib.figure import Figure

    points, held = read_curves(source), read_curves(source, held_out=True)
    steps, held_steps = [p[0] for p in points], [p[0] for p in held]
    fig = Figure(figsize=(15, 4))
    ax_loss, ax_tau, ax_acc = fig.subplots(1, 3)
    ax_loss.plot(steps, [p[1] for p in points], color="black", label="training rows")
    ax_tau.plot(steps, [p[2] for p in points], color="black", label="training rows")
    if held:  # the held-out figures (docs/TRAINING-SIGNAL.md), beside the training ones
        ax_loss.plot(held_steps, [p[1] for p in held], color="tab:orange", marker=".", label="held-out")
        ax_tau.plot(held_steps, [p[2] for p in held], color="tab:orange", marker=".", label="held-out")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("loss (weighted CE)")
    ax_loss.legend(fontsize=7)
    ax_tau.set_xlabel("step")
    ax_tau.set_title("tau estimate (teacher forced)")
    ax_tau.legend(fontsize=7)
    if points:
        num_slots = len(points[0]) - 3
        cmap = matplotlib.colormaps["viridis"].resampled(max(num_slots, 2))
        for k in range(num_slots):
            ax_acc.plot(steps, [p[3 + k] for p in points], color=cmap(k), label=f"slot {k + 1}")
            if held:
                ax_acc.plot(held_steps, [p[3 + k] for p in held], color=cmap(k), linestyle="--")
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
        """Continue the log of a run resumed at `step`: the local log's entries up to `step` (none that a crashed run wrote
        after) when it is this run's (it holds the checkpoint's last entry), else the checkpoint's window alone.

        One streaming pass. Returns None when the log is whole, else the first step it holds: a checkpoint carries only the
        entries since the one before, so a log lost with its machine restarts there."""
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
        """`folder/metrics.jsonl` holding the entries since the last saved checkpoint; returns it and the log's length then
        (pass it to `window_saved` once that checkpoint verified)."""
        target = folder / METRICS_NAME
        with open(self.path, "rb") as src, open(target, "wb") as dst:
            src.seek(self._window_start)
            shutil.copyfileobj(src, dst)
            end = src.tell()
        return target, end

    def window_saved(self, end: int) -> None:
        self._window_start = end
