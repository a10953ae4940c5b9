"""One writer per output: a lease at the output's root, taken by push, pull, tokenize, generate, export, eval and train.

Another writer is stood in for by the lease record it would leave (another host and pid, a live expiry), which is all a
writer ever sees of another; the concurrent-push test runs two real `blockdraft push` processes against SeaweedFS.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from helpers.artifacts import commit_files
from helpers.tokenize_data import TOKENIZER_DIR, make_corpus
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import LeaseError
from blockdraft.reporter import Reporter
from blockdraft.stages import train
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, read_manifest, verify_artifact
from blockdraft.store.base import LEASE_NAME
from blockdraft.store.lease import LeaseRecord
from blockdraft.store.output import StageOutput
from blockdraft.store.status import status
from blockdraft.store.transfer import pull, push


def _foreign_lease(root, expires_in: float = 600.0) -> LeaseRecord:
    """The lease another live writer (pid 4242 on host `train-node-7`) holds on the output at `root`."""
    now = time.time()
    record = LeaseRecord("train-node-7:4242:abc", "train-node-7", 4242, "blockdraft push", now, now + expires_in)
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_NAME).write_bytes(record.to_bytes())
    return record


@pytest.fixture(autouse=True)
def _leases(leases_given_back):
    """Every test here: no --force left behind, every lease given back (`leases_given_back`)."""


def test_a_push_into_an_output_another_writer_holds_fails_naming_it(tmp_path):
    old = commit_files(tmp_path / "old", {"a.bin": b"old" * 100}, kind="tokenized")
    new = commit_files(tmp_path / "new", {"a.bin": b"new" * 100}, kind="tokenized")
    dest = tmp_path / "store" / "tokenized"
    push(old, str(dest))
    before = (dest / MANIFEST_NAME).read_bytes()
    _foreign_lease(dest)

    out = CliRunner().invoke(app, ["push", str(new), str(dest)])
    assert out.exit_code == 2, out.output
    assert "pid 4242 on train-node-7" in out.output and "--force" in out.output
    assert (dest / MANIFEST_NAME).read_bytes() == before and (dest / "a.bin").read_bytes() == b"old" * 100

    # --force: the user says that writer is dead; the push takes over, commits, and gives the lease back.
    out = CliRunner().invoke(app, ["push", str(new), str(dest), "--force"])
    assert out.exit_code == 0, out.output
    assert (dest / "a.bin").read_bytes() == b"new" * 100 and not (dest / LEASE_NAME).exists()


def test_an_expired_lease_is_taken_over(tmp_path):
    art = commit_files(tmp_path / "art", {"a.bin": b"x" * 10}, kind="tokenized")
    dest = tmp_path / "dest"
    _foreign_lease(dest, expires_in=-1.0)  # its writer died and stopped renewing
    reporter = Reporter()
    push(art, str(dest), reporter=reporter)
    assert len(reporter.warnings) == 1 and "taking over the lease" in reporter.warnings[0]
    assert verify_artifact(open_store(dest)).state is State.VERIFIED and not (dest / LEASE_NAME).exists()


def test_a_lease_left_by_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    """kill -9 leaves the lease behind with a live expiry; a rerun on the same machine must still resume."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / LEASE_NAME).write_bytes(LeaseRecord(f"{socket.gethostname()}:{gone.pid}:x", socket.gethostname(), gone.pid,
                                                "blockdraft push", now, now + 600).to_bytes())
    art = commit_files(tmp_path / "art", {"a.bin": b"x" * 10}, kind="tokenized")
    reporter = Reporter()
    push(art, str(dest), reporter=reporter)
    assert len(reporter.warnings) == 1 and f"pid {gone.pid}" in reporter.warnings[0]
    assert verify_artifact(open_store(dest)).state is State.VERIFIED


def test_a_writer_that_lost_its_lease_never_commits(tmp_path):
    out = StageOutput(str(tmp_path / "out"), "test", "key")
    out.begin()
    (tmp_path / "out" / "f.bin").write_bytes(b"data")
    _foreign_lease(tmp_path / "out")  # another writer took it over (say, with --force) while this one ran
    from blockdraft.store.artifact import entry_for_local_file

    with pytest.raises(LeaseError, match="lost the lease .* pid 4242 on train-node-7"):
        out.commit([entry_for_local_file(tmp_path / "out", tmp_path / "out" / "f.bin")])
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    out.release()


