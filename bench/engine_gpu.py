"""The engine checks that need a GPU machine (bench/gpu_check.sh runs them), each through the CLI users run: `blockdraft
tokenize`, `train` and `eval --engine` on a tiny target, then the report's engine section printed. Neither has run yet
in this project: no GPU machine has run gpu_check.sh since they were written, so their first run is also the first test
of this script.

- `hybrid-vllm`: the tiny Qwen3.5-style hybrid target with a drafter of the published Qwen3.6 drafter's shape (four
  sliding-window layers, then one full-attention layer), served by vLLM with the V2 model runner
  (`VLLM_USE_V2_MODEL_RUNNER=1`). vLLM 0.32's V1 runner refuses drafters that mix sliding and full layers, and the V2
  runner needs Triton, so this cannot run on vLLM's CPU build (docs/HYBRID.md, "In the engine"). The target is
  copied with a `preprocessor_config.json` (its image processor's patch sizes, from the target's vision config), which
  vLLM's Qwen3.5 loader asks for; the vision tower is kept out of the engine's memory profiling
  (`--limit-mm-per-prompt`), since the eval sends text only. bf16: vLLM runs Gated DeltaNet in bf16.
- `sglang`: the tiny dense target with a one-layer drafter, served by SGLang (`eval --engine sglang`), in bf16 (the
  dtype SGLang's GPU attention backends take).
- `dflash2-vllm`, `dflash2-sglang`: the tiny dense target with a DFlash2 drafter (`dflash.architecture = "dflash2"`, the
  published drafter's taps, groups and top-K, a smaller selector rank), trained and exported by the same commands,
  served by vLLM's V2 model runner (the only one that serves DFlash2: its candidate walk is a Triton kernel) and by
  SGLang.

    python -m bench.engine_gpu hybrid-vllm --engine-python .venv-engine/bin/python [--workdir DIR] [--steps N]
    python -m bench.engine_gpu sglang --engine-python .venv-sglang/bin/python
    python -m bench.engine_gpu dflash2-vllm --engine-python .venv-engine/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from blockdraft.config import EvalConfig
from blockdraft.errors import EngineError
from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.pipeline import write_toml
from blockdraft.stages.eval.engine import engine_python
from blockdraft.stages.eval.report import EngineCheck, engine_lines

PUBLISHED_SHAPE = {"num_draft_layers": 5, "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
                   "sliding_window": 32}
CHECKS: dict[str, dict[str, Any]] = {
    "hybrid-vllm": {"target": TINY_HYBRID_TARGET_DIR, "engine": "vllm", "block_size": 16, "drafter": PUBLISHED_SHAPE,
                    "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"},
                    "engine_args": ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})]},
    "sglang": {"target": TINY_TARGET_DIR, "engine": "sglang", "block_size": 8, "drafter": {"num_draft_layers": 1},
               "env": {}, "engine_args": []},
}
DFLASH2_DRAFTER = {"num_draft_layers": 1, "architecture": "dflash2", "selector_rank": 64}
CHECKS["dflash2-vllm"] = {"target": TINY_TARGET_DIR, "engine": "vllm", "block_size": 8, "drafter": DFLASH2_DRAFTER,
                          "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "engine_args": []}
CHECKS["dflash2-sglang"] = {**CHECKS["sglang"], "drafter": DFLASH2_DRAFTER}


def with_processor_config(target: Path, dest: Path) -> Path:
    """A copy of the hybrid target with the `preprocessor_config.json` vLLM's Qwen3.5 loader reads: an image processor
    whose patch, merge and temporal sizes are the target's vision config's."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(target, dest)
    vision = json.loads((target / "config.json").read_text())["vision_config"]
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    processor = {
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch, "merge_size": merge, "temporal_patch_size": vision["temporal_patch_size"],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": (patch * merge) ** 2, "longest_edge": (patch * merge * 16) ** 2},
    }
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return dest


def sections(check: dict[str, Any], target: Path, work: Path, python: str, steps: int) -> dict[str, dict[str, Any]]:
    mask = json.loads((check["target"] / "fixture.json").read_text())["mask_token_id"]
    return {
        "target": {"path": str(target), "dtype": "bfloat16"},
        "store": {"url": str(work / "store")},
        "tokenize": {"held_out_fraction": 0.0, "max_length": 1024},
        "dflash": {"block_size": check["block_size"], "mask_token_id": mask, "num_anchors": 32, **check["drafter"]},
        "placement": {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:0"]},
        "train": {"data": str(work / "tokenized"), "output": str(work / "run"), "log_dir": str(work / "logs"),
                  "max_steps": steps,
                  "batch_size": 4, "global_batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05, "checkpoint_every": steps,
                  "seed": 0},
        "eval": {"num_prompts": 16, "max_new_tokens": 64, "prompts": str(target / "prompts.jsonl"),
                 "untrained_baseline": False,
                 "engine": check["engine"], "engine_python": python, "engine_args": check["engine_args"]},
    }


def blockdraft(*args: str, env: dict[str, str]) -> int:
    """One `blockdraft` command, as users run it, echoed first."""
    argv = [sys.executable, "-m", "blockdraft", *args]
    print("$", " ".join(argv[2:]), flush=True)
    return subprocess.run(argv, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--engine-python", required=True, help="The Python that has the engine (vllm or sglang) "
                                                               "installed.")
    parser.add_argument("--workdir", default=None, help="Where the config, data, run and eval go (default: "
                                                        "./engine-CHECK).")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    check = CHECKS[args.check]
    work = Path(args.workdir or f"engine-{args.check}").absolute()
    work.mkdir(parents=True, exist_ok=True)
    python = str(Path(args.engine_python).absolute())
    try:
        # no engine: its one line before any training
        engine_python(EvalConfig(engine=check["engine"], engine_python=python))
    except EngineError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    target = (
        with_processor_config(check["target"], work / "target")
        if check["target"] == TINY_HYBRID_TARGET_DIR
        else check["target"]
    )
    config = work / "blockdraft.toml"
    write_toml(config, sections(check, target, work, python, args.steps))
    env = {**os.environ, **check["env"]}
    for command in (("tokenize", str(target / "completions.jsonl"), str(work / "tokenized")), ("train",)):
        if (code := blockdraft(*command, "--config", str(config), env=env)) != 0:
            return code
    code = blockdraft("eval", "--config", str(config), "--checkpoint", str(work / "run"), "--engine", check["engine"],
                      "--output", str(work / "eval"), env=env)
    report = work / "eval" / "report.json"
    engine = json.loads(report.read_text()).get("engine") if report.is_file() else None
    print(json.dumps({"check": args.check, "engine": engine}), flush=True)
    if engine is not None:
        print("\n".join(engine_lines(EngineCheck.model_validate(engine))))
    return code


if __name__ == "__main__":
    sys.exit(main())
