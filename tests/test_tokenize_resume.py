"""Kill and resume: `blockdraft tokenize` SIGKILLed midway, then rerun, ends with exactly the rows of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenize_helpers import TOKENIZER_DIR, config, files_of, make_corpus, piece_names, rows_of, tokenize

from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact

CLI = [sys.executable, "-c", "from blockdraft.cli import main; main()"]


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_midway_then_rerun_gives_the_uninterrupted_rows(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=8, per_file=150)
    out = tmp_path / "out"
    cmd = [*CLI, "tokenize", str(corpus), str(out), "--tokenizer", str(TOKENIZER_DIR), "--workers", "2", "--held-out-fraction", "0.1"]
    env = {**os.environ, "TERM": "dumb", "COLUMNS": "200"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not piece_names(out):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no shard finished in 120 s"
            workers |= children_of(proc.pid)
            time.sleep(0.01)
        workers |= children_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.stdout.close()

    # Killed midway: some shards recorded as pieces, no manifest; the workers die with their parent.
    recorded = len(piece_names(out))
    assert 1 <= recorded < 8
    assert not (out / MANIFEST_NAME).exists()
    assert verify_artifact(open_store(out)).state is State.INCOMPLETE
    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers and not any(alive(p) for p in workers)

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming:" in rerun.stderr and "of 8 shards already done" in rerun.stderr

    reference = tokenize(corpus, tmp_path / "ref", config(workers=1, held_out_fraction=0.1))
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    resumed, expected = rows_of(out), rows_of(tmp_path / "ref")
    assert resumed == expected  # none lost, none duplicated, same order
    assert sum(len(v) for v in resumed.values()) == reference.details.counts["rows_out"]
    assert files_of(out) == files_of(tmp_path / "ref")
    assert not [p for p in out.rglob(".tmp-*")]
