"""Tokenize throughput against the tokenizer's own speed, on one synthetic corpus shaped like the reference workload;
with --scale, how it scales with the input's size and layout and with the number of workers.

    .venv/bin/python -m bench.tokenize [--conversations 1600] [--repeats 3] [--task-mib 4] [--tokenizer
    tests/fixtures/qwen3-tokenizer] .venv/bin/python -m bench.tokenize --scale [--sizes 25,50,100] [--many 8]
    .venv/bin/python -m bench.tokenize --big-row 200

The corpus: reasoning-heavy completions averaging about 2,000 tokens per assistant turn, a fifth of them multi-turn,
as one JSONL file (about 10 MB, cut into tasks of at most --task-mib: 4 tasks), and its first half as another (2 tasks).
Every tokenize run spawns its workers, one included, so that one worker and two run the same way. In each repeat
(repeats interleaved) it measures:

- raw `encode_batch` on one core, in a spawned process, over the exact texts the stage encodes (rendered beforehand,
  outside the timing), in batches of the stage's size, `TOKENIZERS_PARALLELISM=false`, on the full corpus and on the
  half;
- end-to-end with 1 spawned worker (read + normalise + render + encode + mask + Arrow write + checksums + quarantine,
  CPU seconds of the worker's shards) on the full corpus and on the half;
- the shard phase's wall time on the full corpus with 1 and with 2 spawned workers;
- the peak RSS (VmHWM) of every worker process.

Ratios printed, per repeat and then best and median: end-to-end / raw per core, both as marginal rates (full minus
half, so that fixed costs cancel; goal >= 0.85), and 2 workers / 1 worker on one big file (goal >= 1.8).
Tokens are the rows' tokens (each row is a turn with its whole prompt), the same count for every measurement.

--scale: the same corpus at each of --sizes MB, as one JSONL file and as --many files, each with
1 and 2 workers and the default `tokenize.task_bytes`; per run the shard phase's wall time, the tasks, and the CPU
seconds of each worker process; the 2-worker / 1-worker ratio per size and layout (goal >= 1.7 on the largest single
file, per-worker CPU within 20%). Then what cutting a compressed stream costs: its decompression speed against the
tokenizing speed, and a .jsonl.zst of the smallest size tokenized with 1 and 2 workers.

--big-row MB: one JSONL of 8 conversations around one row of MB megabytes, tokenized by the CLI in a child process with
the default `tokenize.max_row_bytes` (64 MiB): the row must be quarantined as `row_too_large`, and the peak resident
memory of the largest process of the run (ru_maxrss of the children) is printed (docs/PERFORMANCE.md, goal < 2 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO = Path(__file__).resolve().parent.parent

_SYLLABLES = ["ka", "lo", "mi", "ren", "ta", "vo", "sel", "dri", "an", "tor", "pe", "qui", "us", "el", "ma", "no",
              "ist", "ver"]
_STEPS = ["First,", "Next,", "So", "Then", "Wait,", "Let me check:", "Therefore", "Hmm,", "Alternatively,", "Now"]


def _words(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.08:
            out.append(str(rng.randint(0, 99999)))
        elif r < 0.12:
            out.append(f"x_{rng.randint(0, 9)} = {rng.randint(1, 99)} * {rng.choice('abcnk')}^{rng.randint(2, 5)}")
        elif r < 0.2:
            out.append(rng.choice(_STEPS))
        else:
            out.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return " ".join(out)


def _paragraphs(rng: random.Random, words: int) -> str:
    parts, left = [], words
    while left > 0:
        n = min(left, rng.randint(30, 90))
        parts.append(_words(rng, n) + ".")
        left -= n
    return "\n\n".join(parts)


def synthetic_conversation(rng: random.Random, i: int) -> dict:
    """Reasoning-heavy: ~660 words (~2,000 tokens) of reasoning and answer per assistant turn; 20% with 2-3 turns."""
    turns = 1 if rng.random() < 0.8 else rng.randint(2, 3)
    messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
    for _ in range(turns):
        messages.append({"role": "user", "content": _words(rng, rng.randint(20, 120)) + "?"})
        reasoning_words = max(60, int(rng.gauss(560, 180)))
        messages.append({
            "role": "assistant",
            "reasoning_content": _paragraphs(rng, reasoning_words),
            "content": _paragraphs(rng, rng.randint(40, 160)),
        })
    return {"id": f"bench-{i}", "messages": messages}


def write_corpus(folder: Path, conversations: int, files: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = [synthetic_conversation(rng, i) for i in range(conversations)]
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-conversations // files)
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            for row in rows[f * per_file : (f + 1) * per_file]:
                out.write(json.dumps(row) + "\n")
    return rows


def raw_encode(
    rows: list[dict], tokenizer_dir: str, template_path: str | None, repeats: int
) -> tuple[int, float, float]:
    """(tokens, best wall seconds, best CPU seconds) of `encode_batch` over the exact texts the stage encodes, one
    process, no threads."""
    from tokenizers import Tokenizer

    from blockdraft.data.completions import normalise
    from blockdraft.data.records import RawRecord
    from blockdraft.data.render import PlannedTurn, compile_chat_template, plan_turns
    from blockdraft.data.tokenizer import read_tokenizer_folder
    from blockdraft.stages.tokenize.shard import CONVERSATION_BATCH

    tokenizer_json, _, own_template, special_tokens = read_tokenizer_folder(tokenizer_dir)
    text = Path(template_path).read_text() if template_path else own_template
    assert text is not None, f"{tokenizer_dir} has no chat template; pass --chat-template"
    template = compile_chat_template(text, special_tokens)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    texts = []
    for i, row in enumerate(rows):
        for p in plan_turns(normalise(RawRecord(i, row, "")), template, "auto"):
            if isinstance(p, PlannedTurn):
                texts.append(p.full)
    batches = [texts[i : i + CONVERSATION_BATCH] for i in range(0, len(texts), CONVERSATION_BATCH)]
    best, best_cpu, tokens = float("inf"), float("inf"), 0
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        tokens = sum(len(e.ids) for batch in batches for e in tokenizer.encode_batch(batch, add_special_tokens=False))
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - cpu)
    return tokens, best, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=1600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--task-mib", type=int, default=4, help="tokenize.task_bytes in MiB for the ratios (the full file "
                                                            "is cut in 4 tasks)")
    ap.add_argument("--tokenizer", default=str(REPO / "tests/fixtures/qwen3-tokenizer"))
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--scale", action="store_true", help="sizes x layouts x workers instead")
    ap.add_argument("--sizes", default="25,50,100", help="--scale: corpus sizes in MB")
    ap.add_argument("--many", type=int, default=8, help="--scale: files in the many-files layout")
    ap.add_argument("--big-row", type=int, default=0, metavar="MB", help="peak RSS of tokenize on a row of MB "
                                                                         "megabytes instead")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        if args.big_row:
            big_row(args, work)
        elif args.scale:
            scale(args, work)
        else:
            run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _raw_in_spawned(rows: list[dict], args: argparse.Namespace) -> tuple[int, float, float]:
    """`raw_encode` in a spawned process of its own, as the stage's worker runs: both sides of the per-core ratio are
    measured in a fresh process (this one has run every tokenize call in between)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(raw_encode, (rows, args.tokenizer, args.chat_template, 1))