def test_tokenize_and_train_refuse_an_output_another_run_writes(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=1, per_file=4)
    _foreign_lease(tmp_path / "tok")
    out = CliRunner().invoke(app, ["tokenize", str(corpus), str(tmp_path / "tok"), "--tokenizer", str(TOKENIZER_DIR)])
    assert out.exit_code == 2 and "is being written by pid 4242 on train-node-7" in out.output, out.output
    assert not (tmp_path / "tok" / MANIFEST_NAME).exists()

    rows = make_rows(3, prompt_len=4, new_tokens=12, seed=0)
    data = write_tokenized(tmp_path / "data", rows[:2], rows[2:])
    _foreign_lease(tmp_path / "ckpt")
    with pytest.raises(LeaseError, match="pid 4242 on train-node-7"):
        train.run(load_config(config_file(tmp_path, data, max_steps=2)))
    assert not any((tmp_path / "ckpt").glob("step-*"))


def test_status_ignores_leases_and_sees_a_half_written_output_as_one_artifact(tmp_path):
    store = tmp_path / "store"
    commit_files(store / "done", {"a": b"1"}, kind="tokenized")
    _foreign_lease(store / "done")
    half = store / "tokenized"
    for rel in ("train/data-00000.arrow", "held_out/data-00000.arrow", ".blockdraft-pieces/shard-00000.json"):
        (half / rel).parent.mkdir(parents=True, exist_ok=True)
        (half / rel).write_bytes(b"partial")
    _foreign_lease(half)
    states = {a.root: a.state for a in status(open_store(store))}
    assert states == {"done": State.VERIFIED, "tokenized": State.INCOMPLETE}
    assert {a.root: a.state for a in status(open_store(half))} == {"": State.INCOMPLETE}


def test_a_refused_pull_leaves_the_verified_local_copy_untouched(tmp_path):
    good = commit_files(tmp_path / "store" / "v1", {"a.bin": b"A" * 1000, "b.bin": b"B" * 1000}, kind="tokenized")
    local = tmp_path / "node" / "copy"
    pull(str(good), local)
    before = {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()}
    bad = commit_files(tmp_path / "store" / "v2", {"a.bin": b"C" * 1000, "b.bin": b"D" * 1000}, kind="tokenized")
    data = bytearray((bad / "b.bin").read_bytes())
    data[10] ^= 1
    (bad / "b.bin").write_bytes(bytes(data))  # same size: only reading the bytes shows it
    out = CliRunner().invoke(app, ["pull", str(bad), str(local)])
    assert out.exit_code == 2 and "refusing to pull" in out.output and "b.bin" in out.output, out.output
    assert {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()} == before
    assert verify_artifact(open_store(local)).state is State.VERIFIED


@pytest.mark.s3
@pytest.mark.slow
def test_two_concurrent_pushes_to_one_prefix_never_leave_a_false_verified(tmp_path, s3_env):
    """Two real processes push different artifacts to one S3 prefix at once, twice: whoever says `verified` is what the
    prefix holds when both are done (or was, before the other committed after it), and a loser exits 2 naming the
    owner."""
    arts = [
        commit_files(tmp_path / f"a{i}", {f"shard-{k}.bin": bytes([i]) * 3_000_000 for k in range(4)}, kind="tokenized")
        for i in range(2)
    ]
    manifests = [(a / MANIFEST_NAME).read_bytes() for a in arts]
    for trial in range(2):
        url = f"s3://{s3_env.new_bucket()}/run/tokenized"
        procs = [subprocess.Popen([sys.executable, "-m", "blockdraft", "push", str(a), url], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for a in arts]
        results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
        winners = [i for i, (rc, _, _) in enumerate(results) if rc == 0]
        assert winners, results
        for rc, _, err in results:
            assert rc in (0, 2), err
            if rc == 2:
                assert "is being written by pid" in err, err
        report = verify_artifact(open_store(url), deep=True)
        assert report.state is State.VERIFIED, (trial, report.summary())
        found = read_manifest(open_store(url))
        assert found is not None and found[1] in [manifests[i] for i in winners]
        assert not any(info.key.endswith(LEASE_NAME) for info in open_store(url).list())
    json.dumps([r[0] for r in results])  # outcomes are plain exit codes
