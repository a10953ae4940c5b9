"""What one vLLM server costs on the CPU, with its model run in the engine core's own process (what `eval --engine` and
`generate --engine vllm` set on a machine without CUDA) against vLLM's default of a separate worker process.

Each round starts the tiny target's server target-only with `serving` (the product's own start, health wait and stop),
once each way in alternating order, and times: the start (process launch to a healthy `/health`, the fixed cost), the
requests (the fixture's prompts, one at a time, greedy, through `generate`: the steady-state rate in new tokens per
second) and the stop. The outputs of both ways must be equal (asserted). Needs `make engine`.

    .venv/bin/python -m bench.engine_start --rounds 3    # about 3 min on 2 cores
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
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.engine import free_argv, generate, serving

VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"
WAYS = {"in-process": "0", "worker process": "1"}


def prompts(count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TARGET_DIR))
    rows = [json.loads(line) for line in (TINY_TARGET_DIR / "prompts.jsonl").read_text().splitlines()[:count]]
    texts = [tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False,
                                           enable_thinking=row.get("enable_thinking", True)) for row in rows]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def one_server(cfg: EvalConfig, ids: list[list[int]], new_tokens: int, workdir: Path) -> dict:
    argv = free_argv(Path(cfg.engine_python), "vllm", str(TINY_TARGET_DIR), "float32", 512, None, [])
    started = time.perf_counter()
    with serving(argv, workdir, "bench", cfg) as server:
        healthy = time.perf_counter()
        run = generate(server, ids, new_tokens, [], 7, Reporter(), "bench")
        stopping = time.perf_counter()
    stopped = time.perf_counter()
    new = sum(len(o) for o in run.outputs)
    return {"start_s": healthy - started, "tokens_per_s": new / run.seconds, "stop_s": stopped - stopping,
            "outputs": run.outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    cfg = EvalConfig(engine="vllm", engine_python=str(Path(".venv-engine/bin/python").absolute()))
    ids = prompts(args.prompts)
    seen: dict[str, list[dict]] = {way: [] for way in WAYS}
    before = os.environ.get(VARIABLE)
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-engine-start-") as tmp:
        for r in range(args.rounds):
            order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
            for way in order:
                os.environ[VARIABLE] = WAYS[way]
                result = one_server(cfg, ids, args.new_tokens, Path(tmp))
                seen[way].append(result)
                print(json.dumps({"round": r, "way": way,
                                  **{k: round(v, 2) for k, v in result.items() if k != "outputs"}}), flush=True)
    if before is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = before
    outputs = {json.dumps(r["outputs"]) for runs in seen.values() for r in runs}
    assert len(outputs) == 1, "the two ways produced different outputs"
    median = {
        way: {k: statistics.median(r[k] for r in runs) for k in ("start_s", "tokens_per_s", "stop_s")}
        for way, runs in seen.items()
    }
    inproc, worker = median["in-process"], median["worker process"]
    print(json.dumps({"median": median, "start_ratio": round(inproc["start_s"] / worker["start_s"], 3),
                      "rate_ratio": round(inproc["tokens_per_s"] / worker["tokens_per_s"], 3), "outputs_equal": True,
                      "load_average_after": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
