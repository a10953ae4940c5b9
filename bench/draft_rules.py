"""Tau at temperature under each serving engine's draft rule (`eval.proposal`), ours and vLLM's, on the full demo's
drafter.

    .venv/bin/python -m bench.draft_rules [--workdir bench-work/draft-rules] [--samples-per-prompt 4] [--no-engine]

Runs `blockdraft demo` (full profile, DFlash drafter) into the workdir unless it already holds one, then
`blockdraft eval` of its checkpoint on the demo's 16 held-out prompts (the tiny target's prompts.jsonl, as the demo's
eval) x 128 new tokens at Qwen3's thinking settings (T 0.6, top-p 0.95, top-k 20), once per rule: `vllm` and
`vllm-probabilistic` also served by vLLM (`--engine vllm`, `make engine`'s build with the expand fix, told the rule as
`draft_sample_method`), `sglang` ours only (SGLang has no CPU build here). Every command is the CLI users run; the table
gives each rule's tau with its 95% interval, vLLM's tau over its drafts, and whether the engine check agreed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from blockdraft.decode.sampling import PROPOSALS
from blockdraft.fixtures.tiny import TINY_TARGET_DIR

SAMPLING = ["--temperature", "0.6", "--top-p", "0.95", "--top-k", "20"]


def _run(argv: list[str]) -> tuple[int, float, str]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "blockdraft", *argv], capture_output=True, text=True)
    return done.returncode, time.perf_counter() - began, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="bench-work/draft-rules")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--no-engine", action="store_true", help="ours only, for a machine without `make engine`")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    if not (workdir / "blockdraft.toml").is_file():
        code, seconds, output = _run(["demo", "--workdir", str(workdir)])
        if code != 0:
            sys.exit(f"demo failed ({code}):\n{output[-3000:]}")
        print(f"demo: {seconds:.0f} s")
    checkpoint = f"file://{(workdir / 'store' / 'checkpoints').absolute()}"
    rows = []
    for rule in PROPOSALS:
        engine = [] if args.no_engine or not rule.startswith("vllm") else ["--engine", "vllm"]
        out = workdir / f"eval-{rule}{'-engine' if engine else ''}-s{args.samples_per_prompt}"
        argv = ["eval", "--config", str(workdir / "blockdraft.toml"), "--checkpoint", checkpoint, "--output", str(out),
                *SAMPLING, "--prompts", str(TINY_TARGET_DIR / "prompts.jsonl"),  # the demo's own held-out prompts
                "--samples-per-prompt", str(args.samples_per_prompt), "--proposal", rule, "--set",
                "eval.untrained_baseline=false", *engine]
        code, seconds, output = _run(argv)
        report_path = out / "report.json"
        if not report_path.is_file():
            sys.exit(f"eval under {rule} wrote no report ({code}):\n{output[-3000:]}")
        report = json.loads(report_path.read_text())
        d = report["sampled"]["drafters"]["dflash"]
        e = report.get("engine")
        rows.append((rule, report["drafters"]["dflash"]["tau"], d["metrics"]["tau"], d["tau_ci95"],
                     report["sampled"]["decodes"], e, seconds, code))
    print("| rule | greedy tau | ours at T 0.6 [95%] | decodes | vLLM at T 0.6 (drafts) | engine check | eval wall |")
    print("|---|---|---|---|---|---|---|")
    for rule, greedy, tau, ci, decodes, e, seconds, code in rows:
        engine = f"{e['tau']:.3f} ({e['drafts']})" if e else "-"
        verdict = ("agrees" if e["disagreement"] is None else "DISAGREES") + f" ({e['rule']})" if e else "-"
        print(f"| {rule} | {greedy:.3f} | {tau:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {decodes} | {engine} | {verdict} | "
              f"{seconds:.0f} s (exit {code}) |")


if __name__ == "__main__":
    main()
