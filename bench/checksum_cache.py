"""`blockdraft status` on a local folder of many files: with the checksum cache (`store/checksum_cache.py`) against
reading every byte again (`--deep`, what the listing would do without the cache).

    .venv/bin/python -m bench.checksum_cache [--artifacts 4] [--files 500] [--kib 256] [--repeats 3]

The folder holds `--artifacts` artifacts of `--files` files of `--kib` KiB each (random bytes), their mtimes set 10 s
back so the cache may remember them. Every run is the whole command in its own process (interpreter start-up
included), with its own empty cache directory per mode: `first` fills the cache (reads every byte), `cached` is every
later listing, `deep, page cache warm` re-reads files the kernel still holds, `deep, evicted` re-reads them after
`posix_fadvise(DONTNEED)` pushed them out of the page cache (the case of a listing hours later). Wall seconds and CPU
seconds (user+sys) of the command, median over `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.transfer import REPO, _loadavg, run_measured
from blockdraft.store import open_store
from blockdraft.store.artifact import commit_artifact, entry_for_local_file


def make_folder(root: Path, artifacts: int, files: int, kib: int) -> int:
    total = 0
    then = time.time() - 10
    for a in range(artifacts):
        art = root / f"art-{a}"
        art.mkdir(parents=True)
        for i in range(files):
            p = art / f"piece-{i:05d}.bin"
            p.write_bytes(os.urandom(kib * 1024))
            os.utime(p, (then, then))
            total += kib * 1024
        commit_artifact(open_store(art), "bench", [entry_for_local_file(art, p) for p in sorted(art.glob("piece-*"))])
    return total


def evict(root: Path) -> None:
    """Drop the folder's clean pages from the page cache (no root needed for this)."""
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=4)
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--kib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="bd-bench-cache-"))
    try:
        folder = work / "store"
        total = make_folder(folder, args.artifacts, args.files, args.kib)
        status = [sys.executable, "-m", "blockdraft", "status", str(folder)]

        def run(mode: str, argv: list[str], cache: Path, before=None) -> tuple[float, float]:
            if before:
                before()
            env = {**os.environ, "BLOCKDRAFT_CACHE_DIR": str(cache)}
            seconds, _, cpu, out = run_measured(argv, env)
            assert out.count("verified") == args.artifacts, out[-2000:]
            return seconds, cpu

        results: dict[str, list[tuple[float, float]]] = {}
        for rep in range(args.repeats):
            cache = work / f"cache-{rep}"
            results.setdefault("first (fills the cache)", []).append(run("first", status, cache))
            results.setdefault("cached", []).append(run("cached", status, cache))
            results.setdefault("deep, page cache warm", []).append(run("deep", status + ["--deep"], work / "unused"))
            results.setdefault("deep, evicted", []).append(run("deep", status + ["--deep"], work / "unused",
                                                               lambda: evict(folder)))
            results.setdefault("cached, evicted", []).append(run("cached", status, cache, lambda: evict(folder)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n = args.artifacts * args.files
    print(f"folder: {args.artifacts} artifacts, {n} files, {total / 2**20:.0f} MiB; `blockdraft status`, median of "
          f"{args.repeats}")
    cached = statistics.median(s for s, _ in results["cached"])
    print(f"{'run':<28}{'wall s':>8}{'CPU s':>8}{'wall / cached':>15}   all (s)")
    for mode, runs in results.items():
        wall = statistics.median(s for s, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{mode:<28}{wall:>8.2f}{cpu:>8.2f}{wall / cached:>15.1f}   " + " ".join(f"{s:.2f}" for s, _ in runs))
    print(f"(load average before {load_before}, after {_loadavg()}, on {os.cpu_count()} cores)")


if __name__ == "__main__":
    os.chdir(REPO)
    main()
