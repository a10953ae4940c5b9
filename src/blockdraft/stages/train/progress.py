"""Progress for a log without a terminal (Slurm, nohup): one plain line every train.log_every_s seconds with the step,
the loss, the held-out tau estimate, tokens/s and the time left; a terminal's bar shows the same (`Reporter.status_line`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from blockdraft.reporter import Reporter


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m10s` or `42s`."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressLines:
    """Says one status line (`Reporter.status_line`) at most every `every_s` seconds of `clock`, and the first after
    `every_s`; the time left is this run's pace so far times the steps left."""

    def __init__(self, reporter: Reporter, every_s: float, start: int, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter, self.every_s, self.start, self.total, self.clock = reporter, every_s, start, total, clock
        self._began = self._last = clock()

    def step(self, entry: dict[str, Any], held_out_tau: float | None) -> str | None:
        """After the step of `entry` (a metrics entry): the line said, or None when it is not yet time."""
        now = self.clock()
        if now - self._last < self.every_s:
            return None
        self._last = now
        done = int(entry["step"])
        pace = (now - self._began) / max(1, done - self.start)
        held = f"{held_out_tau:.2f}" if held_out_tau is not None else "-"
        line = (f"train step {done}/{self.total}  loss {entry['loss']:.4f}  held-out tau {held}  "
                f"{entry['tokens_per_s']:,.0f} tokens/s  ETA {format_duration(pace * (self.total - done))}")
        self.reporter.status_line(line)
        return line


__all__ = ["ProgressLines", "format_duration"]
