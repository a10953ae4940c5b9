"""The terminal side of a `Reporter`: lines on stderr through rich, and one progress bar per task while a stage runs."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from blockdraft.errors import redact
from blockdraft.reporter import Reporter


class ConsoleReporter(Reporter):
    """Draws what the library reports: `say` and `warn` as lines, `progress` as a bar per task (with its fields beside
    it)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self._bar: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def say(self, line: str) -> None:
        line = redact(line)
        super().say(line)
        self.console.print(line, highlight=False, markup=False)

    def warn(self, line: str) -> None:
        line = redact(line)
        self.warnings.append(line)
        self.console.print(f"[bold yellow]WARNING:[/] {escape(line)}", highlight=False)

    def progress(self, task: str, completed: float, total: float | None = None, **fields: Any) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console, transient=True,
            )
            self._bar.start()
        info = "  ".join(
            f"{name} {value:,}" if isinstance(value, int) else f"{name} {value}" for name, value in fields.items()
        )
        if task not in self._tasks:
            self._tasks[task] = self._bar.add_task(task, total=total, info=info)
        self._bar.update(self._tasks[task], completed=completed, total=total, info=info)

    def status_line(self, line: str) -> None:
        """Printed only without a terminal (a Slurm or nohup log): on one, the progress bar shows the same."""
        if not self.console.is_terminal:
            self.console.print(line, highlight=False, markup=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self._tasks.clear()

    def __enter__(self) -> ConsoleReporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
