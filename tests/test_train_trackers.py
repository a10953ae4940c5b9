"""`train.report_to`: every logged step's metrics also reach TensorBoard and W&B, beside metrics.jsonl and outside
the checkpoints; a tracker that cannot start is one warning line and training goes on.

Real trackers: TensorBoard's events are read back with its own EventAccumulator; W&B runs in its offline mode (no
network), and fails for real (no API key) when asked to go online.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.train_data import config_file, make_rows, write_tokenized
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from blockdraft.config import load_config
from blockdraft.model.formats import checkpoint_key
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact

SCALARS = ("loss", "tau_estimate", "lr", "grad_norm", "tokens_per_s", "step_time_s", "supervised_tokens_per_s",
           "padding_share")


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(4, prompt_len=6, new_tokens=24, seed=3)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:3], rows[3:])


def with_wandb(path: Path, **settings: str) -> Path:
    """The config file at `path` (its [train] table last) with train.wandb set to `settings`."""
    table = ", ".join(f'{key} = "{value}"' for key, value in settings.items())
    path.write_text(path.read_text() + f"wandb = {{ {table} }}\n")
    return path


def logged(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard reads the event files in `log_dir`."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def expected_scalars(entries: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What metrics.jsonl says each tag holds, at TensorBoard's float32 precision."""
    slots = len(entries[0]["slot_accuracy"])
    tags = {f"train/{name}": (lambda e, n=name: e[n]) for name in SCALARS}
    for listed in ("slot_accuracy", "slot_loss"):
        tags |= {f"train/{listed}/{k + 1}": (lambda e, k=k, n=listed: e[n][k]) for k in range(slots)}
    scalars = {tag: [(e["step"], float(np.float32(value(e)))) for e in entries] for tag, value in tags.items()}
    held = [e for e in entries if "eval" in e]  # the held-out figures, at the steps that measured them
    evals = {f"eval/{name}": (lambda h, n=name: h[n]) for name in ("loss", "tau_estimate", "padding_share")}
    for listed in ("slot_accuracy", "slot_loss"):  # the held-out figures are the training ones' (`metrics.Figures`)
        evals |= {f"eval/{listed}/{k + 1}": (lambda h, k=k, n=listed: h[n][k]) for k in range(slots)}
    scalars |= {
        tag: [(e["step"], float(np.float32(value(e["eval"])))) for e in held] for tag, value in evals.items() if held
    }
    return scalars


def test_tensorboard_and_wandb_offline_get_every_metric_at_every_logged_step(tmp_path, data_url):
    path = config_file(tmp_path, data_url, max_steps=6, checkpoint_every=3, log_every=2, batch_size=3,
                       report_to=["tensorboard", "wandb"])
    cfg = load_config(with_wandb(path, mode="offline", project="blockdraft-tests"))
    run(cfg, reporter=(reporter := Reporter()))
    logs = tmp_path / "logs"
    entries = logged(logs)
    # Every log_every-th step, and the checkpoint of step 3, which measured the held-out rows.
    assert [e["step"] for e in entries] == [2, 3, 4, 6] and reporter.warnings == []
    assert [e["step"] for e in entries if "eval" in e] == [3, 6]
    # 3 slots (block size 4): 12 train/ tags and 8 eval/ tags
    assert tensorboard_scalars(logs) == expected_scalars(entries)

    # W&B's offline run folder, under the log folder: its record file holds every tracked name.
    (run_folder,) = (logs / "wandb").glob("offline-run-*")
    (records,) = run_folder.glob("run-*.wandb")
    assert all(tag.encode() in records.read_bytes() for tag in expected_scalars(entries))
    # A rerun with every step done starts no W&B run and logs nothing.
    assert run(cfg).already_done and len(list((logs / "wandb").glob("offline-run-*"))) == 1
    assert tensorboard_scalars(logs) == expected_scalars(entries)

    # The trackers' files stay out of the checkpoints, which still verify.
    for step in (3, 6):
        report = verify_artifact(open_store(tmp_path / "ckpt").child(checkpoint_key(step)), check_inputs=True)
        assert report.state is State.VERIFIED, report.summary()
        assert not [f.path for f in report.manifest.files if "tfevents" in f.path or "wandb" in f.path]


def test_a_resumed_run_replaces_the_steps_it_redoes_in_tensorboard(tmp_path, data_url):
    path = config_file(tmp_path, data_url, max_steps=4, checkpoint_every=2, batch_size=3, report_to=["tensorboard"])
    run(load_config(path))
    # The step-4 checkpoint is lost: the run resumes at step 2 and logs steps 3 and 4 again, in a new event file.
    shutil.rmtree(tmp_path / "ckpt" / checkpoint_key(4))
    path.write_text(path.read_text().replace("max_steps = 4", "max_steps = 5"))
    run(load_config(path), force=True)  # another schedule: --force continues with a new cosine
    logs = tmp_path / "logs"
    assert len(list(logs.glob("events.out.tfevents.*"))) == 2
    got = tensorboard_scalars(logs)
    assert [step for step, _ in got["train/loss"]] == [1, 2, 3, 4, 5]  # each step once: the first run's 3 and 4 purged
    assert got == expected_scalars(logged(logs))


def test_a_tracker_that_cannot_start_is_one_warning_and_training_goes_on(tmp_path, data_url, monkeypatch):
    # W&B online with no API key anywhere (no variable, no netrc, no settings file): wandb.init refuses, for real.
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "no-wandb-config"))
    path = config_file(tmp_path, data_url, max_steps=2, checkpoint_every=2, batch_size=3,
                       report_to=["wandb", "tensorboard"])
    done = run(load_config(with_wandb(path, mode="online")), reporter=(reporter := Reporter()))
    assert len(reporter.warnings) == 1
    assert reporter.warnings[0].startswith("train.report_to: wandb did not start (UsageError: No API key configured")
    assert reporter.warnings[0].endswith("; training goes on without it")
    assert done.report.state is State.VERIFIED and done.details.steps == 2
    assert tensorboard_scalars(tmp_path / "logs") == expected_scalars(logged(tmp_path / "logs"))
