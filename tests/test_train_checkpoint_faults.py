"""Checkpoints pushed in the background: training goes on while one is pushed and while the store is down, a checkpoint
whose push failed is never resumed from, failures in a row stop the run with one line, and a success resets the count.

The store is a real SeaweedFS server that the test stops and starts again. Each stop and start happens on the training
thread when the run reports the checkpoint before (its line or its warning), so which pushes fail never depends on
timing: a push that starts while the server is down fails, one that starts after it is back succeeds.

Beside them: what a checkpoint saves is a copy taken at its step, its RNG state holds no GPU but the drafter's, and a
checkpoint of another format is refused with one line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
import torch
from helpers.paths import GOLDEN_TARGET
from helpers.train_data import config_file, logged_losses, make_rows, write_tokenized
from transformers import AutoConfig

from blockdraft.config import DFlashConfig, load_config
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.model import DFlashDrafter, DrafterSpec
from blockdraft.model.formats import checkpoint_key, find_resumable
from blockdraft.reporter import Reporter
from blockdraft.stages.train import run
from blockdraft.stages.train.checkpoint import CHECKPOINT_FORMAT, Checkpoints, RunIdentity, Snapshot, save_checkpoint
from blockdraft.stages.train.metrics import MetricsLog
from blockdraft.stages.train.ranks import rng_state, set_rng_state
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef, State, verify_artifact


class Scripted(Reporter):
    """Keeps what the run reported, in order, as ("progress", step) / ("say", line) / ("warn", line), and runs the
    action of the first line that begins with one of `actions`' keys (once each)."""

    def __init__(self, actions: dict[str, Callable[[], None]]) -> None:
        super().__init__()
        self.actions = dict(actions)
        self.events: list[tuple[str, object]] = []

    def _act(self, line: str) -> None:
        for start in [s for s in self.actions if line.startswith(s)]:
            self.actions.pop(start)()

    def say(self, line: str) -> None:
        super().say(line)
        self.events.append(("say", line))
        self._act(line)

    def warn(self, line: str) -> None:
        super().warn(line)
        self.events.append(("warn", line))
        self._act(line)

    def progress(self, task, completed, total=None, **fields) -> None:
        if task == "train":
            self.events.append(("progress", int(completed)))

    def at(self, kind: str, what: str | int) -> int:
        """Where the first `kind` event was reported that is `what` (a step) or begins with it (a line)."""
        return next(
            i for i, (k, v) in enumerate(self.events) if k == kind and (v == what or str(v).startswith(str(what)))
        )


