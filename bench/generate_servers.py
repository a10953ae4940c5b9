"""Generation throughput against one server and against two: `blockdraft generate` (engine openai) spreading the same
prompts over `generate.base_url` lists of one and of two endpoints.

    .venv/bin/python -m bench.generate_servers [--prompts 64] [--max-new-tokens 64] [--concurrency 2] [--repeats 2]

The endpoints are the test suite's OpenAI-compatible chat server (tests/helpers/chat_server.py) serving the tiny target,
each in its own process with one torch thread, answering one request at a time (as one engine replica whose batch is
full); both start before anything is timed, so the fixed cost (a process loading torch and the model, printed
apart) is not in the rates. Each repeat runs the one-server list and the two-server list on fresh outputs, in
alternating order, and the figure is the wall time of `generate.run` (the prompts read, every request, the shards
written and verified, the commit): prompts per second and completion tokens per second, and the two-server rate as a
multiple of the one-server rate of the same repeat. On a machine with fewer free cores than servers the second server
has no core of its own and the multiple stays near 1: the load is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.reporter import Reporter
from blockdraft.stages import generate

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.chat_server import EndpointProcess  # noqa: E402
from helpers.generate_data import output_rows  # noqa: E402


def write_prompts(path: Path, n: int) -> None:
    """`n` prompts of the tiny target's held-out set (repeated, each under its own id)."""
    rows = [json.loads(x) for x in (TINY_TARGET_DIR / "prompts.jsonl").read_text().splitlines()]
    path.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"bench-{i:05d}"}) + "\n" for i in range(n)))


def timed_run(prompts: Path, out: Path, urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    cfg = load_config(None, {"generate": {"engine": "openai", "base_url": urls, "max_new_tokens": args.max_new_tokens,
                                          "concurrency": args.concurrency, "thinking": "off"}})
    start = time.perf_counter()
    result = generate.run(cfg, str(prompts), str(out), Reporter())
    seconds = time.perf_counter() - start
    assert result.details.generated == args.prompts and result.details.failed == 0, generate.summary_lines(result)
    tokens = sum(len(r["completion_token_ids"]) for r in output_rows(out))
    return {"servers": len(urls), "seconds": seconds, "prompts_per_s": args.prompts / seconds,
            "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight per server")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="blockdraft-bench-gen-") as tmp:
        work = Path(tmp)
        write_prompts(work / "prompts.jsonl", args.prompts)
        start = time.perf_counter()
        servers = [EndpointProcess(TINY_TARGET_DIR, work / f"server-{i}.log") for i in range(2)]
        print(f"fixed cost: two endpoints started in {time.perf_counter() - start:.1f} s (torch and the model loaded)")
        try:
            results = []
            for repeat in range(args.repeats):
                lists = [[servers[0].url], [s.url for s in servers]]
                for urls in lists if repeat % 2 == 0 else lists[::-1]:
                    figures = timed_run(work / "prompts.jsonl", work / f"out-{repeat}-{len(urls)}", urls, args)
                    results.append({"repeat": repeat, **figures})
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
        finally:
            for server in servers:
                server.stop()
    multiples = []
    for repeat in range(args.repeats):
        one, two = (next(r for r in results if r["repeat"] == repeat and r["servers"] == n) for n in (1, 2))
        multiples.append(two["prompts_per_s"] / one["prompts_per_s"])
    for n in (1, 2):
        rates = [r["prompts_per_s"] for r in results if r["servers"] == n]
        tokens = [r["tokens_per_s"] for r in results if r["servers"] == n]
        print(f"{n} server(s): {statistics.median(rates):.2f} prompts/s, {statistics.median(tokens):.0f} completion "
              f"tokens/s (median of {len(rates)})")
    print(f"two servers / one: {statistics.median(multiples):.2f}x (per repeat: "
          f"{', '.join(f'{m:.2f}' for m in multiples)}); load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
