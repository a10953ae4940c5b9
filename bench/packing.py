"""The target's forward over a training micro-batch three ways: padded rows, one forward over the packed sequences,
and packed rows run one by one (what `train.packing` does on SDPA and eager attention).

Each micro-batch is `--rows` rows drawn with a fixed seed from a tokenized artifact (the demo's rows: `--data`, the
train split of a `tokenize` output), laid out by `build_block_batch(..., pack_to=max_length)` as training lays them out,
and run through `TargetModel` as the trainer runs it: `features(ids, mask)` for padded rows, `packed(...)` with
`one_forward` True or False for packed ones. The three ways take turns on each micro-batch (`--repeats` times, the first
discarded as warm-up), so machine noise falls on all of them alike; it prints each way's median milliseconds per
micro-batch, the ratio of padded to each, the padding share of the padded forward and the largest difference of the
packed ways' features from the padded ones at the rows' tokens (a share of the largest feature: rounding, in bf16).

    .venv/bin/python -m bench.packing --target .cache/real-target/smollm2-135m-instruct --data DEMO/store/tokenized
    .venv/bin/python -m bench.packing --target tiny --data TOKENIZED --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path


def time_ways(target, batch, repeats: int, ways: dict[str, list[float]]) -> float:
    """Run `batch` through `target` the three ways `repeats` times in turn, adding each run's milliseconds but the
    first's to `ways`; returns the largest difference of the packed ways' features from the padded ones, as a share of
    the padded features' largest magnitude."""
    import torch

    packed, real = batch.packed, batch.attention_mask_context
    assert packed is not None
    runs = {
        "padded": lambda: target.features(batch.input_ids, real.long()),
        "one packed forward": lambda: packed.unpack(
            target.packed(packed.input_ids, packed.positions, False, packed.real, True)[0]),
        "rows one by one": lambda: packed.unpack(
            target.packed(packed.input_ids, packed.positions, False, packed.real, False)[0]),
    }
    worst = 0.0
    for repeat in range(repeats):
        out: dict[str, torch.Tensor] = {}
        for name, run in runs.items():
            began = time.perf_counter()
            out[name] = run()
            if repeat:
                ways[name].append(1000 * (time.perf_counter() - began))
        scale = float(out["padded"][real].abs().max())
        for name in ("one packed forward", "rows one by one"):
            worst = max(worst, float((out[name][real] - out["padded"][real]).abs().max()) / scale)
    return worst


def main() -> None:
    import torch
    from datasets import Dataset

    from blockdraft.fixtures.tiny import TINY_TARGET_DIR
    from blockdraft.model import TargetModel, load_target
    from blockdraft.model.spec import TargetShape
    from blockdraft.stages.train.data import anchor_generator, build_block_batch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny", help="a target folder, or 'tiny' (the tiny Qwen3 fixture)")
    parser.add_argument("--data", required=True, help="a tokenize output folder (its train split is read)")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch (train.batch_size)")
    parser.add_argument("--batches", type=int, default=8, help="micro-batches drawn")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way per micro-batch (the first: warm-up)")
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the target config's)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = TINY_TARGET_DIR if args.target == "tiny" else Path(args.target)
    hf = load_target(str(folder), "cpu", args.dtype)
    shape = TargetShape.from_config(hf.config)
    target = TargetModel(hf, sorted({1, shape.num_layers // 2, shape.num_layers - 2}))
    rows = Dataset.load_from_disk(str(Path(args.data) / "train"))
    picked = random.Random(0).sample(range(len(rows)), args.rows * args.batches)
    ways = {"padded": [], "one packed forward": [], "rows one by one": []}
    padding, worst = [], 0.0
    for k in range(args.batches):
        chosen = picked[k * args.rows : (k + 1) * args.rows]
        batch = build_block_batch(
            [(rows[i]["input_ids"], rows[i]["loss_mask"]) for i in chosen], num_anchors=32, block_size=8,
            mask_token_id=0, gamma=4.0, generators=[anchor_generator(0, 0, i) for i in chosen],
            pack_to=args.max_length,
        )
        padding.append(1 - batch.num_tokens / batch.input_ids.numel())
        worst = max(worst, time_ways(target, batch, args.repeats, ways))
    medians = {name: statistics.median(times) for name, times in ways.items()}
    print(f"target {folder.name} ({hf.dtype}), {args.batches} micro-batches of {args.rows} rows, {args.threads} "
          f"thread(s); padding share of the padded forward {statistics.fmean(padding):.3f}")
    for name, ms in medians.items():
        print(f"  {name:<20} {ms:8.1f} ms   padded / this {medians['padded'] / ms:.2f}x")
    print(f"  largest feature difference from padded at the rows' tokens: {worst:.1e} of the largest feature")


if __name__ == "__main__":
    main()
