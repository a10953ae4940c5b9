"""Speculative decoding vs target-only greedy on small CPU targets: tau, tokens/s and wall-clock speedup, for the
DFlash drafter, the n-gram baseline and an untrained drafter, all on the same prompts in the same process.

    .venv/bin/python -m bench.eval [--suite all|golden|tiny|hybrid] [--repeats 3] [--threads 1] [--train-steps 300]

Suites:
- `golden`: the golden tiny target (8 layers, hidden 64) and its briefly trained drafter (tests/fixtures/dflash-golden,
  B=4), on `golden`, the four prompts whose continuations the drafter was trained on (24 new tokens, as in golden.json),
  and on `random`, seeded random token ids it never saw (--max-new-tokens).
- `tiny`: the tiny target fixture (8 layers, hidden 128, src/blockdraft/assets/tiny-target). A drafter (2 layers, B=8)
  is trained here on the target's own completions (tokenize + train, --train-steps), then evaluated on held-out prompts
  from prompts.jsonl (chat template, stop at <|im_end|>).
- `hybrid`: the same on the tiny hybrid target (src/blockdraft/assets/tiny-hybrid-target: Qwen3.5-style, Gated DeltaNet
  linear attention with full attention every 4th layer), with a drafter of one sliding-window and one full-attention
  layer; the `rollbk%` column is the share of the cycle spent rolling the linear-attention state back after partial
  acceptances.
Each repeat runs every prompt through greedy and each drafter in turn (interleaved, so machine noise hits all paths
alike); the figures are from the repeat with the fastest greedy run, and speedup = greedy wall / spec wall within that
repeat. Every run is also checked token for token against greedy: a bench never reports a lossy speedup.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from blockdraft.fixtures.tiny import TINY_TARGET_DIR

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "fixtures" / "dflash-golden"
TINY = TINY_TARGET_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["all", "golden", "tiny", "hybrid"], default="all")
    parser.add_argument("--prompts", type=int, default=8, help="random prompts (golden suite)")
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="random prompts (golden suite)")
    parser.add_argument("--tiny-prompts", type=int, default=16)
    parser.add_argument("--tiny-max-new-tokens", type=int, default=160)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: tiny models, shared cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.suite in ("all", "golden"):
        golden_suite(args)
    if args.suite in ("all", "tiny"):
        tiny_suite(args, TINY, "tiny", {"num_draft_layers": 2})
    if args.suite in ("all", "hybrid"):
        from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR

        sliding = {"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32}
        tiny_suite(args, TINY_HYBRID_TARGET_DIR, "hybrid", sliding)


def golden_suite(args) -> None:
    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.model.target import load_target

    target = load_target(str(GOLDEN / "target"), "cpu", torch.float32)
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()
    rng = random.Random(args.seed)
    vocab = drafter.spec.vocab_size
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"]
    prompt_sets = {
        "golden": ([case["prompt"] for case in golden], 24),
        "random": ([[rng.randrange(vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.prompts)],
                   args.max_new_tokens),
    }
    for label, (prompts, max_new_tokens) in prompt_sets.items():
        report_set(label, target, drafter, prompts, max_new_tokens, [], args.repeats, args.threads)


def tiny_suite(args, target_dir: Path, label: str, drafter: dict) -> None:
    from blockdraft.config import load_config
    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.model.formats import find_resumable
    from blockdraft.model.target import load_target
    from blockdraft.stages import tokenize as tokenize_stage
    from blockdraft.stages import train as train_stage
    from blockdraft.stages.eval.prompts import load_target_tokenizer, prompts_from_jsonl, stop_token_ids
    from blockdraft.store import open_store

    fixture = json.loads((target_dir / "fixture.json").read_text())
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        work = Path(tmp)
        base = {"target": {"path": str(target_dir)}, "store": {"url": str(work / "store")},
                "tokenize": {"held_out_fraction": 0.0}}
        tokenize_stage.run(load_config(None, base), str(target_dir / "completions.jsonl"), str(work / "tokenized"))
        cfg = load_config(None, {
            **base,
            "dflash": {"block_size": 8, "mask_token_id": fixture["mask_token_id"], "num_anchors": 32, **drafter},
            "train": {"data": str(work / "tokenized"), "output": str(work / "run"), "log_dir": str(work / "logs"),
                      "max_steps": args.train_steps, "batch_size": 4, "global_batch_size": 4, "lr": 3e-3,
                      "warmup_ratio": 0.05, "checkpoint_every": args.train_steps, "seed": args.seed},
        })
        started = time.perf_counter()
        train_stage.run(cfg)
        print(f"\n[{label}] trained a drafter {drafter} (B=8) for {args.train_steps} steps in "
              f"{time.perf_counter() - started:.0f} s")
        found = find_resumable(open_store(work / "run"))
        drafter = DFlashDrafter.from_pretrained(found.store.local_path()).eval()
    target = load_target(str(target_dir), "cpu", torch.float32)
    tokenizer = load_target_tokenizer(cfg.target)
    prompts = prompts_from_jsonl(target_dir / "prompts.jsonl", tokenizer, cfg, args.tiny_prompts)
    stops = stop_token_ids(target, tokenizer)
    report_set(label, target, drafter, prompts, args.tiny_max_new_tokens, stops, args.repeats, args.threads)


def report_set(label, target, drafter, prompts, max_new_tokens, stops, repeats, threads) -> None:
    from blockdraft.stages.eval import evaluate

    runs = []
    for _ in range(repeats):
        report = evaluate(target, drafter, prompts, max_new_tokens, stops=stops, tolerance=1e-4)
        assert report.lossless.ok, report.lossless
        runs.append(report)
    best = min(runs, key=lambda r: r.greedy.wall_s)
    greedy = best.greedy
    print(f"\n[{label}] {len(prompts)} prompts x up to {max_new_tokens} new tokens, B={best.block_size}, {threads} "
          f"thread(s), best of {repeats}")
    print(
        f"{'path':10} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'fwd/tok':>8} {'draft%':>7} {'rollbk%':>7} {'exact':>6}"
    )
    print(f"{'greedy':10} {'-':>6} {greedy.tokens_per_s:8.1f} {1.0:8.2f} {greedy.target_forwards_per_token:8.3f} "
          f"{'-':>7} {'-':>7} {'-':>6}")
    exact = {name: not any(d.drafter == name for d in best.lossless.divergences) for name in best.drafters}
    for name, m in best.drafters.items():
        # draft% and rollbk% (part of the verify) are shares of the cycle time
        cycle_s = max(m.draft_s + m.verify_s, 1e-12)
        print(f"{name:10} {m.tau:6.3f} {m.tokens_per_s:8.1f} {m.speedup:8.2f} {m.target_forwards_per_token:8.3f} "
              f"{100 * m.draft_s / cycle_s:6.1f}% {100 * m.rollback_s / cycle_s:6.1f}% {str(exact[name]):>6}")
    speedups = {name: [round(r.drafters[name].speedup, 2) for r in runs] for name in best.drafters}
    print("speedup per repeat:", json.dumps(speedups))


if __name__ == "__main__":
    main()
