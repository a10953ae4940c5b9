"""One optimizer step: the drafter's forward, loss and backward, fed by target features made a step ahead.

The drafter's side of one optimizer step: forward, chunked loss and backward per micro-batch, then clipping.

An optimizer step trains on `train.global_batch_size` rows across all ranks: each rank runs its share as micro-batches
of `train.batch_size` rows, accumulating gradients (DDP synchronises only on the last). Every micro-batch's loss is
divided by sum(w) over the whole global batch, so the accumulated gradient equals one process on the global batch in one
pass.

Target features made ahead of the drafter: while the drafter trains on step N, a background thread runs the target on
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
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from blockdraft.model import DFlashDrafter, TargetHead
from blockdraft.stages.train.data import BlockBatch
from blockdraft.stages.train.loss import PAPER_OBJECTIVE, LossOutput, Objective, Teacher, block_loss
from blockdraft.stages.train.metrics import add_sums


class DraftForward(nn.Module):
    """The drafter's whole differentiable path in one forward, so DDP sees every parameter use."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, features, block_hidden, block_positions, context_positions, attention_mask):
        context = self.drafter.project_context(features)
        return self.drafter(block_hidden, context, block_positions, context_positions, attention_mask)


@dataclass
class MicroBatch:
    """One micro-batch on the drafter's device: the batch, its target features [b, S, K*H] (in the target's dtype),
    its real context tokens and the entries the target's forward computed, padding included (both counted on the host,
    so reading them never waits for a device)."""

    batch: BlockBatch
    features: torch.Tensor
    tokens: int
    teacher: Teacher | None = None  # the target's final hidden states per slot, when train.distill_weight > 0
    positions: int | None = None  # None: as many as `tokens` (no padding)


def backward_micro(
    model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: BlockBatch,
    features: torch.Tensor,
    chunk_blocks: int,
    weight_sum: torch.Tensor | None = None,
    objective: Objective = PAPER_OBJECTIVE,
    teacher: Teacher | None = None,
) -> LossOutput:
    """Forward (bf16 autocast on GPU), chunked loss and backward of one micro-batch, adding to the gradients.

    model is the drafter's `DraftForward` (DDP-wrapped under torchrun); `weight_sum`: the step's global sum(w)
    (None: this batch's own, across ranks). A DFlash2 objective scores the candidates with the drafter's selector."""
    device = features.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    block_hidden = head.embed(batch.block_ids).float()
    with autocast:
        hidden = model(features.float(), block_hidden, batch.block_positions, batch.context_positions,
                       batch.drafter_attention)
        out = block_loss(
            hidden, batch.labels, batch.weights, head.lm_head_weight, head.lm_head_bias, drafter.spec.block_size,
            chunk_blocks, weight_sum, objective=objective, teacher=teacher,
            walk_scores=selector.scores if (selector := drafter.candidate_selector) is not None else None,
        )
    out.loss.backward()
    return out


def step_weight_sum(micro: list[MicroBatch], world_size: int, objective: Objective = PAPER_OBJECTIVE) -> torch.Tensor:
    """sum(w) (D-PACE: the supervised slot count) over every micro-batch of the step on every rank (one all-reduce): the
    loss's denominator."""
    total = torch.stack([objective.normaliser(m.batch.weights) for m in micro]).sum()
    if world_size > 1:
        dist.all_reduce(total)
    return total


def accumulate(
    model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    micro: list[MicroBatch],
    chunk_blocks: int,
    grad_clip: float,
    world_size: int,
    objective: Objective = PAPER_OBJECTIVE,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The step's gradients over its micro-batches, clipped. Returns (sums, weight_sum, grad_norm) as device tensors:
    sums (`sums_of`, by name; `metrics.Figures.of_sums` reads them) added over micro-batches and ranks; nothing here
    waits for the device."""
    weight_sum = step_weight_sum(micro, world_size, objective)
    for p in drafter.parameters():
        p.grad = None
    sums: dict[str, torch.Tensor] | None = None
    for i, m in enumerate(micro):
        last = i == len(micro) - 1
        no_sync = getattr(model, "no_sync", None)
        with nullcontext() if last or no_sync is None else no_sync():
            out = backward_micro(model, drafter, head, m.batch, m.features, chunk_blocks, weight_sum, objective,
                                 m.teacher)
        sums = add_sums(sums, sums_of(out, m.tokens, m.positions))
    assert sums is not None, "a step has at least one micro-batch"
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    if world_size > 1:
        sums = all_reduce_sums(sums)
    return sums, weight_sum, grad_norm


def sums_of(out: LossOutput, tokens: int, positions: int | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch's figures as named sums: the loss's (`LossOutput.sums`), its real context tokens and the entries
    the target's forward computed (`positions`, padding included; None: `tokens`)."""
    sums = out.sums()
    sums["tokens"] = out.slots.total.new_tensor(float(tokens))
    sums["positions"] = out.slots.total.new_tensor(float(tokens if positions is None else positions))
    return sums


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sums` added over every rank, in one all-reduce: packed into one vector in sorted-name order, each name's share
    as long as its tensor, and unpacked by the same names and shapes (every rank holds the same names: one
    objective)."""
    names = sorted(sums)
    packed = torch.cat([sums[name].reshape(-1) for name in names])
    dist.all_reduce(packed)
    parts = packed.split([sums[name].numel() for name in names])
    return {name: part.reshape(sums[name].shape) for name, part in zip(names, parts, strict=True)}


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


__all__ = [
    "DraftForward", "MicroBatch", "Prefetcher", "SideStreams", "StepInputs", "accumulate", "all_reduce_sums",
    "backward_micro", "step_weight_sum", "sums_of",
]
