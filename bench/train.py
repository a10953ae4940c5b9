"""Benchmark one DFlash training step as the trainer runs it (`accumulate`: drafter forward, chunked LM head + CE,
backward, clip; then AdamW) on random data.

Prints step time, context tokens/s and the achieved FLOP rate as a fraction of a plain GEMM measured in the same process
(and, on a GPU, MFU against the chip's bf16 dense peak). Attention FLOPs are those the kernel computes: every entry of
the dense [Q, S+Q] mask, or with `--attention flex` only the 128 x 128 tiles the block mask keeps. The target is not
run: its features are random, so the figures are the drafter side alone, which is what the drafter devices spend their
time on.

    python -m bench.train --preset cpu-small
    python -m bench.train --pipeline                          # target and drafter overlapped (bench/pipeline.py)
    python -m bench.train --preset qwen3-8b                   # on a GPU: 5 layers, H 4096, 32/8 heads, 512 anchors,
                                                              # B 16
    python -m bench.train --preset qwen3-8b --attention flex --flops-only   # the FLOPs a step counts, nothing run
    python -m bench.train --preset qwen3-8b --device cpu --hidden 128 --heads 4 --kv-heads 2 --intermediate 384 \\
        --vocab 2048 --seq-len 256 --anchors 32                  # the GPU path's code, checked at toy scale on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from blockdraft.model import DFlashDrafter, DrafterSpec, TargetHead
from blockdraft.model.block_sparse import TILE, resolve_attention
from blockdraft.stages.train.data import BlockBatch, anchor_generator, build_block_batch
from blockdraft.stages.train.step import DraftForward, MicroBatch, accumulate

PRESETS = {
    "cpu-small": dict(layers=2, hidden=256, heads=8, kv_heads=4, intermediate=768, vocab=8192, seq_len=512, anchors=64,
                      block_size=16, target_layers=28, num_features=2, device="cpu", steps=5),
    # The drafter shape published for Qwen3-8B: 5 layers, H 4096, 32 query / 8 KV heads of 128, MLP 12288, 151936 rows.
    "qwen3-8b": dict(layers=5, hidden=4096, heads=32, kv_heads=8, intermediate=12288, vocab=151936, seq_len=3072,
                     anchors=512, block_size=16, target_layers=36, num_features=5, device="cuda", steps=10),
}
# bf16 dense tensor-core peak by device name fragment (vendor data sheets), for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device`: the reference the step's rate is compared with."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_pairs(batch: BlockBatch) -> int:
    """The (query, key) pairs one layer's attention computes per head over the whole batch: every [Q, S+Q] entry of
    each row on the dense path; on the flex path only the tiles the block mask keeps (partial and full), TILE x TILE
    pairs each, since the kernel skips the others."""
    rows, queries = batch.anchors.shape[0], batch.anchors.shape[1] * batch.block_size
    if batch.attention == "dense":
        return rows * queries * (batch.input_ids.shape[1] + queries)
    mask = batch.layout.block_mask()
    assert mask.full_kv_num_blocks is not None  # the layout always lists its full tiles
    return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) * TILE * TILE


def step_flops(spec: DrafterSpec, rows: int, seq_len: int, queries: int, pairs: int) -> dict[str, float]:
    """Model FLOPs of one step over `rows` rows (no recomputation counted): trained matmuls x3 (forward, input and
    weight gradients), fc x2 (its input needs no gradient), attention x3 over the `pairs` (query, key) pairs its kernel
    computes (`attention_pairs`), LM head x2 (frozen: forward and input gradient)."""
    h, d, q, s = spec.hidden_size, spec.head_dim, queries, seq_len
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    per_layer = (
        2 * q * h * heads * d
        + 2 * 2 * (s + q) * h * kv * d
        + 2 * q * heads * d * h
        + 3 * 2 * q * h * spec.intermediate_size
    )
    attention = 2 * 2 * pairs * heads * d
    fc = 2 * s * spec.num_target_features * h * h
    lm_head = 2 * q * h * spec.vocab_size
    total = 3 * spec.num_layers * (rows * per_layer + attention) + rows * (2 * fc + 2 * lm_head)
    return {"total": float(total), "lm_head_share": rows * 2 * lm_head / total,
            "attention_share": 3 * spec.num_layers * attention / total}


def main() -> None:
    if "--pipeline" in sys.argv[1:]:  # the target and the drafter overlapped: bench/pipeline.py
        from bench.pipeline import main as pipeline_main

        pipeline_main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    for name in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "seq-len", "anchors", "block-size",
                 "steps"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--device")
    parser.add_argument("--chunk-blocks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto", help="as train.attention")
    parser.add_argument("--flops-only", action="store_true", help="print the FLOPs one step counts (dense or flex), "
                                                                  "run nothing")
    args = parser.parse_args()
    cfg = dict(PRESETS[args.preset])
    for key in cfg:
        value = getattr(args, key.replace("-", "_"), None)
        if value is not None:
            cfg[key] = value
    device = torch.device(cfg["device"])
    torch.manual_seed(0)

    spec = DrafterSpec(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], head_dim=cfg["hidden"] // cfg["heads"],
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, vocab_size=cfg["vocab"],
        block_size=cfg["block_size"], mask_token_id=cfg["vocab"] - 1,
        target_layer_ids=list(range(1, cfg["num_features"] + 1)), num_target_layers=cfg["target_layers"], gamma=7.0,
    )
    s, n = cfg["seq_len"], cfg["anchors"]
    rows = [(torch.randint(0, spec.vocab_size - 1, (s,)), torch.ones(s, dtype=torch.long)) for _ in range(args.batch)]
    attention = (
        args.attention if args.flops_only and args.attention != "auto" else resolve_attention(args.attention, device)
    )
    batch = build_block_batch(rows, num_anchors=n, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                              gamma=7.0,
                              generators=[anchor_generator(0, 0, i) for i in range(args.batch)], attention=attention)
    shares = step_flops(spec, args.batch, s, batch.anchors.shape[1] * spec.block_size, attention_pairs(batch))
    if args.flops_only:
        print(json.dumps({"preset": args.preset, "attention": attention, "tflops_per_step": shares["total"] / 1e12,
                          "attention_share": shares["attention_share"], "lm_head_share": shares["lm_head_share"]}))
        return
    batch = batch.to(device)
    drafter = DFlashDrafter(spec).to(device)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size).to(device, head_dtype)
    lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).to(device, head_dtype)
    head = TargetHead(embed, lm_head, device)
    model = DraftForward(drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    features = torch.randn(args.batch, s, spec.num_target_features * spec.hidden_size, device=device, dtype=head_dtype)
    micro = [MicroBatch(batch, features, tokens=args.batch * s)]

    def step() -> None:
        accumulate(model, drafter, head, micro, args.chunk_blocks, grad_clip=1.0, world_size=1)
        optimizer.step()

    step()  # warm-up: allocator, kernels, optimizer state
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    flops = shares["total"]
    gemm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm_n, gemm_repeats = (8192, 20) if device.type == "cuda" else (1024, 5)
    # Steps and GEMM bursts interleaved, so that a shared machine's load hits both alike; medians of each.
    times, gemms, fractions = [], [], []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        gemms.append(gemm_rate(device, gemm_dtype, gemm_n, gemm_repeats))
        fractions.append(flops / times[-1] / gemms[-1])
    step_s, gemm, fraction = (sorted(x)[len(x) // 2] for x in (times, gemms, fractions))
    achieved = flops / step_s
    result = {
        "preset": args.preset, "device": str(device), "attention": batch.attention,
        "torch_threads": torch.get_num_threads(), **cfg,
        "batch": args.batch, "params_m": sum(p.numel() for p in drafter.parameters()) / 1e6,
        "step_s": step_s, "tokens_per_s": args.batch * s / step_s,
        "queries_per_s": args.batch * batch.anchors.shape[1] * spec.block_size / step_s,
        "tflops_per_step": flops / 1e12, "lm_head_share": shares["lm_head_share"],
        "attention_share": shares["attention_share"], "achieved_tflops": achieved / 1e12, "gemm_tflops": gemm / 1e12,
        "fraction_of_gemm": fraction,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        result.update(gpu=name, peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                      mfu=achieved / peak if peak else None)
    print(json.dumps(result))
    print(
        f"{args.preset} on {device}: step {step_s * 1e3:.1f} ms, {result['tokens_per_s']:.0f} context tok/s, "
        f"{result['achieved_tflops']:.3f} TFLOP/s = {result['fraction_of_gemm']:.2f} of this process's {gemm_dtype} "
        "GEMM rate"
        + (f", MFU {result['mfu']:.3f}" if result.get("mfu") else "")
    )


if __name__ == "__main__":
    main()
