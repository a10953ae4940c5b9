"""Speculative decoding vs target-only greedy on a small CPU target: tau, tokens/s and wall-clock speedup, for the
DFlash drafter, the n-gram baseline and an untrained drafter, all on the same prompts in the same process.

    .venv/bin/python bench/eval.py [--target DIR] [--drafter DIR] [--prompts 8] [--max-new-tokens 64] [--repeats 3] [--threads 1]

Defaults: the golden tiny target and its briefly trained drafter (tests/fixtures/dflash-golden), on two prompt sets:
`golden`, the four prompts whose continuations the drafter was trained on (24 new tokens, as in golden.json), and
`random`, seeded random token ids it never saw (--max-new-tokens). Each repeat runs every prompt through greedy and each drafter in turn (interleaved, so machine noise hits
all paths alike); the figures are from the repeat with the fastest greedy run, and speedup = greedy wall / spec wall
within that repeat. Every run is also checked token for token against greedy: a bench never reports a lossy speedup.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "fixtures" / "dflash-golden"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(GOLDEN / "target"))
    parser.add_argument("--drafter", default=str(GOLDEN / "drafter"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: tiny models, shared cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from blockdraft.model.drafter import DFlashDrafter
    from blockdraft.model.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target, "cpu", torch.float32)
    drafter = DFlashDrafter.from_pretrained(args.drafter).eval()
    rng = random.Random(args.seed)
    vocab = drafter.spec.vocab_size
    prompt_sets = {}
    if Path(args.drafter) == GOLDEN / "drafter":  # the golden prompts mean something only to the golden drafter
        golden = json.loads((GOLDEN / "golden.json").read_text())["decode"]
        prompt_sets["golden"] = ([case["prompt"] for case in golden], 24)
    prompt_sets["random"] = ([[rng.randrange(vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.prompts)], args.max_new_tokens)
    for label, (prompts, max_new_tokens) in prompt_sets.items():
        report_set(label, target, drafter, prompts, max_new_tokens, args.repeats, args.threads)


def report_set(label, target, drafter, prompts, max_new_tokens, repeats, threads) -> None:
    from blockdraft.decode.eval import evaluate

    runs = []
    for _ in range(repeats):
        report = evaluate(target, drafter, prompts, max_new_tokens, stops=[], tolerance=1e-4)
        assert report["lossless"]["ok"], report["lossless"]
        runs.append(report)
    best = min(runs, key=lambda r: r["greedy"]["wall_s"])
    greedy = best["greedy"]
    print(f"\n[{label}] {len(prompts)} prompts x {max_new_tokens} new tokens, B={best['block_size']}, {threads} thread(s), "
          f"best of {repeats}")
    print(f"{'path':10} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'fwd/tok':>8} {'draft%':>7} {'exact':>6}")
    print(f"{'greedy':10} {'-':>6} {greedy['tokens_per_s']:8.1f} {1.0:8.2f} {greedy['target_forwards_per_token']:8.3f} {'-':>7} {'-':>6}")
    exact = {name: not any(d["drafter"] == name for d in best["lossless"]["divergences"]) for name in best["drafters"]}
    for name, m in best["drafters"].items():
        share = m["draft_s"] / max(m["draft_s"] + m["verify_s"], 1e-12)
        print(f"{name:10} {m['tau']:6.3f} {m['tokens_per_s']:8.1f} {m['speedup']:8.2f} {m['target_forwards_per_token']:8.3f} "
              f"{100 * share:6.1f}% {str(exact[name]):>6}")
    speedups = {name: [round(r["drafters"][name]["speedup"], 2) for r in runs] for name in best["drafters"]}
    print("speedup per repeat:", json.dumps(speedups))


if __name__ == "__main__":
    main()