peak_rss_mib: list[float] = []  # each spawned run's largest worker peak RSS (VmHWM)


def _spawned_run(args: argparse.Namespace, src: Path, out: Path, workers: int) -> tuple[int, float, float]:
    """(tokens, CPU seconds summed over the worker processes' shards, shard phase wall seconds) of one tokenize run with
    `workers` spawned worker processes (one included: `spawn_one`)."""
    from blockdraft.config import load_config
    from blockdraft.reporter import Reporter
    from blockdraft.stages import tokenize

    # No clipping, so every measurement counts the same tokens.
    options = {"workers": workers, "max_length": 1 << 20, "task_bytes": args.task_mib << 20}
    cfg = load_config(None,
                      {"target": {"path": args.tokenizer, "chat_template": args.chat_template}, "tokenize": options})
    result = tokenize.run(cfg, str(src), str(out), Reporter(), spawn_one=True)
    s = result.details
    assert result.report.state.value == "verified", result.report.state
    shutil.rmtree(out, ignore_errors=True)
    peak_rss_mib.append(max(s.worker_peak_rss_mib))
    return s.counts["tokens"], sum(s.worker_cpu_seconds), s.shard_phase_seconds


def run(args: argparse.Namespace, work: Path) -> None:
    """The two tokenize ratios, each against its reference measured in the same repeat, repeats interleaved:

    - per core: the marginal rate (tokens of the full corpus minus tokens of its first half, over the CPU seconds of the
      one spawned worker on the full corpus minus on the half) against raw `encode_batch`'s marginal rate over the same
      texts, so fixed costs (tokenizer build, template compile, a task's set-up) cancel on both sides;
    - scaling: the shard phase's wall time on the full corpus, one big JSONL file, with 1 spawned worker over 2.
    """
    rows = write_corpus(work / "full", args.conversations, 1)
    write_corpus(work / "half", args.conversations // 2, 1)
    turns = sum(1 for r in rows for m in r["messages"] if m["role"] == "assistant")
    half_rows = rows[: args.conversations // 2]
    per_core: list[float] = []
    scaling: list[float] = []
    raw_rates: list[float] = []
    e2e_rates: list[float] = []
    walls: dict[int, list[float]] = {1: [], 2: []}
    tokens = 0
    load_before = _loadavg()
    for r in range(args.repeats):
        # Interleaved, so that a burst of load from elsewhere on this shared machine hits every measurement alike.
        raw_full, raw_half = (_raw_in_spawned(x, args) for x in (rows, half_rows))
        one_full = _spawned_run(args, work / "full", work / f"out-1-{r}", 1)
        one_half = _spawned_run(args, work / "half", work / f"out-h-{r}", 1)
        two_full = _spawned_run(args, work / "full", work / f"out-2-{r}", 2)
        tokens = raw_full[0]
        assert one_full[0] == two_full[0] == tokens and one_half[0] == raw_half[0], (one_full[0], two_full[0], tokens)
        raw_rate = (raw_full[0] - raw_half[0]) / (raw_full[2] - raw_half[2])
        e2e_rate = (one_full[0] - one_half[0]) / (one_full[1] - one_half[1])
        raw_rates.append(raw_rate)
        e2e_rates.append(e2e_rate)
        per_core.append(e2e_rate / raw_rate)
        walls[1].append(one_full[2])
        walls[2].append(two_full[2])
        scaling.append(one_full[2] / two_full[2])
        print(f"repeat {r + 1}: raw {raw_rate / 1e6:.3f} M tok/s CPU, end-to-end {e2e_rate / 1e6:.3f} (marginal, 1 "
              f"spawned worker), ratio {per_core[-1]:.3f}; shard phase 1 worker {one_full[2]:.2f} s, 2 workers "
              f"{two_full[2]:.2f} s, ratio {scaling[-1]:.3f}; load {_loadavg()}", flush=True)
    size = (work / "full" / "part-000.jsonl").stat().st_size
    print(f"corpus: {len(rows)} conversations ({turns} assistant turns), one JSONL file of {size / 1e6:.1f} MB cut in "
          f"tasks of at most {args.task_mib} MiB, {tokens:,} row tokens "
          f"({tokens / turns:,.0f} per row); half: the first {len(half_rows)} conversations")
    print(f"raw encode_batch marginal, 1 core: best {max(raw_rates) / 1e6:.3f}, median {_median(raw_rates) / 1e6:.3f} "
          "M tok/s CPU")
    print(f"end-to-end marginal, 1 spawned worker: best {max(e2e_rates) / 1e6:.3f}, median "
          f"{_median(e2e_rates) / 1e6:.3f} M tok/s CPU")
    print(f"RATIO end-to-end / raw encode per core (marginal, CPU time), same repeat: best {max(per_core):.3f}, "
          f"median {_median(per_core):.3f}   (goal >= 0.85)")
    print("RATIO 2 spawned workers / 1 spawned worker, one big JSONL file (shard phase wall), same repeat: best "
          f"{max(scaling):.3f}, median {_median(scaling):.3f}   (goal >= 1.8)")
    print(f"peak RSS per worker process: {max(peak_rss_mib):.0f} MiB")
    print(f"(load average before {load_before}, after {_loadavg()}, on {os.cpu_count()} cores)")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def big_row(args: argparse.Namespace, work: Path) -> None:
    """Tokenize 8 conversations and one row of `--big-row` MB (written in pieces: this process never holds it) in a
    child process; print its exit status, what the manifest counted and the peak RSS of the largest process of the
    run."""
    src, out = work / "big-row.jsonl", work / "out"
    rng = random.Random(0)
    piece = _words(rng, 100_000) + " "
    with src.open("w") as f:
        for i in range(4):
            f.write(json.dumps(synthetic_conversation(rng, i)) + "\n")
        f.write('{"id": "big", "messages": [{"role": "user", "content": "')
        for _ in range(args.big_row * 1_000_000 // len(piece)):
            f.write(piece)
        f.write('"}, {"role": "assistant", "content": "ok"}]}\n')
        for i in range(4, 8):
            f.write(json.dumps(synthetic_conversation(rng, i)) + "\n")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "blockdraft", "tokenize", str(src), str(out), "--tokenizer",
                           args.tokenizer],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    counts = json.loads((out / "blockdraft-manifest.json").read_text())["counts"] if proc.returncode == 0 else {}
    print(f"input: {src.stat().st_size / 1e6:.1f} MB, one row of {args.big_row} MB; tokenize exit {proc.returncode} in "
          f"{seconds:.1f} s")
    print(f"rows in {counts.get('rows_in')}, out {counts.get('rows_out')}, rejected {counts.get('rejected')}")
    print(f"peak RSS of the largest process of the run: {peak_mib:,.0f} MiB   (goal < 2048)")
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-2000:])


