"""The target's features for training micro-batches two ways: the trainer's own forward (`TargetModel.features` on the
padded rows, as `train.target_engine = "hf"` runs it) and a vLLM feature server (`EngineFeatures.features`, as
`train.target_engine = "vllm"` runs it: each row a prefill-only request, four in flight, its file read, checked and
deleted).

Micro-batches are `--rows` rows drawn with a fixed seed from a tokenized artifact's train split. The two ways take turns
on each micro-batch (`--repeats` times, the first discarded as warm-up), so machine noise falls on both alike; it prints
the fixed costs apart (loading the target in process, starting the engine until it answers) and then each way's median
milliseconds per micro-batch, real tokens per second and the ratio, and the largest difference of the engine's features
from the trainer's at the rows' tokens. The trainer's forward runs with `--threads` torch threads; the engine takes the
machine's cores as vLLM's CPU backend does.

    .venv/bin/python -m bench.engine_features                                # the tiny target (after make engine)
    .venv/bin/python -m bench.engine_features --target .cache/real-target/smollm2-135m-instruct --data D \
        --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch
    from datasets import Dataset

    from blockdraft.config import EvalConfig
    from blockdraft.engine_process import engine_python, free_port, serving
    from blockdraft.fixtures.tiny import TINY_TARGET_DIR
    from blockdraft.model import TargetModel, load_target
    from blockdraft.model.spec import TargetShape
    from blockdraft.model.target import load_target_config, target_dtype
    from blockdraft.stages.train.engine_features import EngineFeatures, feature_server_argv, feature_server_env

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny", help="a target folder, or 'tiny' (the tiny Qwen3 fixture)")
    parser.add_argument("--data", default="tiny", help="a tokenize output folder (its train split is read), or 'tiny' "
                                                       "(the tiny target's completions, tokenized here)")
    parser.add_argument("--device", default="cpu", help="the trainer's target device (on cuda the engine gets half "
                                                        "the GPU's memory)")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch (train.batch_size)")
    parser.add_argument("--batches", type=int, default=8, help="micro-batches drawn")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way per micro-batch (the first: warm-up)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the target config's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the trainer's own forward")
    parser.add_argument("--engine-python", default=".venv-engine/bin/python")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = TINY_TARGET_DIR if args.target == "tiny" else Path(args.target)
    dtype = target_dtype(args.dtype, load_target_config(str(folder)))
    if args.data == "tiny":
        from blockdraft.config import load_config
        from blockdraft.stages import tokenize

        scratch = tempfile.TemporaryDirectory(prefix="blockdraft-bench-tokenized-")  # removed at exit
        settings = {"target": {"path": str(TINY_TARGET_DIR)}, "store": {"url": f"{scratch.name}/store"},
                    "tokenize": {"held_out_fraction": 0.0}}
        args.data = f"{scratch.name}/tokenized"
        tokenize.run(load_config(None, settings), str(TINY_TARGET_DIR / "completions.jsonl"), args.data)
    began = time.perf_counter()
    hf = load_target(str(folder), args.device, dtype)
    load_s = time.perf_counter() - began
    shape = TargetShape.from_config(hf.config)
    layer_ids = sorted({1, shape.num_layers // 2, shape.num_layers - 2})
    own = TargetModel(hf, layer_ids)
    rows = Dataset.load_from_disk(str(Path(args.data) / "train"))
    picked = random.Random(0).sample(range(len(rows)), args.rows * args.batches)
    batches = []
    for k in range(args.batches):
        chosen = [rows[i]["input_ids"] for i in picked[k * args.rows : (k + 1) * args.rows]]
        width = max(map(len, chosen))
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(chosen):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        batches.append((ids.to(args.device), mask.to(args.device)))
    tokens = sum(int(mask.sum()) for _, mask in batches)
    python = engine_python(EvalConfig(engine="vllm", engine_python=args.engine_python))
    with tempfile.TemporaryDirectory(prefix="blockdraft-bench-features-") as tmp:
        longest = max(int(mask.sum(dim=1).max()) for _, mask in batches) + 1
        extra = ["--gpu-memory-utilization", "0.5"] if args.device.startswith("cuda") else []
        argv = feature_server_argv(python, str(folder), free_port(), dtype, longest, layer_ids, Path(tmp) / "features",
                                   extra)
        began = time.perf_counter()
        with serving(argv, Path(tmp), "features", EvalConfig(), feature_server_env()) as server:
            start_s = time.perf_counter() - began
            engine = EngineFeatures(server, layer_ids, shape.hidden_size, getattr(torch, dtype))
            ways: dict[str, list[float]] = {"trainer's forward": [], "vLLM feature server": []}
            runs = {"trainer's forward": own.features, "vLLM feature server": engine.features}
            worst, scale = 0.0, 0.0
            for ids, mask in batches:
                for repeat in range(args.repeats):
                    out = {}
                    for name, run in runs.items():
                        t0 = time.perf_counter()
                        out[name] = run(ids, mask)
                        if repeat:
                            ways[name].append(1000 * (time.perf_counter() - t0))
                    real = mask.bool().cpu()
                    a = out["trainer's forward"].cpu()[real].float()
                    b = out["vLLM feature server"].cpu()[real].float()
                    worst, scale = max(worst, float((a - b).abs().max())), max(scale, float(a.abs().max()))
    per_batch = tokens / args.batches
    medians = {name: statistics.median(times) for name, times in ways.items()}
    print(f"target {folder.name} ({dtype}), layers {layer_ids}, {args.batches} micro-batches of {args.rows} rows "
          f"({per_batch:.0f} real tokens each), trainer's forward on {args.threads} thread(s)")
    print(f"  fixed: target loaded in process {load_s:.1f} s; engine started and answering {start_s:.1f} s")
    for name, ms in medians.items():
        print(f"  {name:<20} {ms:8.1f} ms per micro-batch   {1000 * per_batch / ms:10,.0f} tokens/s   "
              f"trainer's / this {medians[next(iter(medians))] / ms:.2f}x")
    print(f"  largest feature difference: {worst:.1e} ({worst / scale:.1e} of the largest feature)")


if __name__ == "__main__":
    main()
