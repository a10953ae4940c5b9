"""Runs shard tasks: in this process for one worker (unless asked to spawn it), else in a pool of spawned processes that
report progress back."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import queue
from types import TracebackType

from blockdraft.data.tokenizer import TokenizerSource
from blockdraft.stages.tokenize.shard import (
    Advance,
    ShardRun,
    WorkerSettings,
    install_tools,
    tokenize_shard,
    worker_init,
)
from blockdraft.stages.tokenize.tasks import ShardTask

# How often the parent drains the workers' progress queue while it waits for shards (seconds).
DRAIN_EVERY_S = 0.2


class ShardRunner:
    """Runs shard tasks with `workers` processes; use as a context manager (the pool shuts down on exit).

    One worker runs in this process (no pool to start) unless `spawn_one`: bench.tokenize spawns it, so that its scaling
    figure compares N spawned workers with one spawned worker. The pool starts (and each worker builds its tokenizer) as
    soon as the runner exists, so that start-up overlaps the parent's verifying of the output and of the finished
    shards.
    """

    def __init__(self, workers: int, src: TokenizerSource, spawn_one: bool = False) -> None:
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        if workers <= 1 and not spawn_one:
            install_tools(src.tokenizer_json, src.template.text, src.template.variables)
            return
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=worker_init,
            initargs=(self.queue, os.getpid(), src.tokenizer_json, src.template.text, src.template.variables),
        )
        # Ask for every worker now: the executor starts processes lazily otherwise.
        for _ in range(workers):
            self.pool.submit(os.getpid)

    def run(self, pending: list[ShardTask], settings: WorkerSettings, advance: Advance) -> list[ShardRun]:
        """Tokenize `pending` (each shard records its own piece); returns their runs in the order given.

        Raises the first failed shard's error once every shard has ended.
        """
        if self.pool is None:
            return [tokenize_shard(task, settings, advance) for task in pending]
        # Largest first, so that a big task does not start last and keep one worker busy after the others are done.
        order = sorted(range(len(pending)), key=lambda i: -pending[i].share)
        submitted = {i: self.pool.submit(tokenize_shard, pending[i], settings) for i in order}
        futures = [submitted[i] for i in range(len(pending))]
        waiting = set(futures)
        while waiting:
            _, waiting = concurrent.futures.wait(waiting, timeout=DRAIN_EVERY_S)
            self._drain(advance)
        self._drain(advance)
        return [f.result() for f in futures]

    def _drain(self, advance: Advance) -> None:
        while True:
            try:
                nbytes, rows, tokens = self.queue.get_nowait()
            except queue.Empty:
                return
            advance(nbytes, rows, tokens)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ShardRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