@pytest.fixture
def store_env(own_s3_server, monkeypatch, tmp_path):
    """A server of this test's own (it stops it) with a bucket; its admin identity in the environment."""
    for key, value in own_s3_server.admin.env(own_s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    own_s3_server.client().create_bucket(Bucket="ckpt")
    return own_s3_server


@pytest.fixture(scope="module")
def data_url(tmp_path_factory) -> str:
    rows = make_rows(3, prompt_len=5, new_tokens=24, seed=2)
    return write_tokenized(tmp_path_factory.mktemp("tokenized"), rows[:2], rows[2:])


def settings(**train) -> dict:
    return {"checkpoint_every": 2, "batch_size": 1, **train}


def checkpoint_states(out, steps) -> dict[int, State]:
    return {step: verify_artifact(out.child(checkpoint_key(step))).state for step in steps}


@pytest.mark.fault
def test_store_down_training_goes_on_failures_in_a_row_stop_the_run_and_resume_takes_the_last_verified(
    store_env, data_url, tmp_path
):
    out_url = "s3://ckpt/runs/r1"
    cfg = load_config(config_file(tmp_path, data_url, output=out_url, max_steps=12, **settings()))
    reporter = Scripted({"checkpoint step 2:": store_env.stop})
    with pytest.raises(ArtifactError) as stopped:
        run(cfg, reporter=reporter)

    # One line naming the count, the store, the last failed step, the fix and where a rerun resumes.
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith(f"3 checkpoints in a row did not verify at {open_store(out_url, cfg.store).url} (the last, "
                           "step 8: ")
    assert "unreachable" in line and store_env.admin.secret_key not in line
    assert line.endswith(
        "training stopped: fix the store, then rerun to resume from the verified checkpoint of step 2 "
        "(train.max_checkpoint_failures = 3)"
    )
    # Checkpoint 2 was pushed while training went on (taken in after step 3), and training went on past each failure.
    assert reporter.at("say", "checkpoint step 2:") > reporter.at("progress", 3)
    warned = [w for w in reporter.warnings if w.startswith("checkpoint of step")]
    assert [w.split(" did not verify")[0] for w in warned] == ["checkpoint of step 4", "checkpoint of step 6"]
    assert all("training goes on, it will not be resumed from" in w and "unreachable" in w for w in warned)
    assert reporter.at("warn", "checkpoint of step 4") > reporter.at("progress", 5)
    first_losses = logged_losses(tmp_path / "logs")
    assert set(range(1, 9)) <= set(first_losses) and max(first_losses) < 12

    # Back up: only checkpoint 2 verifies; the failed ones left no manifest, and the rerun resumes from 2 with the
    # losses the first run had (deterministic mode), then ends with a verified final checkpoint.
    store_env.start()
    out = open_store(out_url, cfg.store)
    assert checkpoint_states(out, (2, 4, 6, 8)) == {2: State.VERIFIED, 4: State.INCOMPLETE, 6: State.INCOMPLETE,
                                                    8: State.INCOMPLETE}
    assert (found := find_resumable(out)) is not None and found.step == 2
    again = run(cfg).details
    assert again.resumed_from == 2
    assert [e["loss"] for e in again.metrics[:6]] == [first_losses[s] for s in range(3, 9)]
    assert verify_artifact(out.child(checkpoint_key(12))).state is State.VERIFIED


@pytest.mark.fault
def test_a_verified_push_resets_the_failure_count(store_env, data_url, tmp_path):
    """train.max_checkpoint_failures = 2: pushes 4 and 8 fail, 6 between them verifies, so the run ends normally."""
    out_url = "s3://ckpt/runs/r2"
    cfg = load_config(config_file(tmp_path, data_url, output=out_url, max_steps=10,
                                  **settings(max_checkpoint_failures=2)))
    reporter = Scripted({
        "checkpoint step 2:": store_env.stop, "checkpoint of step 4 ": store_env.start,
        "checkpoint step 6:": store_env.stop, "checkpoint of step 8 ": store_env.start,
    })
    done = run(cfg, reporter=reporter)
    assert (
        done.report.state is State.VERIFIED and done.url == open_store(out_url, cfg.store).child(checkpoint_key(10)).url
    )
    assert not reporter.actions  # the server went down twice and came back twice
    failed = [w for w in reporter.warnings if w.startswith("checkpoint of step")]
    assert [w.split(" did not verify")[0] for w in failed] == ["checkpoint of step 4", "checkpoint of step 8"]
    assert "(1 failed in a row" in failed[1]  # counted from 0 again once 6 verified
    out = open_store(out_url, cfg.store)
    assert checkpoint_states(out, (2, 4, 6, 8, 10)) == {
        2: State.VERIFIED, 4: State.INCOMPLETE, 6: State.VERIFIED, 8: State.INCOMPLETE, 10: State.VERIFIED,
    }
    assert sorted(logged_losses(tmp_path / "logs")) == list(range(1, 11))


def test_rng_state_holds_the_cpu_python_and_only_the_drafter_devices_cuda_state():
    cpu = torch.device("cpu")
    state = rng_state(cpu)
    assert set(state) == {"torch", "python"}  # a CPU drafter: no CUDA state, and CUDA is never asked for one
    expected = (torch.rand(3), random.random())
    set_rng_state(state, cpu)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rng_state_is_the_drafter_devices_alone():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    state = rng_state(device)
    assert set(state) == {"torch", "python", "cuda"} and isinstance(state["cuda"], torch.Tensor)
    assert torch.equal(state["cuda"], torch.cuda.get_rng_state(device))
    expected = torch.rand(3, device=device)
    set_rng_state(state, device)
    assert torch.equal(torch.rand(3, device=device), expected)


def test_a_snapshot_holds_the_state_of_its_step_while_training_goes_on(tmp_path):
    """What the background writer saves is a copy taken at the step: later optimizer steps change nothing in it."""
    dflash = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=1, gamma=4.0,
                          intermediate_size=96)
    drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=0.1)

    def train_step() -> None:
        torch.stack([p.square().sum() for p in drafter.parameters()]).sum().backward()
        optimizer.step()

    train_step()
    log = MetricsLog(tmp_path / "logs")
    log.start_fresh()
    log.append({"step": 1, "loss": 1.0, "slot_accuracy": [0.5]})
    weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in optimizer.state_dict()["state"].items()}
    snapshot = Snapshot.take(1, drafter, {"optimizer": optimizer.state_dict()}, log, {"step": 1}, final=False)
    train_step()
    log.append({"step": 2, "loss": 0.5, "slot_accuracy": [0.6]})

    assert all(torch.equal(snapshot.drafter.state_dict()[k], v) for k, v in weights.items())
    assert not torch.equal(drafter.state_dict()["fc.weight"], weights["fc.weight"])  # control: training moved on
    saved = snapshot.training_state["optimizer"]["state"]
    assert all(torch.equal(saved[i]["exp_avg"], m) for i, m in moments.items())
    assert [json.loads(line)["step"] for line in snapshot.files[0].read_text().splitlines()] == [1]
    snapshot.discard()
    assert not snapshot.folder.exists()


