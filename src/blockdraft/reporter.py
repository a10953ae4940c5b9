"""One way for the library to tell the user what is happening: progress, results and warnings go to a `Reporter`.

The library never prints. The CLI passes a reporter that draws on the terminal (`blockdraft.cli`); tests and the
pipeline pass one that keeps the lines. In a distributed run only rank 0 speaks: `for_rank` gives the others a
silent reporter, so a stage can report unconditionally.
"""

from __future__ import annotations

import logging
from typing import Any

from blockdraft.errors import redact

log = logging.getLogger("blockdraft")


class Reporter:
    """Keeps every line it is told (`lines`, `warnings`) and logs them; subclasses draw them instead or as well.

    `progress(task, completed, total)` is absolute (what is done so far of `total`, in the task's own unit: bytes,
    prompts, steps); `fields` carry what a display may show beside it (rows, tokens, loss).
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.warnings: list[str] = []

    def say(self, line: str) -> None:
        """A result or a status line the user should read (redacted: it may name a URL or quote a server)."""
        line = redact(line)
        self.lines.append(line)
        log.info(line)

    def warn(self, line: str) -> None:
        """A problem the user must see before the run goes on (redacted, as `say`)."""
        line = redact(line)
        self.warnings.append(line)
        log.warning(line)

    def progress(self, task: str, completed: float, total: float | None = None, **fields: Any) -> None:
        """How far `task` is; called often, so it must be cheap. Nothing to do by default."""

    def status_line(self, line: str) -> None:
        """A periodic plain progress line, for a log that shows no progress bar (no terminal); logged by default."""
        log.info(line)

    def for_rank(self, rank: int) -> Reporter:
        """This reporter on rank 0, a silent one on every other rank."""
        return self if rank == 0 else SilentReporter()


class SilentReporter(Reporter):
    """Says nothing (the other ranks of a distributed run); warnings still reach the log."""

    def say(self, line: str) -> None:
        pass


__all__ = ["Reporter", "SilentReporter"]
