"""Target features made ahead of the drafter: while the drafter trains on step N, a background thread runs the target on
step N+1, so a step costs max(target forward, drafter step) instead of their sum.

The producer makes exactly the inputs the step would make itself (same rows, same order, no shared random state), so a
pipelined run is bit-equal to an unpipelined one. It runs at most `depth` steps ahead (a bounded queue), and an error in
it is raised in the training loop at the step that needed its result.

On CUDA the producer sends the token ids straight to the target's device, runs the target and copies the batch and the
features to the drafter's device on streams of its own (`SideStreams`); the step waits for them with an event, not
with a device-wide sync.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class StepInputs(Generic[T]):
    """One optimizer step's micro-batches [(batch, features)] on the drafter's device; `ready`: the event the copy
    recorded (CUDA), waited on by `wait` before the drafter reads them."""

    micro: list[T]
    ready: torch.cuda.Event | None = None

    def wait(self, device: torch.device) -> None:
        if self.ready is None:
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.ready)
        for item in self.micro:  # tensors made on the copy stream are used on this one: tell the caching allocator
            for tensor in _tensors(item):
                if tensor.device.type == "cuda":
                    tensor.record_stream(stream)


def _tensors(item: object) -> Iterator[torch.Tensor]:
    if isinstance(item, torch.Tensor):
        yield item
    elif isinstance(item, tuple | list):
        for part in item:
            yield from _tensors(part)
    elif hasattr(item, "__dataclass_fields__"):
        for field in fields(item):  # type: ignore[arg-type]
            yield from _tensors(getattr(item, field.name))


class SideStreams:
    """The producer's own CUDA streams, one per device it uses (the target's and the drafter's; one when they are the
    same GPU): the target's forward and the copies run there, so they overlap the drafter's work on its default stream.
    `record` marks the end of the copies with an event on the drafter's side. A no-op on CPU devices."""

    def __init__(self, target_device: torch.device, drafter_device: torch.device) -> None:
        cuda = [d for d in (target_device, drafter_device) if d.type == "cuda"]
        self.streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys(cuda)}
        self.drafter_stream = self.streams.get(drafter_device)

    @contextmanager
    def active(self) -> Iterator[None]:
        with ExitStack() as stack:
            for stream in self.streams.values():
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def record(self) -> torch.cuda.Event | None:
        if self.drafter_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.drafter_stream)
        return event


class Prefetcher(Generic[T]):
    """`make(step)` for steps `start`..`stop`-1, in order, at most `depth` ahead in one background thread.

    `depth` 0 makes each step's item on demand in the caller's thread (the unpipelined loop, same code path).
    Use as a context manager: leaving it stops and joins the thread, whatever happened in the loop.
    """

    def __init__(self, make: Callable[[int], T], start: int, stop: int, depth: int) -> None:
        self.make, self.next_step, self.stop_step, self.depth = make, start, stop, depth
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0 and start < stop:
            self._thread = threading.Thread(target=self._produce, args=(start,), name="blockdraft-target", daemon=True)
            self._thread.start()

    def _produce(self, start: int) -> None:
        for step in range(start, self.stop_step):
            try:
                item: object = (step, self.make(step))
            except BaseException as exc:  # noqa: BLE001 - handed to the training loop, which raises it
                item = exc
            while not self._closing.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._closing.is_set() or isinstance(item, BaseException):
                return

    def get(self, step: int) -> T:
        """The item of `step`, which must be the next one in order."""
        if step != self.next_step:
            raise ValueError(f"prefetcher asked for step {step}, expected {self.next_step}")
        self.next_step += 1
        if self._thread is None:
            return self.make(step)
        got = self._queue.get()
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, tuple) and got[0] == step, f"prefetched {got!r} for step {step}"
        return got[1]

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:  # unblock a producer waiting on a full queue
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


__all__ = ["Prefetcher", "SideStreams", "StepInputs"]
