"""Our decode against vLLM serving the same export (`eval --engine vllm`), in float32 and in bfloat16, over several
drafters: how far the engine's per-position acceptance and tau fall from ours in each precision, which sets
`eval.engine_tolerance`.

Three drafters of the tiny target are trained on its own completions (one full-attention layer, one sliding-window
layer, two full-attention layers); each is evaluated on the fixture's 16 held-out prompts by
`blockdraft eval --engine vllm` with the target (our decode) and the export (the engine) in float32, then both in
bfloat16. Per run it prints the engine's and our drafts, accepted tokens per position, tau, the largest per-position
acceptance-rate gap, the relative tau gap, the engine's lossless count and its speedup beside ours. Needs `make engine`.

    .venv/bin/python -m bench.engine            # about 8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export as export_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train as train_stage

DRAFTERS = {
    "full-1": {"num_draft_layers": 1},
    "sliding-1": {"num_draft_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 16},
    "full-2": {"num_draft_layers": 2},
}


def sections(tmp: Path, drafter: str, steps: int, dtype: str | None = None) -> dict:
    fixture = json.loads((TINY_TARGET_DIR / "fixture.json").read_text())
    return {
        "target": {"path": str(TINY_TARGET_DIR), **({"dtype": dtype} if dtype else {})},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.0},
        "dflash": {"block_size": 8, "mask_token_id": fixture["mask_token_id"], "num_anchors": 32, **DRAFTERS[drafter]},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / f"run-{drafter}"),
                  "log_dir": str(tmp / f"logs-{drafter}"),
                  "max_steps": steps, "batch_size": 4, "global_batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05,
                  "checkpoint_every": steps, "seed": 0},
        "eval": {"num_prompts": 16, "max_new_tokens": 48, "prompts": str(TINY_TARGET_DIR / "prompts.jsonl"),
                 "engine": "vllm",
                 "untrained_baseline": False, "engine_python": str(Path(".venv-engine/bin/python").absolute())},
    }


def gaps(engine) -> tuple[float, float]:
    """(largest per-position acceptance-rate gap, relative tau gap) between the engine and our decode."""
    rate = [a / engine.drafts for a in engine.accepted_per_position]
    ours = [b / engine.ours_cycles for b in engine.ours_accepted_per_position]
    return max(abs(a - b) for a, b in zip(rate, ours)), abs(engine.tau - engine.ours_tau) / engine.ours_tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmpdir:
        tmp = Path(tmpdir)
        tokenize_stage.run(load_config(None, sections(tmp, "full-1", args.steps)),
                           str(TINY_TARGET_DIR / "completions.jsonl"), str(tmp / "tokenized"))
        for drafter in DRAFTERS:
            train_stage.run(load_config(None, sections(tmp, drafter, args.steps)))
            for dtype in ("float32", "bfloat16"):
                cfg = load_config(None, sections(tmp, drafter, args.steps, dtype))
                export = tmp / f"export-{drafter}-{dtype}"
                export_stage.run(cfg, str(tmp / f"run-{drafter}"), str(export))
                report = eval_stage.run(cfg, str(tmp / f"run-{drafter}"), str(tmp / f"eval-{drafter}-{dtype}"),
                                        export=str(export)).details
                e = report.engine
                assert e is not None
                rate_gap, tau_gap = gaps(e)
                print(json.dumps({
                    "drafter": drafter, "dtype": dtype, "engine_drafts": e.drafts, "ours_cycles": e.ours_cycles,
                    "engine_accepted": e.accepted_per_position, "ours_accepted": e.ours_accepted_per_position,
                    "engine_tau": round(e.tau, 4), "ours_tau": round(e.ours_tau, 4), "max_rate_gap": round(rate_gap, 4),
                    "tau_gap": round(tau_gap, 4),
                    "lossless_in_engine": f"{e.outputs_equal_target_only}/{e.num_prompts}",
                    "ours_lossless": report.lossless.ok, "engine_speedup": round(e.speedup, 3),
                    "ours_speedup": round(report.drafters["dflash"].speedup, 3), "agrees": e.disagreement is None,
                }), flush=True)


if __name__ == "__main__":
    main()
