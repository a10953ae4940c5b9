"""Reporters that keep what a stage told them, so a test asserts on it (the library's own `Reporter` keeps lines
only)."""

from __future__ import annotations

from typing import Any

from blockdraft.reporter import Reporter


class ProgressLog(Reporter):
    """Keeps every progress call as (task, completed, total, fields), besides the lines and warnings."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, float, float | None, dict[str, Any]]] = []

    def progress(self, task: str, completed: float, total: float | None = None, **fields: Any) -> None:
        self.calls.append((task, completed, total, fields))