def write_sized(folder: Path, rows: list[dict], megabytes: int, files: int) -> int:
    """The first rows of `rows` that make `megabytes` MB of JSONL, in `files` files of about equal size; returns the
    rows."""
    lines, total = [], 0
    for row in rows:
        if total >= megabytes * 1_000_000:
            break
        lines.append(json.dumps(row) + "\n")
        total += len(lines[-1])
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(lines) // files)
    for f in range(files):
        (folder / f"part-{f:03d}.jsonl").write_text("".join(lines[f * per_file : (f + 1) * per_file]))
    return len(lines)


def timed_run(args: argparse.Namespace, src: Path, out: Path, workers: int) -> dict:
    """One tokenize run: the shard phase's wall seconds, tasks, tokens and CPU seconds per worker process."""
    from blockdraft.config import load_config
    from blockdraft.reporter import Reporter
    from blockdraft.stages import tokenize

    target = {"path": args.tokenizer, "chat_template": args.chat_template}
    cfg = load_config(None, {"target": target, "tokenize": {"workers": workers, "max_length": 1 << 20}})
    result = tokenize.run(cfg, str(src), str(out), Reporter(), spawn_one=True)
    s = result.details
    assert result.report.state.value == "verified", result.report.state
    shutil.rmtree(out, ignore_errors=True)
    return {"wall": s.shard_phase_seconds, "call": result.seconds, "tasks": s.shards_total,
            "tokens": s.counts["tokens"],
            "cpu": sorted(s.process_cpu_seconds.values(), reverse=True),
            "bytes": sum(p.stat().st_size for p in src.iterdir())}


