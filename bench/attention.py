"""Peak memory and time of one drafter training attention: the dense masked SDPA path against the block-sparse one.

One call as a training layer makes it (`blockdraft.model.drafter.attend`), mask building included: dense builds the
[b, 1, Q, S+Q] mask from the anchors (`block_attention_mask`), block-sparse builds the BlockMask from the same anchors
(`AnchorLayout.block_mask`) and runs compiled FlexAttention. Every row has `--seq-len` tokens, all supervised, and
`--anchors` sampled anchors of `--block-size` slots. Each path runs in a fresh process, warmed up first (the
FlexAttention kernel compiled at the measured shape), and reports what the call itself added: on the CPU the resident
high-water mark (reset just before the call through /proc/self/clear_refs) above the resident size then; on CUDA the
allocator's peak above what was allocated then. FlexAttention has no backward on the CPU, so `--backward` there measures
dense alone.

    python -m bench.attention --small                  # a self-check (about a minute, mostly compiling): outputs
                                                       # compared
    python -m bench.attention                          # 4096 tokens x 512 anchors x block 16, 32 query / 8 KV heads
                                                       # of 128
    python -m bench.attention --device cuda --backward # on a GPU: forward and backward, bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

FULL = dict(seq_len=4096, anchors=512, block_size=16, heads=32, kv_heads=8, head_dim=128)
SMALL = dict(seq_len=384, anchors=40, block_size=16, heads=4, kv_heads=2, head_dim=32)
PATHS = ("dense", "flex")


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))  # type: ignore[union-attr]


def _inputs(cfg: dict, rows: int, device: torch.device, dtype: torch.dtype, grad: bool, seed: int = 0):
    """Anchors [rows, N] and keep drawn as training draws them, and random q [rows, h, Q, d], k/v [rows, g, S+Q, d]."""
    from blockdraft.stages.train.data import anchor_generator, sample_anchors

    s, n, size = cfg["seq_len"], cfg["anchors"], cfg["block_size"]
    drawn = [sample_anchors(torch.ones(s, dtype=torch.bool), n, anchor_generator(seed, 0, r)) for r in range(rows)]
    anchors = torch.stack([a for a, _ in drawn]).to(device)
    keep = torch.stack([k for _, k in drawn]).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    q_len = n * size

    def rand(heads: int, length: int) -> torch.Tensor:
        return torch.randn(
            rows, heads, length, cfg["head_dim"], generator=g, device=device, dtype=dtype
        ).requires_grad_(grad)

    return anchors, keep, rand(cfg["heads"], q_len), rand(cfg["kv_heads"], s + q_len), rand(cfg["kv_heads"], s + q_len)


def measure(path: str, cfg: dict, rows: int, device: torch.device, backward: bool, window: int | None) -> dict:
    """One path's call in this process: seconds, the memory it added (MiB), the mask's own size, an output checksum."""
    from blockdraft.model.block_sparse import AnchorLayout
    from blockdraft.model.drafter import attend
    from blockdraft.stages.train.data import block_attention_mask

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = cfg["block_size"]

    def call(anchors, keep, q, k, v):
        s = k.shape[2] - q.shape[2]
        if path == "dense":
            mask = block_attention_mask(anchors, keep, s, size, sliding_window=window)
            mask_bytes = mask.numel() * mask.element_size()
        else:
            mask = AnchorLayout(anchors, keep, s, size).block_mask(window)
            mask_bytes = sum(t.numel() * t.element_size() for t in vars(mask).values() if isinstance(t, torch.Tensor))
        out = attend(q, k, v, mask)
        if backward:
            out.backward(torch.ones_like(out))
        return out.detach(), mask_bytes

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warm = cfg if path == "flex" else dict(cfg, seq_len=64, anchors=4)  # flex compiles at the measured shape
    call(*_inputs(warm, rows, device, dtype, backward, seed=1))
    inputs = _inputs(cfg, rows, device, dtype, backward)
    gc.collect()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    t0 = time.perf_counter()
    out, mask_bytes = call(*inputs)
    sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status_kib("VmHWM") * 1024
    return {
        "path": path, "seconds": seconds, "peak_added_mib": (peak - before) / 2**20, "mask_mib": mask_bytes / 2**20,
        "output_mib": out.numel() * out.element_size() / 2**20, "checksum": float(out.double().sum()),
        "abs_sum": float(out.double().abs().sum()),
    }


def _child(args: argparse.Namespace) -> dict:
    """Run `args.path` in a fresh interpreter and read back its JSON line."""
    cmd = [sys.executable, "-m", "bench.attention", "--path", args.path, "--device", args.device, "--rows",
           str(args.rows), *(["--small"] if args.small else []), *(["--backward"] if args.backward else []),
           *(["--window", str(args.window)] if args.window else [])]
    for key in FULL:
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    # glibc serves blocks of 64 KiB and up from their own mappings, returned on free: the resident size then follows
    # what torch holds, instead of hiding small buffers in heap pages an earlier call left behind
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        return {"path": args.path, "error": (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a small shape, for a quick self-check")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=1, help="rows in the batch")
    parser.add_argument("--backward", action="store_true", help="forward and backward (dense only on the CPU)")
    parser.add_argument("--window", type=int, help="a sliding layer's window (default: a full-attention layer)")
    parser.add_argument("--path", choices=PATHS, help="measure one path in this process (what the parent runs)")
    for key in FULL:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int)
    args = parser.parse_args()
    cfg = dict(SMALL if args.small else FULL)
    cfg.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    device = torch.device(args.device)
    if args.path:
        print(json.dumps(measure(args.path, cfg, args.rows, device, args.backward, args.window)))
        return

    q_len, kv_len = cfg["anchors"] * cfg["block_size"], cfg["seq_len"] + cfg["anchors"] * cfg["block_size"]
    print(f"{args.rows} x [{q_len} queries, {kv_len} keys], {cfg['heads']}/{cfg['kv_heads']} heads of "
          f"{cfg['head_dim']}, {'sliding ' + str(args.window) if args.window else 'full attention'}, "
          f"{'forward+backward' if args.backward else 'forward'}, {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    results = {}
    for path in PATHS:
        if path == "flex" and args.backward and device.type != "cuda":
            results[path] = {"path": path, "error": "FlexAttention has no CPU backward in torch"}
        else:
            results[path] = _child(argparse.Namespace(**{**vars(args), "path": path}))
        r = results[path]
        if "error" in r:
            print(f"{path:>5}: not measured ({r['error']})")
        else:
            print(f"{path:>5}: {r['seconds']:.3f} s, peak +{r['peak_added_mib']:.1f} MiB (mask {r['mask_mib']:.2f} "
                  f"MiB, output {r['output_mib']:.1f} MiB)")
    dense, flex = results["dense"], results["flex"]
    if "error" not in dense and "error" not in flex:
        agree = abs(dense["checksum"] - flex["checksum"]) / max(dense["abs_sum"], 1e-12)
        print(f"flex / dense: peak {flex['peak_added_mib'] / dense['peak_added_mib']:.3f}, time "
              f"{flex['seconds'] / dense['seconds']:.3f}; outputs agree to {agree:.1e} of their magnitude")
        if args.small and agree > 1e-4:
            sys.exit(f"dense and flex outputs differ: {agree:.1e} of their magnitude")
    print(json.dumps({"config": cfg, "rows": args.rows, "backward": args.backward, "window": args.window, **results}))


if __name__ == "__main__":
    main()
