"""`train` at the real job's scale: no per-step or per-checkpoint cost that grows with the run's length or the data's
size.

The row order is drawn once per epoch (and stays the order it always was), checkpoints carry only their window of the
metrics log, the curves are redrawn from the file now and then rather than at every checkpoint, and old checkpoints are
pruned by default. Everything runs on the golden tiny target on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.train_data import config_file, logged_losses, make_rows, write_tokenized

from blockdraft.config import load_config
from blockdraft.model.formats import checkpoint_key
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run
from blockdraft.stages.train.checkpoint import prune_checkpoints
from blockdraft.stages.train.data import RowOrder, steps_per_epoch
from blockdraft.stages.train.metrics import METRICS_NAME, PLOT_NAME, MetricsLog, read_curves
from blockdraft.stages.train.trainer import Trainer
from blockdraft.store import open_store
from blockdraft.store.artifact import State, commit_artifact, entry_for_local_file, verify_artifact


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(5, prompt_len=4, new_tokens=12, seed=3)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:4], rows[4:])


def old_step_rows(num_rows: int, seed: int, epoch: int, step_in_epoch: int, global_batch: int, rank: int,
                  per_rank: int) -> list[int]:
    """The row order as `train` drew it before: a full permutation at every step (the reference the new order must
    equal)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch) % 2**63)
    order = torch.randperm(num_rows, generator=g)
    first = step_in_epoch * global_batch + rank * per_rank
    return [int(order[i % num_rows]) for i in range(first, first + per_rank)]


@pytest.mark.parametrize(("num_rows", "per_rank", "ranks", "seed"),
                         [(103, 4, 2, 0), (10, 3, 1, 7), (1, 1, 1, 2), (64, 8, 4, 5)])
def test_row_order_is_the_old_one_and_drawn_once_per_epoch(monkeypatch, num_rows, per_rank, ranks, seed):
    drawn = []
    randperm = torch.randperm

    def counted(n, *args, **kwargs):
        drawn.append(n)
        return randperm(n, *args, **kwargs)

    global_batch = per_rank * ranks
    per_epoch = steps_per_epoch(num_rows, global_batch)
    orders = [RowOrder(num_rows, seed, global_batch, per_rank) for _ in range(ranks)]
    monkeypatch.setattr(torch, "randperm", counted)
    got = {(e, s, r): orders[r].rows(e, s, r) for e in range(2) for s in range(per_epoch) for r in range(ranks)}
    assert drawn == [num_rows] * 2 * ranks  # once per epoch on each rank, not once per step
    monkeypatch.setattr(torch, "randperm", randperm)
    for (epoch, step, rank), rows in got.items():
        assert rows == old_step_rows(num_rows, seed, epoch, step, global_batch, rank, per_rank), (epoch, step, rank)


def window_steps(ckpt: Path, step: int) -> list[int]:
    return [json.loads(line)["step"] for line in (ckpt / checkpoint_key(step) / METRICS_NAME).read_text().splitlines()]


def test_checkpoints_hold_only_their_window_and_the_curves_are_drawn_at_the_end(tmp_path, data_url, monkeypatch):
    monkeypatch.setattr(Trainer, "RECENT_METRICS", 3)
    cfg = load_config(config_file(tmp_path, data_url, max_steps=6, checkpoint_every=2, batch_size=2))
    result = run(cfg).details
    ckpt = tmp_path / "ckpt"
    assert [window_steps(ckpt, s) for s in (2, 4, 6)] == [[1, 2], [3, 4], [5, 6]]
    assert sorted(logged_losses(tmp_path / "logs")) == list(range(1, 7))  # the local log has the whole run
    # The curves were not redrawn at every checkpoint: the earlier ones have none (plot_every_minutes = 10), the last
    # holds the whole run's.
    assert [(ckpt / checkpoint_key(s) / PLOT_NAME).is_file() for s in (2, 4, 6)] == [False, False, True]
    assert (ckpt / checkpoint_key(6) / PLOT_NAME).read_bytes() == (tmp_path / "logs" / PLOT_NAME).read_bytes()
    # No rank holds the history: the result keeps the last RECENT_METRICS steps.
    assert ([e["step"] for e in result.metrics], result.steps_run) == ([4, 5, 6], 6)
    report = verify_artifact(open_store(ckpt).child(checkpoint_key(6)))
    assert report.manifest is not None and report.manifest.counts["last"]["step"] == 6