def _cpu(run: dict) -> str:
    cpu = run["cpu"]
    balance = (
        f", min/max {min(cpu) / max(cpu):.2f}"
        if len(cpu) > 1
        else " (one process ran every task)"
        if run["tasks"] > 1
        else ""
    )
    return "CPU-s per worker " + " / ".join(f"{c:.1f}" for c in cpu) + balance


def scale(args: argparse.Namespace, work: Path) -> None:
    """Sizes x (one file, many files) x (1, 2 workers), the largest single file again (--repeats in all, best of each),
    then what cutting a compressed stream costs. Every corpus is written first, so that no run shares its process with
    it."""
    sizes = [int(x) for x in args.sizes.split(",")]
    rng = random.Random(0)
    rows, total = [], 0
    while total < max(sizes) * 1_000_000:
        rows.append(synthetic_conversation(rng, len(rows)))
        total += len(json.dumps(rows[-1])) + 1
    layouts = (("one file", 1), (f"{args.many} files", args.many))
    for megabytes in sizes:
        for _, files in layouts:
            write_sized(work / f"in-{megabytes}-{files}", rows, megabytes, files)
    stream_src = write_streams(work / "stream", rows, min(sizes))
    del rows
    print(f"corpus: synthetic reasoning conversations (bench.tokenize), default tokenize.task_bytes; {os.cpu_count()} "
          "cores")
    print(f"{'size':>7} {'layout':>10} {'tasks':>5} {'1 worker s':>10} {'2 workers s':>11} {'ratio':>6}  CPU-s: 1 "
          "worker; 2 workers, per process")
    runs: dict[tuple[int, int], tuple[dict, dict]] = {}
    for megabytes in sizes:
        for layout, files in layouts:
            src = work / f"in-{megabytes}-{files}"
            one, two = (timed_run(args, src, work / "out", w) for w in (1, 2))
            assert one["tokens"] == two["tokens"]
            runs[megabytes, files] = (one, two)
            print(f"{megabytes:>5}MB {layout:>10} {two['tasks']:>5} {one['wall']:>10.1f} {two['wall']:>11.1f} "
                  f"{one['wall'] / two['wall']:>6.2f}  {one['cpu'][0]:.1f}; {_cpu(two)}")
    biggest = max(sizes)
    one, two = runs[biggest, 1]
    for _ in range(args.repeats - 1):  # interleaved, so that a burst of load from elsewhere hits both alike
        again = [timed_run(args, work / f"in-{biggest}-1", work / "out", w) for w in (1, 2)]
        one, two = (min(a, b, key=lambda r: r["wall"]) for a, b in zip((one, two), again, strict=True))
    cpu = two["cpu"]
    spread = (max(cpu) - min(cpu)) / max(cpu) if len(cpu) > 1 else 1.0
    print(f"RATIO one {biggest} MB JSONL ({two['tasks']} tasks), 2 workers / 1 worker, best of {args.repeats} (shard "
          f"phase wall {one['wall']:.1f} s / {two['wall']:.1f} s): {one['wall'] / two['wall']:.2f}   (goal >= 1.7)")
    print(f"CPU-s per worker process, 2 workers: {' / '.join(f'{c:.1f}' for c in cpu)}, {100 * spread:.0f}% apart   "
          f"(goal <= 20%); 1 worker: {one['cpu'][0]:.1f}")
    stream_costs(args, work, stream_src, one)
    print(f"(load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")