def test_a_checkpoint_of_another_format_is_refused_with_one_line(tmp_path):
    """Resume reads `CHECKPOINT_FORMAT` only: a checkpoint whose run identity records no format (or another) stops the
    run with one line that says how to train again, and every setting (at its default too) is part of the identity."""
    dflash = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=1, gamma=4.0,
                          intermediate_size=96)
    drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash))
    config = load_config(None, {"target": {"path": "t"}})
    resolved = config.resolved()
    identity = RunIdentity.of(config.train, config.dflash, config.target.path, "sha").record()
    assert identity["format"] == CHECKPOINT_FORMAT and identity["dflash"]["loss_weighting"] == "exponential"
    (tmp_path / "data.bin").write_bytes(b"rows")
    data = InputRef(kind="raw", url=(tmp_path / "data.bin").as_uri(), size=4)
    store = open_store(tmp_path / "ckpt")
    unversioned = {key: value for key, value in identity.items() if key != "format"}
    save_checkpoint(store, 2, drafter, {}, resolved, [data], {"step": 2, "run": unversioned})
    checkpoints = Checkpoints(store, resolved, identity, data, None, None, Reporter())
    with pytest.raises(ConfigError, match=r"format unversioned, this blockdraft resumes only .*set train.output to a "
                                          r"new location"):
        checkpoints.newest()
    save_checkpoint(store, 4, drafter, {}, resolved, [data], {"step": 4, "run": identity})
    assert checkpoints.newest().step == 4  # the same format and identity resume


def test_a_checkpoint_of_the_same_settings_on_other_data_is_another_runs(tmp_path):
    """Whose a checkpoint is, is its `StageOutput`'s to say (the run identity and the data by content, by its stage
    key): the same recorded settings over other data are refused, and `has_checkpoint` agrees; the same data in another
    folder (pulled to another node) is the same run's."""
    dflash = DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, num_draft_layers=1, gamma=4.0,
                          intermediate_size=96)
    drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(GOLDEN_TARGET), dflash))
    config = load_config(None, {"target": {"path": "t"}})
    resolved = config.resolved()
    identity = RunIdentity.of(config.train, config.dflash, config.target.path, "sha").record()
    (tmp_path / "moved").mkdir()
    for name, content in (("data.bin", b"rows"), ("other.bin", b"more rows"), ("moved/data.bin", b"rows")):
        (tmp_path / name).write_bytes(content)
    data, other, moved = (InputRef(kind="raw", url=(tmp_path / name).as_uri(), size=(tmp_path / name).stat().st_size)
                          for name in ("data.bin", "other.bin", "moved/data.bin"))
    store = open_store(tmp_path / "ckpt")
    save_checkpoint(store, 2, drafter, {}, resolved, [other], {"step": 2, "run": identity})
    checkpoints = Checkpoints(store, resolved, identity, data, None, None, Reporter())
    assert not checkpoints.has_checkpoint(2)
    with pytest.raises(ConfigError, match=r"step-00000002 is a checkpoint of another run \(differs in train.data\)"):
        checkpoints.newest()
    assert Checkpoints(store, resolved, identity, other, None, None, Reporter()).newest().step == 2  # control
    save_checkpoint(store, 4, drafter, {}, resolved, [data], {"step": 4, "run": identity})
    assert Checkpoints(store, resolved, identity, moved, None, None, Reporter()).newest().step == 4
