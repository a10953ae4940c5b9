"""Checkpoints written in the background: the state is copied to the host at its step, then one worker thread writes,
pushes and verifies it while training goes on.

A `Snapshot` is everything one checkpoint holds, taken on the training thread: the drafter and the optimizer state copied
to the CPU (training changes the originals in place), the RNG states, and the metrics window and curves as files. The
`BackgroundWriter` runs one job at a time on its own thread; whoever owns it takes the job's outcome on its own thread
(`Checkpoints` in `blockdraft.stages.train.checkpoint`), so nothing of a checkpoint counts before its push verified.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from blockdraft.model import DFlashDrafter
from blockdraft.stages.train.metrics import MetricsLog

T = TypeVar("T")


def host_copy(value: Any) -> Any:
    """`value` (a state dict: nested dicts, lists, tuples of tensors and plain values) with every tensor copied to the CPU,
    so that later in-place updates of the originals (an optimizer step) do not reach it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return value


def drafter_on_host(drafter: DFlashDrafter) -> DFlashDrafter:
    """A CPU copy of `drafter` (same spec, its parameters copied), built without a second initialisation."""
    with torch.device("meta"):
        copy = DFlashDrafter(drafter.spec)
    copy.load_state_dict(host_copy(drafter.state_dict()), assign=True)
    return copy


@dataclass
class Snapshot:
    """One checkpoint as taken at `step`: what the background writer saves, and what counts once it verified.

    `folder` (removed by `discard`) holds `files`: the metrics logged since the last checkpoint that counted and the curves
    as last drawn; `window_end` is where that window ends in the log (`MetricsLog.window_saved` once the push verified).
    """

    step: int
    drafter: DFlashDrafter
    training_state: dict[str, Any]
    counts: dict[str, Any]
    folder: Path
    files: list[Path]
    window_end: int
    final: bool

    @classmethod
    def take(
        cls, step: int, drafter: DFlashDrafter, training_state: dict[str, Any], log: MetricsLog, counts: dict[str, Any], final: bool
    ) -> Snapshot:
        folder = Path(tempfile.mkdtemp(prefix="blockdraft-ckpt-state-"))
        try:
            window, end = log.write_window(folder)
            files = [window]
            if log.plot_path.is_file():  # the plotter replaces the file whole, so this copy is one drawing
                files.append(Path(shutil.copyfile(log.plot_path, folder / log.plot_path.name)))
            return cls(step, drafter_on_host(drafter), host_copy(training_state), host_copy(counts), folder, files, end, final)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class BackgroundWriter(Generic[T]):
    """One job at a time on a daemon thread: `start` it, `finished` says whether it ended, `result` waits for it and
    returns its value or raises its exception, on the caller's thread. A job left running when the process exits is
    dropped (a checkpoint without its manifest: never resumed from)."""

    def __init__(self, name: str = "blockdraft-checkpoint") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._outcome: tuple[T | None, BaseException | None] = (None, None)

    def start(self, job: Callable[[], T]) -> None:
        assert self._thread is None, "the previous job's result must be taken first"

        def run() -> None:
            try:
                self._outcome = (job(), None)
            except BaseException as exc:  # handed to the owner's thread by `result`
                self._outcome = (None, exc)

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def finished(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def result(self) -> T | None:
        """Wait for the job, then its value (None when there was no job); its exception is raised here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        (value, error), self._outcome = self._outcome, (None, None)
        if error is not None:
            raise error
        return value


__all__ = ["BackgroundWriter", "Snapshot", "drafter_on_host", "host_copy"]