def write_streams(folder: Path, rows: list[dict], megabytes: int) -> Path:
    """The first `megabytes` MB of `rows` as one .jsonl.zst (one streamed frame, no content size in its header), and the
    same bytes as .jsonl.gz beside it (`stream_costs`)."""
    import gzip

    import zstandard

    write_sized(folder, rows, megabytes, 1)
    plain = folder / "part-000.jsonl"
    data = plain.read_bytes()
    zst = zstandard.ZstdCompressor(level=3).compressobj()
    (folder / "part-000.jsonl.zst").write_bytes(zst.compress(data) + zst.flush())
    (folder.parent / "stream.jsonl.gz").write_bytes(gzip.compress(data, compresslevel=6))
    plain.unlink()
    return folder


def stream_costs(args: argparse.Namespace, work: Path, src: Path, plain_one: dict) -> None:
    """A .jsonl.zst or .jsonl.gz is cut into decompressed ranges, and part k decompresses (and skips) the k ranges
    before its own: with n parts the file is decompressed about (n + 1) / 2 times. Measured against the tokenizing
    itself (`plain_one`: a 1-worker run over plain JSONL)."""
    from blockdraft.data.ranges import MAX_STREAM_PARTS
    from blockdraft.data.streams import CountingReader, decompressed

    speeds = {}
    for path in (work / "stream.jsonl.gz", src / "part-000.jsonl.zst"):
        best, size = float("inf"), 0
        for _ in range(2):
            start = time.perf_counter()
            with open(path, "rb") as f:
                stream = decompressed(CountingReader(f), path.name)  # type: ignore[arg-type]
                size = newlines = 0
                while chunk := stream.read(1 << 20):
                    size, newlines = size + len(chunk), newlines + chunk.count(b"\n")
            best = min(best, time.perf_counter() - start)
        speeds[path.name.rsplit(".", 1)[1]] = (size / best / 1e6, size)
    tokenize_speed = plain_one["bytes"] / plain_one["cpu"][0] / 1e6
    n = MAX_STREAM_PARTS
    for suffix, (speed, _) in speeds.items():
        print(f"stream cut, .jsonl.{suffix}: decompress + skip {speed:,.0f} MB/s vs tokenize {tokenize_speed:.2f} MB/s "
              f"per core; with {n} parts the extra decompressing is {100 * (n - 1) / 2 * tokenize_speed / speed:.1f}% "
              "of the tokenizing CPU")
    one, two = (timed_run(args, src, work / "out", w) for w in (1, 2))
    print(f"stream cut, one {speeds['zst'][1] / 1e6:.0f} MB .jsonl.zst: {two['tasks']} tasks, 1 worker "
          f"{one['wall']:.1f} s ({one['cpu'][0]:.1f} CPU-s), 2 workers {two['wall']:.1f} s, ratio "
          f"{one['wall'] / two['wall']:.2f}; {_cpu(two)}")


if __name__ == "__main__":
    main()
