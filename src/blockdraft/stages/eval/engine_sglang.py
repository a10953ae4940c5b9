"""`eval --engine sglang`: the export served by SGLang, through the same server life cycle (`engine.serving`) and the
same comparison with our decode (`engine_check.compare`) as vLLM. This path has not run in this project's CI: SGLang's
CPU build needs sgl-kernel built from source, so it is exercised by bench/gpu_check.sh on a GPU machine only.

The server is `python -m sglang.launch_server` with the settings `export` wrote (`sglang_args` in serving.json). Prompts
go to SGLang's native `/generate` as `input_ids`, greedy, with our `max_new_tokens` and stop ids; the answer holds the
new ids (`output_ids`) and, per request, the speculative counts in `meta_info`, which are exactly the counts over that
request. SGLang's `/metrics` is not used: its speculative figures there are the gauges `sglang:spec_accept_length` and
`sglang:spec_accept_rate`, each a mean over the scheduler's last logging interval, so no before/after difference of
them counts exactly our requests.

The `meta_info` fields read (named as SGLang's tokenizer manager writes them for a finished request):
- `spec_verify_ct`: verify passes, one per draft block (our cycles);
- `spec_correct_drafts_histogram` (older releases: `spec_accept_histogram`): entry n = verify passes that accepted
  exactly n drafted tokens, from which the tokens accepted at each draft position follow;
- without a histogram, `spec_num_correct_drafts` (alias `spec_accepted_drafts`): drafted tokens accepted in all;
- without either, `completion_tokens`, which SGLang's own accept length divides by `spec_verify_ct`: every verify pass
  commits its accepted drafts plus one token, and the prefill commits the first.
Without a histogram only tau can be compared (`engine_check.compare` says so in the rule).
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockdraft.errors import EngineError
from blockdraft.reporter import Reporter
from blockdraft.stages.eval.engine import SERVED_NAME, ServedRun, Server

DRAFT_PATH_FLAG = "--speculative-draft-model-path"


def sglang_spec(serving: dict[str, Any], export: Path) -> list[str]:
    """The export's `sglang_args` with the draft model pointed at `export` (the folder served here, wherever
    serving.json said users would put it), less `--dtype`, which `sglang_argv` gives both runs."""
    args, spec = shlex.split(str(serving.get("sglang_args") or "")), []
    i = 0
    while i < len(args):
        if args[i] == "--dtype":
            i += 2
            continue
        if args[i] == DRAFT_PATH_FLAG:
            spec += [DRAFT_PATH_FLAG, str(export.absolute())]
            i += 2
            continue
        spec.append(args[i])
        i += 1
    if DRAFT_PATH_FLAG not in spec:
        raise EngineError(f"{export}/serving.json has no sglang_args naming {DRAFT_PATH_FLAG}; export the checkpoint "
                          "again with `blockdraft export`")
    return spec


def sglang_argv(python: Path, target: str, port: int, dtype: str, max_len: int | None, spec: Sequence[str] | None,
                extra: Sequence[str]) -> list[str]:
    """The command line that serves `target` with SGLang (with the drafter settings `spec`, or target-only), with room
    for `max_len` tokens per sequence (None: what the target's config allows)."""
    argv = [str(python), "-m", "sglang.launch_server", "--model-path", target, "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--random-seed", "0"]
    if max_len is not None:
        argv += ["--context-length", str(max_len)]
    return argv + list(spec or []) + list(extra)


def spec_counts(meta: dict[str, Any], positions: int) -> tuple[int, int, list[int] | None]:
    """(verify passes, drafted tokens accepted, tokens accepted at each of `positions` draft positions or None when
    SGLang gave no histogram) from one `/generate` answer's `meta_info`; all zero for a target-only server."""
    drafts = int(meta.get("spec_verify_ct") or 0)
    histogram = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
    if histogram:
        counts = [int(h) for h in histogram]
        return drafts, sum(n * h for n, h in enumerate(counts)), [sum(counts[k:]) for k in range(1, positions + 1)]
    correct = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    if correct is not None:
        return drafts, int(correct), None
    if drafts:
        return drafts, max(int(meta.get("completion_tokens") or 0) - 1 - drafts, 0), None
    return 0, 0, None


def generate_sglang(server: Server, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops: Sequence[int],
                    positions: int, reporter: Reporter, label: str, version: str) -> ServedRun:
    """Every prompt through SGLang's `/generate`, one request at a time, greedy; its counts summed over exactly these
    requests."""
    server.post("/generate", _request(prompts[0], 2, stops))  # warm-up: first-request costs stay out of the timing
    outputs: list[list[int]] = []
    drafts, accepted, per_position = 0, 0, [0] * positions
    histograms = True
    reporter.progress(label, 0, len(prompts))
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        answer = server.post("/generate", _request(prompt, max_new_tokens, stops))  # one prompt: one answer object
        outputs.append([int(t) for t in answer["output_ids"]])
        d, a, per = spec_counts(answer.get("meta_info") or {}, positions)
        drafts, accepted = drafts + d, accepted + a
        if per is None:
            histograms = histograms and d == 0  # a request without drafts has no histogram and loses nothing
        else:
            per_position = [x + y for x, y in zip(per_position, per)]
        reporter.progress(label, i + 1, len(prompts))
    seconds = time.perf_counter() - started
    if histograms:
        return ServedRun(outputs, seconds, drafts, per_position, version)
    return ServedRun(outputs, seconds, drafts, [], version, accepted_total=accepted)


def _request(prompt: Sequence[int], max_new_tokens: int, stops: Sequence[int]) -> dict[str, Any]:
    return {"input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": list(stops),
                                "skip_special_tokens": False}}


def sglang_version(python: Path) -> str:
    """The installed sglang's version as its distribution names it, or "" when that cannot be read."""
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"sglang {done.stdout.strip()}" if done.returncode == 0 else ""


__all__ = ["generate_sglang", "sglang_argv", "sglang_spec", "sglang_version", "spec_counts"]
