"""Benchmark the pipelined training step: the target's forward for step N+1 overlapping the drafter's step N.

    python -m bench.train --pipeline            # CPU: target and drafter one thread each, on 2 free cores
    python -m bench.train --pipeline --steps 20 --rounds 2 --seq-len 256   # a quick look
    python -m bench.train --pipeline --preset qwen3-8b            # one GPU: Qwen3-8B-shaped target and drafter

What runs is `blockdraft train`'s own code: a `Trainer` built as the train stage builds it (a config, the target loaded
from a folder, verified rows from a tokenized artifact in a local store), driven through its `inputs_of` (rows read,
block batch built, target forward on side streams) and its `step` (`accumulate`, AdamW, the LR scheduler), fed by the
same `Prefetcher` as `Trainer.train`. The target is a random-init Qwen3 written to a temporary folder first (no weights
to download; about 16 GB for qwen3-8b) with as many layers as make its forward take about as long as the drafter's step
(measured first on a 4-layer probe), as on the real job (about 148 vs 169 TFLOP per 3072-token row for a 27B target and
its 5-layer drafter); the rows are random tokens (`bench.train_scale.write_rows`). Not timed: building the trainers,
checkpoints and the metrics log (`train`'s `_record` and `maybe_checkpoint`: the bench reads each step's loss itself,
through the trainer's `_entry`, so that a step's time ends when the drafter's device has).

Three trainers from one config (the same seed, so the same initial drafter) share one target and run four loops over the
same steps, each side in the thread it has when pipelined, taking turns a slice of steps each (`--rounds` slices), so
that a shared machine's changing load hits all four alike:

- target alone (t): the producer thread runs `inputs_of` for every step, the training thread only takes and waits for
  them;
- drafter alone (d): the training thread runs `step` over those inputs, the producer thread idle;
- unpipelined (`pipeline_depth` 0): `inputs_of`, then `step`, one after the other on the training thread;
- pipelined (`pipeline_depth` 1): `inputs_of` in the producer thread, one step ahead of `step`.

Prints `pipeline ratio = X` = pipelined step time / (t + d) beside its floor max(t, d) / (t + d) (the pipelined step can
be no shorter than its longer side), medians over each slice's steps after its first two, and checks that the drafter's
losses are bit-equal in the three loops that train (same batches, same order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockdraft.model.block_sparse import resolve_attention
from blockdraft.stages.train.step import MicroBatch, Prefetcher, StepInputs
from blockdraft.stages.train.trainer import Trainer


def write_target(folder: Path, layers: int, args: argparse.Namespace, device: torch.device) -> Path:
    """A random-init Qwen3 causal LM of `layers` decoder layers in the preset's shape, saved to `folder` (bf16 for CUDA,
    fp32 for the CPU)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=layers,
        num_attention_heads=args.hidden // args.head_dim, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=40960, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=target_dtype(device))
    model.save_pretrained(folder)
    return folder


def target_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_trainers(
    work: Path, layers: int, data: str, args: argparse.Namespace, device: torch.device, count: int
) -> list[Trainer]:
    """`count` trainers as the train stage builds them (`_prepare`), one rank, target and drafter on `device`, over a
    random target of `layers` layers; the second and later share the first one's target (it is frozen)."""
    from blockdraft.config import load_config
    from blockdraft.data.formats import TOKENIZED_KIND
    from blockdraft.reporter import Reporter
    from blockdraft.stages.train.data import load_train_rows
    from blockdraft.stages.train.ranks import RankPlacement
    from blockdraft.stages.train.setup import build_training
    from blockdraft.store import open_store
    from blockdraft.store.inputs import open_input

    target = write_target(work / f"target-{layers}", layers, args, device)
    config = load_config(None, {
        "target": {"path": str(target), "dtype": str(target_dtype(device)).removeprefix("torch.")},
        "store": {"url": str(work / "store")},
        "placement": {"target_devices": [str(device)], "drafter_devices": [str(device)]},
        "dflash": {"block_size": args.block_size, "mask_token_id": args.vocab - 1,
                   "num_draft_layers": args.drafter_layers, "gamma": 7.0, "num_anchors": args.anchors,
                   "target_layer_ids": sorted({1, layers - 2}) if layers > 3 else [0]},
        "train": {"data": data, "output": str(work / f"ckpt-{layers}"), "log_dir": str(work / f"logs-{layers}"),
                  "batch_size": 1, "global_batch_size": 1, "max_length": args.seq_len, "max_steps": args.steps,
                  "lr": 1e-4, "seed": 0, "attention": args.attention},
    })
    tc = config.train
    place = RankPlacement(rank=0, world_size=1, local_rank=0, drafter_device=device, target_device=device)
    rows = load_train_rows(open_input(tc.data, config.store, kinds=[TOKENIZED_KIND], role="train.data"), config.store,
                           tc.max_length, Path(tc.log_dir))
    trainers = []
    for _ in range(count):
        reporter = Reporter()
        setup = build_training(tc, config.dflash, config.target, config.store, place, rows,
                               open_store(tc.output, config.store), reporter, recorded=config.resolved())
        if trainers:
            setup.target = trainers[0].setup.target
        trainer = Trainer(tc, config.dflash, config.target, config.eval, place, rows, setup, reporter)
        trainers.append(trainer)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return trainers


