"""What the training signal costs (docs/TRAINING-SIGNAL.md): the held-out measurement and a checkpoint's real decode, as
a share of training time at the defaults (train.eval_every 100, train.eval_rows 32, train.decode_eval_prompts 2 every
train.checkpoint_every 500 steps, train.global_batch_size 32), measured in one training run on the tiny target.

The run trains `--steps` steps with the held-out sample measured every `--measure-every` steps and the final checkpoint
decoded; each measurement's seconds and the mean step time (both from metrics.jsonl) give the share at the defaults:
measure_s / (eval_every x step_s), and decode_s / (checkpoint_every x step_s).

    python -m bench.training_signal --steps 20 --measure-every 5
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from blockdraft.config import TrainConfig, load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.pipeline import SIZES, demo_config, write_toml
from blockdraft.reporter import Reporter
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train as train_stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--measure-every", type=int, default=5)
    args = parser.parse_args()
    defaults = TrainConfig()
    with tempfile.TemporaryDirectory(prefix="bench-signal-") as tmp:
        root = Path(tmp)
        sections = demo_config(root, str(root / "store"), SIZES["ci"])
        sections["tokenize"]["held_out_fraction"] = 0.2
        sections["train"].update(
            data=str(root / "tokenized"), max_steps=args.steps, checkpoint_every=args.steps,
            eval_every=args.measure_every,
            batch_size=defaults.batch_size, global_batch_size=defaults.global_batch_size, eval_rows=defaults.eval_rows,
            decode_eval_prompts=defaults.decode_eval_prompts, log_every=1,
        )
        sections["dflash"]["num_anchors"] = 64
        write_toml(root / "blockdraft.toml", sections)
        cfg = load_config(root / "blockdraft.toml")
        (root / "in").mkdir()
        (root / "in" / "completions.jsonl").write_text((TINY_TARGET_DIR / "completions.jsonl").read_text())
        tokenize_stage.run(cfg, str(root / "in"), str(root / "tokenized"))
        reporter = Reporter()
        train_stage.run(cfg, reporter=reporter)
        entries = [json.loads(line) for line in (root / "train-logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step_time_s"] for e in entries[1:]]  # the first step carries one-time costs
    step_s = sum(steps) / len(steps)
    measures = [e["eval"]["seconds"] for e in entries if "eval" in e]
    measure_s = sum(measures) / len(measures)
    decode_s = next(float(m.group(1)) for line in reporter.lines if (m := re.search(r"decoded on .*\((\d+\.\d+)s\)$",
                                                                                    line)))
    result = {
        "step_s": round(step_s, 4), "held_out_measure_s": round(measure_s, 4), "decode_s": round(decode_s, 3),
        "held_out_share_at_defaults": round(measure_s / (defaults.eval_every * step_s), 4),
        "decode_share_at_defaults": round(decode_s / (defaults.checkpoint_every * step_s), 4),
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