def test_resume_keeps_the_local_log_up_to_the_checkpoint_or_restarts_from_its_window(tmp_path, data_url):
    path = config_file(tmp_path, data_url, max_steps=4, checkpoint_every=2, batch_size=2)
    run(load_config(path))
    losses = logged_losses(tmp_path / "logs")
    # A crashed run had logged a step after the checkpoint: the resumed log drops it and goes on from step 4.
    with open(tmp_path / "logs" / METRICS_NAME, "a") as f:
        f.write(json.dumps({"step": 5, "loss": 123.0, "slot_accuracy": [0, 0, 0]}) + "\n")
    path.write_text(path.read_text().replace("max_steps = 4", "max_steps = 6"))
    run(load_config(path), reporter=(quiet := Reporter()), force=True)  # a longer schedule: --force, a new cosine
    got = logged_losses(tmp_path / "logs")
    assert sorted(got) == list(range(1, 7)) and got[5] != 123.0 and all(got[s] == losses[s] for s in range(1, 5))
    assert [w for w in quiet.warnings if not w.startswith("--force: a new cosine")] == []  # nothing about the log
    assert window_steps(tmp_path / "ckpt", 6) == [5, 6]

    # The log is lost with its machine: the resumed run restarts it from the checkpoint's window and says so.
    (tmp_path / "logs" / METRICS_NAME).unlink()
    path.write_text(path.read_text().replace("max_steps = 6", "max_steps = 8"))
    run(load_config(path), reporter=(told := Reporter()), force=True)
    assert sorted(logged_losses(tmp_path / "logs")) == [5, 6, 7, 8]
    (said,) = [w for w in told.warnings if not w.startswith("--force: a new cosine")]
    assert "restarts with the checkpoint's entries from step 5 on" in said


def test_default_keeps_the_newest_three_and_every_tenth_checkpoint(tmp_path, data_url):
    cfg = load_config(config_file(tmp_path, data_url, max_steps=23, checkpoint_every=1, batch_size=1, log_every=5))
    assert (cfg.train.keep_checkpoints, cfg.train.keep_checkpoint_every) == (3, 10)
    run(cfg)
    left = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if any(p.iterdir()))
    assert left == [checkpoint_key(s) for s in (10, 20, 21, 22, 23)]
    assert all(verify_artifact(open_store(tmp_path / "ckpt" / name)).state is State.VERIFIED for name in left)
    # log_every 5: each checkpoint holds the entries logged since the one before (its own step, whose held-out figures
    # it measured), never the history.
    assert [window_steps(tmp_path / "ckpt", s) for s in (20, 21, 22)] == [[20], [21], [22]]


def fake_checkpoint(root: Path, step: int) -> None:
    folder = root / checkpoint_key(step)
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(bytes([step]) * 64)
    commit_artifact(open_store(folder), "drafter-checkpoint", [entry_for_local_file(folder, folder / "weights.bin")])


def test_pruning_never_deletes_the_newest_verified_checkpoint(tmp_path):
    for step in range(1, 8):
        fake_checkpoint(tmp_path, step)
    for step in (6, 7):  # the newest two do not verify (a push that went wrong after its manifest)
        (tmp_path / checkpoint_key(step) / "weights.bin").write_bytes(b"x" * 64)
    store = open_store(tmp_path)
    assert prune_checkpoints(store, keep=1, keep_every=2) == [3, 1]  # 5 is the newest that verifies; even steps stay
    left = [s for s in range(1, 8) if verify_artifact(store.child(checkpoint_key(s))).state is State.VERIFIED]
    assert left == [2, 4, 5]
    assert prune_checkpoints(store, keep=2, keep_every=None) == [2]  # newest verified two: 5 and 4
    assert prune_checkpoints(store, keep=9, keep_every=None) == []  # fewer than `keep` verify: nothing goes


def test_curves_are_redrawn_at_most_every_interval_from_bounded_points(tmp_path):
    clock, warned = [0.0], []
    log = MetricsLog(tmp_path, plot_every_s=600, warn=warned.append)
    log.plotter.clock = lambda: clock[0]
    log.plotter._started = 0.0
    log.start_fresh()
    for step in range(1, 5001):
        log.append({"step": step, "loss": 1.0 / step, "tau_estimate": 1.5, "slot_accuracy": [0.5, 0.25]})
        clock[0] += 1.0  # a second per step: 5000 s, so at most 8 redraws (600 s apart) and one in flight at a time
        if step % 1000 == 0:
            log.plotter.wait()
    log.plotter.wait()
    assert 1 <= log.plotter.draws <= 8 and warned == []
    assert (tmp_path / PLOT_NAME).stat().st_size > 1000
    points = read_curves(tmp_path / METRICS_NAME, max_points=100)
    assert 100 <= len(points) < 200  # 5000 entries in bins of 32: the plot's cost does not grow with the log
    assert points[0]["step"] == pytest.approx(16.5)
    last = {"step": 4996.5, "loss": sum(1 / s for s in range(4993, 5001)) / 8, "tau_estimate": 1.5,
            "slot_accuracy/1": 0.5, "slot_accuracy/2": 0.25}
    assert points[-1] == pytest.approx(last)