def ready(inputs: StepInputs[MicroBatch], device: torch.device) -> StepInputs[MicroBatch]:
    """The step's inputs once made: the trainer's own wait (an event on CUDA), then the device idle."""
    inputs.wait(device)
    _sync(device)
    return inputs


def step_loss(trainer: Trainer, step: int, inputs: StepInputs[MicroBatch] | None) -> float:
    """`Trainer.step` on `inputs` (None: it makes them itself), then its loss as the trainer logs it, read on the host:
    a call ends when the drafter's device has."""
    pending = trainer.step(step, inputs)
    return trainer._entry(pending, 1.0)["loss"]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# qwen3-8b: a random-init Qwen3-8B-shaped target (36 layers, H 4096) and the published 5-layer drafter shape, both on
# one GPU (the target on its own stream), at 3072 tokens x 512 anchors x B 16.
PRESETS = {
    "cpu": dict(seq_len=512, hidden=256, intermediate=768, head_dim=64, kv_heads=2, vocab=4096, anchors=32,
                drafter_layers=1, target_layers=None, device="cpu", steps=50, rounds=5),
    "qwen3-8b": dict(seq_len=3072, hidden=4096, intermediate=12288, head_dim=128, kv_heads=8, vocab=151936, anchors=512,
                     drafter_layers=5, target_layers=36, device="cuda", steps=32, rounds=4),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("steps", "rounds", "seq-len", "hidden", "intermediate", "head-dim", "kv-heads", "vocab", "anchors",
                 "drafter-layers"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--target-layers", type=int, help="default: the preset's, or (cpu) as many as balance the "
                                                          "drafter")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device")
    parser.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    attention = resolve_attention(args.attention, device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core for each side: the target's thread and the drafter's
    load = os.getloadavg()[0]
    from transformers.utils import logging as hf_logging

    from bench.train_scale import write_rows

    hf_logging.disable_progress_bar()  # the targets' writing and loading bars would bury the report

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        work = Path(tmp)
        # Random tokens below 500 (every vocabulary here is larger), the first quarter of each row unsupervised.
        data = write_rows(work / "rows", args.steps, args.seq_len, seed=0)
        layers = args.target_layers
        if layers is None:  # balance: the drafter's step time, then target layers to match it (linear in layers)
            probe_layers = 4
            (probe,) = build_trainers(work, probe_layers, data, args, device, 1)
            made = ready(probe.inputs_of(0), device)
            step_loss(probe, 0, made)
            drafter_alone = median_time(lambda: step_loss(probe, 0, made), 5)
            target_alone = median_time(lambda: ready(probe.inputs_of(0), device), 5)
            # the forward runs to layer L-2
            layers = max(4, round((probe_layers - 1) * drafter_alone / target_alone) + 1)
            del probe, made
        report = measure(work, layers, data, args, device)
    report = {"preset": args.preset, "device": str(device), "attention": attention, "load_1min_before": load,
              "load_1min_after": os.getloadavg()[0], "torch_threads": torch.get_num_threads(), **report}
    t, d, serial, piped = (report[k] for k in ("target_forward_s", "drafter_step_s", "unpipelined_step_s",
                                               "pipelined_step_s"))
    print(json.dumps(report))
    print(f"target forward {t * 1e3:.1f} ms, drafter step {d * 1e3:.1f} ms, each alone on its own thread "
          f"(balance {report['balance']:.2f}); unpipelined step {serial * 1e3:.1f} ms, pipelined {piped * 1e3:.1f} ms")
    print(
        f"losses over {report['steps']} steps bit-equal (alone, unpipelined, pipelined): {report['losses_bit_equal']}"
    )
    print(f"pipeline ratio = {report['pipeline_ratio']:.3f} (floor max(t, d) / (t + d) = "
          f"{report['pipeline_floor']:.3f})")
    if report["pipeline_ratio"] < report["pipeline_floor"]:
        # no overlap can beat its longer side: the load moved between loops
        print("the ratio is below its floor: the machine's load changed between the loops; not a figure to quote, run "
              "it again")


def measure(work: Path, layers: int, data: str, args: argparse.Namespace, device: torch.device) -> dict:
    """The four loops over the steps, a slice each per round; the medians, their ratios and whether the losses agree."""
    names = ("drafter", "unpipelined", "pipelined")
    trainers = dict(zip(names, build_trainers(work, layers, data, args, device, 3), strict=True))
    producer = trainers["drafter"]  # t's loop runs its `inputs_of`; the inputs of every trainer are the same
    times: dict[str, list[float]] = {name: [] for name in ("target", *names)}
    losses: dict[str, list[float]] = {name: [] for name in names}

    def run(name: str, first: int, stop: int, depth: int) -> list[StepInputs[MicroBatch]]:
        """Steps [first, stop) of one loop, each step timed on the training thread; returns what the steps took in."""
        trainer = producer if name == "target" else trainers[name]
        taken = []
        with Prefetcher(trainer.inputs_of, first, stop, depth) as feed:
            for s in range(first, stop):
                t0 = time.perf_counter()
                inputs = feed.get(s)
                if name == "target":
                    ready(inputs, device)
                else:
                    losses[name].append(step_loss(trainer, s, inputs))
                times[name].append(time.perf_counter() - t0)
                taken.append(inputs)
        return taken

    # The loops take turns over the steps, a slice each per round, so a shared machine's changing load hits all alike.
    # The first two steps of a slice fill the pipeline and are left out of the medians.
    per_round = args.steps // args.rounds
    kept: dict[str, list[float]] = {name: [] for name in times}
    for first in range(0, per_round * args.rounds, per_round):
        stop = first + per_round
        # the producer thread makes the inputs, the training thread only takes them
        made = run("target", first, stop, 1)
        for s, inputs in zip(range(first, stop), made, strict=True):
            # the training thread steps, the producer thread idle
            t0 = time.perf_counter()
            losses["drafter"].append(step_loss(trainers["drafter"], s, inputs))
            times["drafter"].append(time.perf_counter() - t0)
        del made
        run("unpipelined", first, stop, 0)  # `inputs_of`, then `step`, both on the training thread
        run("pipelined", first, stop, 1)  # `inputs_of` in the producer thread, one step ahead of `step`
        for name in kept:
            kept[name] += times[name][-per_round + 2 :]
    t, d, serial, piped = (statistics.median(kept[name]) for name in ("target", *names))
    return {
        "peak_memory_gib_three_drafters": (torch.cuda.max_memory_allocated(device) / 2**30
                                           if device.type == "cuda" else None),
        "seq_len": args.seq_len, "hidden": args.hidden, "target_layers": layers, "drafter_layers": args.drafter_layers,
        "anchors": args.anchors, "block_size": args.block_size, "steps": per_round * args.rounds, "rounds": args.rounds,
        "target_forward_s": t, "drafter_step_s": d, "balance": t / d, "unpipelined_step_s": serial,
        "pipelined_step_s": piped,
        "unpipelined_ratio": serial / (t + d), "pipeline_ratio": piped / (t + d), "pipeline_floor": max(t, d) / (t + d),
        "pipelined_over_unpipelined": piped / serial,
        "losses_bit_equal": losses["drafter"] == losses["unpipelined"] == losses["pipelined"],
    }


if __name__ == "__main__":
    main()
