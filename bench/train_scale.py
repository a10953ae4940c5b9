"""Does a training step or a checkpoint cost more as the data grows or the run goes on? `train` end to end on CPU,
golden tiny target (tests/fixtures/dflash-golden/target: 8 layers, hidden 64) and a 2-layer B = 4 drafter, random rows
of --row-len tokens.

    .venv/bin/python -m bench.train_scale [--section all|rows|long] [--steps 150] [--long-steps 20000]
    [--checkpoint-every 500]

- `rows`: median step time (as `train` logs it: inputs, forward, backward, optimizer) on N rows and on 100 N rows, for N
  = the full demo's size (320) and N = 10,000 (so 100 N is the real job's million), the sizes interleaved, all in one
  process. Beside it, what one full `torch.randperm(num_rows)` costs at each size: what a step would pay if it drew the
  epoch's permutation itself.
- `long`: one run of --long-steps with a checkpoint every --checkpoint-every (metrics logged every step, curves redrawn
  every --plot-every-minutes): the time a checkpoint takes on its background thread (write, push, verify, prune), how
  long the training thread is held for it (`Checkpoints.save`), the checkpoint's size, first against last, and the
  median step time of the first and last 500 steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

REPO = Path(__file__).resolve().parent.parent
GOLDEN_TARGET = REPO / "tests" / "fixtures" / "dflash-golden" / "target"
DEMO_ROWS = 320  # the full demo's conversations (blockdraft.pipeline SIZES["full"])


def write_rows(folder: Path, num_rows: int, row_len: int, seed: int) -> str:
    """A tokenized artifact of `num_rows` random rows (the first quarter of each unsupervised), built column-wise with
    pyarrow so that a million rows take seconds."""
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    from blockdraft.store import open_store
    from blockdraft.store.artifact import commit_artifact, entry_for_local_file

    rng = np.random.default_rng(seed)
    offsets = pa.array(np.arange(0, num_rows * row_len + 1, row_len, dtype=np.int32))
    ids = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 500, num_rows * row_len, dtype=np.int32)))
    mask_row = np.array([0] * (row_len // 4) + [1] * (row_len - row_len // 4), dtype=np.int8)
    mask = pa.ListArray.from_arrays(offsets, pa.array(np.tile(mask_row, num_rows)))
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    train = Dataset(InMemoryTable(table))
    held_out = Dataset(InMemoryTable(table.slice(0, 1)))
    DatasetDict({"train": train, "held_out": held_out}).save_to_disk(str(folder))
    entries = [entry_for_local_file(folder, p) for p in sorted(folder.rglob("*")) if p.is_file()]
    commit_artifact(open_store(folder), "tokenized", entries, config={}, counts={"train_rows": num_rows})
    return str(folder)


def config(work: Path, data: str, name: str, **train):
    from blockdraft.config import load_config

    return load_config(None, {
        "target": {"path": str(GOLDEN_TARGET)}, "store": {"url": str(work / "store")},
        "dflash": {"block_size": 4, "mask_token_id": 511, "num_draft_layers": 2, "gamma": 4.0, "num_anchors": 8,
                   "intermediate_size": 96},
        "train": {"data": data, "output": str(work / name / "ckpt"), "log_dir": str(work / name / "logs"),
                  "batch_size": 2, "global_batch_size": 2,
                  "lr": 3e-3, "warmup_ratio": 0.05, "seed": 0, "log_every": 1, **train},
    })


def randperm_ms(num_rows: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.randperm(num_rows, generator=torch.Generator().manual_seed(0))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rows_section(work: Path, args: argparse.Namespace) -> None:
    from blockdraft.reporter import Reporter
    from blockdraft.stages.train import run

    for base in (DEMO_ROWS, 10_000):
        sizes = (base, 100 * base)
        t0 = time.perf_counter()
        data = {n: write_rows(work / f"rows-{n}", n, args.row_len, seed=n) for n in sizes}
        made = time.perf_counter() - t0
        step_times: dict[int, list[float]] = {n: [] for n in sizes}
        ratios = []
        for repeat in range(args.repeats):
            # interleaved, in alternating order, so the machine's load hits both sizes alike
            medians = {}
            for n in sizes if repeat % 2 == 0 else sizes[::-1]:
                cfg = config(work, data[n], f"rows-{n}-run{repeat}", max_steps=args.steps, checkpoint_every=args.steps)
                # past the warm-up
                times = [e["step_time_s"] for e in run(cfg, reporter=Reporter()).details.metrics[10:]]
                step_times[n] += times
                medians[n] = statistics.median(times)
            ratios.append(medians[sizes[1]] / medians[sizes[0]])
        small, large = (statistics.median(step_times[n]) for n in sizes)
        print(f"rows {sizes[0]:>9,} vs {sizes[1]:>9,}: median step {small * 1e3:6.2f} ms vs {large * 1e3:6.2f} ms; "
              f"ratio of the paired runs' medians {statistics.median(ratios):.3f} (each: "
              f"{' '.join(f'{r:.3f}' for r in ratios)}; {len(step_times[sizes[0]])} steps per size; data written in "
              f"{made:.0f} s); one randperm: {randperm_ms(sizes[0]):.2f} ms vs {randperm_ms(sizes[1]):.2f} ms (the "
              "cost one full permutation per step would add)")


def long_section(work: Path, args: argparse.Namespace) -> None:
    from blockdraft.model.formats import checkpoint_key
    from blockdraft.reporter import Reporter
    from blockdraft.stages.train import checkpoint, metrics, run

    saves: dict[int, float] = {}
    stalls: dict[int, float] = {}
    sizes: dict[int, dict[str, int]] = {}
    draws: list[float] = []
    save, write, draw = checkpoint.Checkpoints.save, checkpoint.Checkpoints._write, metrics.draw_curves

    def timed_write(self, snapshot):  # on the background writer's thread
        t0 = time.perf_counter()
        written = write(self, snapshot)
        saves[snapshot.step] = time.perf_counter() - t0
        folder = self.store.child(checkpoint_key(snapshot.step)).local_path()
        sizes[snapshot.step] = {p.name: p.stat().st_size for p in folder.iterdir()}
        return written

    def timed_save(self, step, *rest, **kw):  # what the training thread waits for: the snapshot (and the push before)
        t0 = time.perf_counter()
        report = save(self, step, *rest, **kw)
        stalls[step] = time.perf_counter() - t0
        return report

    def timed_draw(*a, **kw):
        t0 = time.perf_counter()
        try:
            return draw(*a, **kw)
        finally:
            draws.append(time.perf_counter() - t0)

    checkpoint.Checkpoints.save, checkpoint.Checkpoints._write, metrics.draw_curves = (
        timed_save,
        timed_write,
        timed_draw,
    )
    data = write_rows(work / "long-data", DEMO_ROWS, args.row_len, seed=1)
    cfg = config(work, data, "long", max_steps=args.long_steps, checkpoint_every=args.checkpoint_every,
                 plot_every_minutes=args.plot_every_minutes)
    t0 = time.perf_counter()
    run(cfg, reporter=Reporter())
    wall = time.perf_counter() - t0
    checkpoint.Checkpoints.save, checkpoint.Checkpoints._write, metrics.draw_curves = save, write, draw

    ckpt = work / "long" / "ckpt"
    steps = sorted(saves)
    kept = sorted(int(p.name.removeprefix("step-")) for p in ckpt.iterdir() if any(p.iterdir()))

    def size(step: int) -> str:
        files = sizes[step]
        return (f"{sum(files.values()):,} B (metrics.jsonl {files.get('metrics.jsonl', 0):,} B, training-curves.png "
                f"{files.get('training-curves.png', 0):,} B)")

    step_times = [
        float(line.split('"step_time_s": ')[1].split(",")[0])
        for line in (work / "long" / "logs" / "metrics.jsonl").open()
    ]
    print(f"long run: {args.long_steps} steps, checkpoint every {args.checkpoint_every}, {len(steps)} checkpoints, "
          f"{wall:.0f} s; local log {len(step_times)} entries")
    steady = steps[2:]  # from the third on, pruning verifies the two older kept checkpoints every time
    print(f"  checkpoint time (write, push, verify, prune): first (step {steps[0]}) {saves[steps[0]]:.3f} s, last "
          f"(step {steps[-1]}) {saves[steps[-1]]:.3f} s; median of the first 5 from the third on "
          f"{statistics.median(saves[s] for s in steady[:5]):.3f} s, of the last 5 "
          f"{statistics.median(saves[s] for s in steady[-5:]):.3f} s")
    print("  training thread held per checkpoint (snapshot, waiting for the push before; the final one waits for its "
          f"own): median {statistics.median(stalls.values()):.3f} s, max {max(stalls.values()):.3f} s")
    print(f"  checkpoint size: first (step {steps[0]}) {size(steps[0])}; last (step {steps[-1]}) {size(steps[-1])}")
    print(f"  checkpoints left: {len(kept)} ({kept})")
    print(
        f"  median step: first 500 {statistics.median(step_times[:500]) * 1e3:.2f} ms, last 500 "
        f"{statistics.median(step_times[-500:]) * 1e3:.2f} ms; by tenth of the run (ms): "
        + " ".join(
            f"{statistics.median(step_times[i * len(step_times) // 10 : (i + 1) * len(step_times) // 10]) * 1e3:.1f}"
            for i in range(10)
        )
    )
    print("  checkpoint times by step (s): " + " ".join(f"{s}:{saves[s]:.3f}" for s in steps))
    print(f"  curves redrawn {len(draws)} times (every {args.plot_every_minutes} min and at the end), "
          f"longest {max(draws):.2f} s" if draws else "  curves never redrawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=["all", "rows", "long"], default="all")
    parser.add_argument("--steps", type=int, default=150, help="steps per run (rows)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per size (rows)")
    parser.add_argument("--row-len", type=int, default=48)
    parser.add_argument("--long-steps", type=int, default=20_000)
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--plot-every-minutes", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: tiny models, shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-train-scale-") as tmp:
        if args.section in ("all", "rows"):
            rows_section(Path(tmp), args)
        if args.section in ("all", "long"):
            long_section(Path(tmp), args)


if __name__ == "__main__":
    main()
