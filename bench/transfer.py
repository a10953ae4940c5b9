"""Verified transfer vs s5cmd on the same local SeaweedFS: push + verify against `s5cmd cp` up, pull + verify
against `s5cmd cp` down, for one artifact of about 1 GiB in several files.

    .venv/bin/python -m bench.transfer [--gib 1] [--files 8] [--repeats 3]

Each transfer runs in its own child process, whose peak RSS (VmHWM) is sampled while it runs. blockdraft's time
is the library call (`push` / `pull`, verification included) timed inside the child, without interpreter
start-up; s5cmd's is the whole process (it starts in milliseconds). Ratios are throughput ratios
(blockdraft MB/s ÷ s5cmd MB/s), each against the s5cmd run of the same round, best and median over rounds: above
1.0 blockdraft is faster. CPU s/GiB (user+sys of
the client process, from wait4) is less sensitive to a busy machine than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.store import open_store
from blockdraft.store.artifact import commit_artifact, entry_for_local_file
from blockdraft.store.transfer import pull, push

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.s3server import SeaweedS3  # noqa: E402

MIB = 1024 * 1024


def child(op: str, src: str, dst: str) -> None:
    """Run one push or pull in this process and print its wall time (seconds) as JSON."""
    start = time.perf_counter()
    report = (push if op == "push" else pull)(src, dst, StoreConfig())
    seconds = time.perf_counter() - start
    assert report.verify is not None and report.verify.state.value == "verified", report.summary()
    print(json.dumps({"seconds": seconds, "moved": len(report.moved)}))


def _peak_rss_mib(pid: int) -> int | None:
    """The process's own high-water RSS (VmHWM; wait4's ru_maxrss would include the forking parent's)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def run_measured(argv: list[str], env: dict[str, str]) -> tuple[float, int, float, str]:
    """(wall seconds, peak RSS MiB sampled every 10 ms, CPU seconds user+sys, stdout) of one child process."""
    os.sync()
    out = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    peak = 0
    while True:
        peak = max(peak, _peak_rss_mib(proc.pid) or 0)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    text = out.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {text[-2000:]}")
    return seconds, peak, usage.ru_utime + usage.ru_stime, text


def make_artifact(root: Path, total: int, files: int) -> int:
    root.mkdir(parents=True)
    each = total // files
    for i in range(files):
        with open(root / f"shard-{i:03d}.arrow", "wb") as f:
            for _ in range(each // (16 * MIB)):
                f.write(os.urandom(16 * MIB))
            f.write(os.urandom(each % (16 * MIB)))
    entries = [entry_for_local_file(root, p) for p in sorted(root.glob("shard-*"))]
    commit_artifact(open_store(root), "bench", entries)
    return sum(e.size for e in entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("OP", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return

    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="bd-bench-"))
    s5cmd = str(Path(sys.executable).parent / "s5cmd")
    try:
        with SeaweedS3(work / "server") as server:
            env = {**os.environ, **server.admin.env(server.endpoint)}
            server.client().create_bucket(Bucket="bench")
            local = work / "artifact"
            total = make_artifact(local, int(args.gib * 1024 * MIB), args.files)
            shards = str(local / "shard-*")
            # As a module from the repository root: run as a script, bench/ would lead sys.path and bench/tokenize.py
            # would shadow the standard library's tokenize.
            me = [sys.executable, "-m", "bench.transfer", "--child"]
            results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in ("push", "s5cmd_up", "pull",
                                                                                  "s5cmd_down")}

            def ours(op: str, src: str, dst: str) -> tuple[float, int, float]:
                _, rss, cpu, out = run_measured(me + [op, src, dst], env)
                return json.loads(out.strip().splitlines()[-1])["seconds"], rss, cpu

            def s5(src: str, dst: str) -> tuple[float, int, float]:
                seconds, rss, cpu, _ = run_measured([s5cmd, "--endpoint-url", server.endpoint, "cp", src, dst], env)
                return seconds, rss, cpu

            def s5_down(rep: int) -> None:
                down = work / f"down-s5-{rep}"
                results["s5cmd_down"].append(s5(f"s3://bench/s5-{rep}/*", f"{down}/"))
                shutil.rmtree(down)

            def our_pull(rep: int) -> None:
                pulled = work / f"down-bd-{rep}"
                results["pull"].append(ours("pull", f"s3://bench/bd-{rep}", str(pulled)))
                shutil.rmtree(pulled)

            def s5_up(rep: int) -> None:
                results["s5cmd_up"].append(s5(shards, f"s3://bench/s5-{rep}/"))

            def our_push(rep: int) -> None:
                results["push"].append(ours("push", str(local), f"s3://bench/bd-{rep}"))

            for rep in range(args.repeats):
                # Fresh destinations each round (nothing is skipped as already verified); the order alternates so
                # neither tool always runs right after the server has just absorbed an upload.
                up, down = [s5_up, our_push], [s5_down, our_pull]
                for step in (up + down) if rep % 2 == 0 else (up[::-1] + down[::-1]):
                    step(rep)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(name: str) -> tuple[float, int, float]:
        """(MB/s of the fastest run, peak RSS MiB over runs, CPU seconds per GiB of the fastest run)."""
        seconds, _, cpu = min(results[name])
        return total / seconds / 1e6, max(r for _, r, _ in results[name]), cpu / (total / 1024**3)

    def ratios(ours: str, theirs: str) -> list[float]:
        """Throughput ratio per round: each against the reference measured beside it."""
        return [t[0] / o[0] for o, t in zip(results[ours], results[theirs], strict=True)]

    print(f"artifact: {total / MIB:.0f} MiB in {args.files} files; {args.repeats} rounds; MB/s = 1e6 bytes/s")
    print(f"{'transfer':<18}{'best MB/s':>10}{'median MB/s':>12}{'peak RSS MiB':>14}{'CPU s/GiB':>11}   all runs (s)")
    for name, label in [("push", "push + verify"), ("s5cmd_up", "s5cmd cp up"), ("pull", "pull + verify"),
                        ("s5cmd_down", "s5cmd cp down")]:
        rate, rss, cpu = best(name)
        median = total / sorted(t for t, _, _ in results[name])[len(results[name]) // 2] / 1e6
        runs = " ".join(f"{t:.2f}" for t, _, _ in results[name])
        print(f"{label:<18}{rate:>10.0f}{median:>12.0f}{rss:>14}{cpu:>11.2f}   {runs}")
    for label, ours, theirs, goal in [("push+verify / s5cmd up", "push", "s5cmd_up", 1.0),
                                      ("pull+verify / s5cmd down", "pull", "s5cmd_down", 0.8)]:
        each = ratios(ours, theirs)
        listed = " ".join(f"{r:.2f}" for r in each)
        print(f"RATIO {label}, same round: best {max(each):.2f}, median {sorted(each)[len(each) // 2]:.2f} "
              f"({listed})   (goal >= {goal})")
    print(f"(load average before {load_before}, after {_loadavg()}, on {os.cpu_count()} cores)")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])

if __name__ == "__main__":
    main()
