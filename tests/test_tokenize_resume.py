"""Kill and resume: `blockdraft tokenize` SIGKILLed midway, then rerun, ends with exactly the rows of an uninterrupted
run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import TOKENIZER_DIR
from helpers.tokenize_data import config, files_of, make_corpus, piece_names, rows_of, tokenize

from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.base import TMP_PREFIX

CLI = [sys.executable, "-m", "blockdraft"]


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


def freeze_at_first_piece(proc: subprocess.Popen, out: Path) -> set[int]:
    """Poll until `out` records a finished piece, then SIGSTOP the whole process group (the CLI and its workers, which
    record pieces themselves) so the count cannot move before the kill; the pids of the CLI's children. The deadline
    only bounds a hang."""
    workers: set[int] = set()
    deadline = time.monotonic() + 300
    while not piece_names(out):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no shard finished in 300 s"
        workers |= children_of(proc.pid)
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGSTOP)
    return workers | children_of(proc.pid)


@pytest.mark.slow
@pytest.mark.fault
def test_sigkill_midway_then_rerun_gives_the_uninterrupted_rows(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=8, per_file=150)
    out = tmp_path / "out"
    cmd = [*CLI, "tokenize", str(corpus), str(out), "--tokenizer", str(TOKENIZER_DIR), "--workers", "2",
           "--held-out-fraction", "0.1"]
    env = {**os.environ, "TERM": "dumb", "COLUMNS": "200"}
    # Its own process group, so that it and its workers can be frozen together (and nothing else is).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        workers = freeze_at_first_piece(proc, out)
        recorded = len(piece_names(out))  # frozen: what the kill leaves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            # a stopped worker can only notice its parent's death once it runs again
            os.killpg(proc.pid, signal.SIGCONT)
    proc.stdout.close()

    # Killed midway: some shards recorded as pieces, no manifest; the workers die with their parent.
    assert 1 <= recorded < 8 and len(piece_names(out)) == recorded
    assert not (out / MANIFEST_NAME).exists()
    assert verify_artifact(open_store(out)).state is State.INCOMPLETE
    deadline = time.monotonic() + 120  # bounds a hang only
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
    assert not [p for p in out.rglob(TMP_PREFIX + "*")]
