"""What `eval --engine` gains on a machine without CUDA by starting its two servers (with the drafter, target-only) side
by side rather than one after the other.

Each round starts two servers of the tiny target with `serving_together` (the product's own launch, health wait and
stop), once both in one call (side by side) and once in two calls (one after the other), in alternating order, and times
the fixed cost: launch to both healthy. The requests are not timed: they run one server at a time either way. Needs
`make engine`.

    .venv/bin/python -m bench.engine_pair --rounds 3    # about 4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from blockdraft.config import EvalConfig
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.eval.engine import free_argv, serving_together

NAMES = ("drafter", "target-only")  # two target-only servers here: the start, not the drafter, is what is timed


def start_both(cfg: EvalConfig, workdir: Path, together: bool) -> float:
    """Seconds spent starting both servers: launch to every server of a call healthy, summed over the calls (one call
    together, else one per server, each stopped before the next starts)."""
    argvs = {
        name: free_argv(Path(cfg.engine_python), "vllm", str(TINY_TARGET_DIR), "float32", 512, None, [])
        for name in NAMES
    }
    groups = [list(NAMES)] if together else [[name] for name in NAMES]
    seconds = 0.0
    for group in groups:
        launched = time.perf_counter()
        with serving_together({name: argvs[name] for name in group}, workdir, cfg):
            seconds += time.perf_counter() - launched
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = EvalConfig(engine="vllm", engine_python=str(Path(".venv-engine/bin/python").absolute()))
    ways = {"side by side": True, "one after the other": False}
    seen: dict[str, list[float]] = {way: [] for way in ways}
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-engine-pair-") as tmp:
        for r in range(args.rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for way in order:
                seconds = start_both(cfg, Path(tmp), ways[way])
                seen[way].append(seconds)
                print(json.dumps({"round": r, "way": way, "both_healthy_s": round(seconds, 2)}), flush=True)
    median = {way: statistics.median(values) for way, values in seen.items()}
    print(json.dumps({"median_both_healthy_s": median,
                      "ratio": round(median["side by side"] / median["one after the other"], 3),
                      "load_average_after": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
