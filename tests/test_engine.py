"""`eval --engine vllm`: the export served by vLLM's CPU build (`make engine`) reproduces our decode's acceptance exactly in
float32 for a full-attention and a sliding-window drafter; an export that differs from its checkpoint is caught; no server
outlives the command, however it ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.engine import DRAFTERS, ENGINE_PYTHON, PROMPTS, engine_config, needs_engine, processes_of_session, train_drafters, write_config
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.stages.eval.report import EvalReport
from blockdraft.store import open_store
from blockdraft.store.artifact import entry_for_local_file
from blockdraft.store.manifest import MANIFEST_NAME, Manifest

pytestmark = [needs_engine, pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    return tmp, train_drafters(tmp)


@pytest.fixture(scope="module")
def exports(trained):
    """`blockdraft export` of each trained drafter, as users make it."""
    tmp, runs = trained
    made = {}
    for name, run in runs.items():
        made[name] = tmp / f"export-{name}"
        result = CliRunner().invoke(app, ["export", str(run), str(made[name])])
        assert result.exit_code == 0, result.output
    return made


def _eval(tmp: Path, run: Path, drafter: str, out: str, *extra: str, **settings) -> tuple[int, str, EvalReport | None]:
    config = write_config(tmp, engine_config(tmp, drafter, **settings), f"{out}.toml")
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(run), "--engine", "vllm",
                                      "--output", str(tmp / out), *extra])
    report = tmp / out / "report.json"
    return result.exit_code, result.output, EvalReport.from_json(report.read_text()) if report.exists() else None


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_the_engine_reproduces_our_acceptance_exactly_in_float32(trained, drafter):
    tmp, runs = trained
    code, output, report = _eval(tmp, runs[drafter], drafter, f"eval-{drafter}")
    assert code == 0, output
    assert report is not None and report.engine is not None
    engine = report.engine
    print(drafter, engine.model_dump())
    assert engine.rule == "exact" and engine.disagreement is None and engine.version.startswith("vllm-0.32")
    assert engine.outputs_equal_target_only == engine.num_prompts == PROMPTS  # lossless in the engine
    assert engine.drafts == engine.ours_cycles > 0
    assert engine.accepted_per_position == engine.ours_accepted_per_position
    assert engine.accepted_per_position[1] > 0, "no draft accepted past the first position: the comparison would cover one"
    assert abs(engine.tau - engine.ours_tau) < 1e-9
    assert "engine\tagrees (exact)" in output


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _recommit(folder: Path) -> None:
    """The edited export as a verified artifact again, as if it had been written so: only the engine can tell."""
    manifest = Manifest.model_validate_json((folder / MANIFEST_NAME).read_bytes())
    manifest.files = [entry_for_local_file(folder, folder / e.path) for e in manifest.files]
    (folder / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    assert open_store(folder).exists(MANIFEST_NAME)


def _shifted_layer_ids(config: dict) -> None:
    ids = config["dflash_config"]["target_layer_ids"]
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in ids]  # another drafter's taps, still inside the target


# name: (the drafter whose export is edited, the edit). Each yields an export that vLLM loads and serves without complaint.
CONTROLS = {
    "sliding_window": ("sliding", lambda f: _edit_config(f, lambda c: c.update(sliding_window=4))),
    "target_layer_ids": ("full", lambda f: _edit_config(f, _shifted_layer_ids)),
    "mask_token_id": ("full", lambda f: _edit_config(f, lambda c: c["dflash_config"].update(mask_token_id=c["dflash_config"]["mask_token_id"] + 1))),
    "weights": ("full", None),  # the other checkpoint's model.safetensors
}


@pytest.mark.fault
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_an_export_that_differs_from_its_checkpoint_is_caught_by_the_engine(trained, exports, control):
    tmp, runs = trained
    drafter, edit = CONTROLS[control]
    edited = tmp / f"edited-{control}"
    shutil.copytree(exports[drafter], edited)
    if edit is None:
        shutil.copyfile(exports["sliding"] / "model.safetensors", edited / "model.safetensors")
    else:
        edit(edited)
    _recommit(edited)
    code, output, report = _eval(tmp, runs[drafter], drafter, f"eval-{control}", "--export", str(edited),
                                 num_prompts=8, untrained_baseline=False)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert "the engine disagrees with our decode at draft position(s)" in " ".join(output.split())
    assert report is not None and report.engine is not None and report.engine.disagreement is not None
    assert report.engine.accepted_per_position != report.engine.ours_accepted_per_position or report.engine.drafts != report.engine.ours_cycles


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except OSError:
        return None


# phase: (the line the command prints when it enters the phase, the signal that ends the command there)
PHASES = {
    "starting": ("engine: starting vllm drafter", signal.SIGKILL),
    "running": ("engine: serving 4 prompts target-only", signal.SIGINT),
    "comparing": ("engine: comparing with our decode", signal.SIGTERM),
}


@pytest.mark.fault
@pytest.mark.parametrize("phase", sorted(PHASES))
def test_no_server_outlives_the_command_killed_while(trained, exports, phase):
    tmp, runs = trained
    marker, sig = PHASES[phase]
    config = write_config(tmp, engine_config(tmp, "full", num_prompts=4, max_new_tokens=16, untrained_baseline=False), f"kill-{phase}.toml")
    argv = [sys.executable, "-m", "blockdraft", "eval", "--config", str(config), "--checkpoint", str(runs["full"]), "--engine", "vllm",
            "--export", str(exports["full"]), "--output", str(tmp / f"kill-{phase}")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"})
    sessions: set[int] = set()
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        sessions |= {s for s in map(_session_of, _children(proc.pid)) if s is not None and s != os.getsid(0)}
        if marker in line:
            break
    else:
        pytest.fail(f"the command ended before '{marker}': {''.join(seen)[-2000:]}")
    deadline = time.monotonic() + 60
    while phase != "comparing" and not sessions and time.monotonic() < deadline:  # the server of this phase is being started
        sessions |= {s for s in map(_session_of, _children(proc.pid)) if s is not None and s != os.getsid(0)}
        time.sleep(0.2)
    assert sessions or phase == "comparing", "no server process was seen"
    time.sleep(2)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while any(processes_of_session(s) for s in sessions) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(processes_of_session(s) for s in sessions), f"left running: {[processes_of_session(s) for s in sessions]}"
    assert ENGINE_PYTHON.is_file()


SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's thinking-mode settings


@pytest.mark.parametrize("proposal", ["vllm", "vllm-probabilistic"])
def test_at_temperature_the_engine_agrees_with_our_decode_under_its_draft_rule(trained, proposal):
    """vLLM's CPU build with `make engine`'s expand fix, at T 0.6 / top-p 0.95 / top-k 20, told the draft rule our decode ran
    (`draft_sample_method`), gives per-position acceptance and tau within the binomial interval of ours."""
    tmp, runs = trained
    code, output, report = _eval(tmp, runs["full"], "full", f"eval-sampled-{proposal}", untrained_baseline=False, num_prompts=8,
                                 proposal=proposal, samples_per_prompt=2, **SAMPLING)
    assert code == 0, output
    assert report is not None and report.engine is not None and report.sampled is not None
    engine = report.engine
    print(proposal, engine.model_dump())
    assert report.sampled.proposal == proposal and f"{proposal} drafts" in engine.rule
    assert engine.disagreement is None and engine.temperature == 0.6
    assert engine.drafts > 100 and engine.ours_cycles > 100
    assert engine.accepted_per_position[1] > 0, "no draft accepted past the first position at temperature: sampling broken"
    assert "engine\tagrees (binomial 99%" in output


@pytest.mark.fault
def test_at_temperature_an_export_that_differs_from_its_checkpoint_is_caught(trained, exports):
    """An export whose mask id is off by one. At temperature the check has the power of its sample: an export with shifted
    target layer ids moved vLLM's tau by 0.09 over 32 decodes here, inside the interval (the greedy check catches it)."""
    tmp, runs = trained
    edited = tmp / "edited-sampled"
    shutil.copytree(exports["full"], edited)
    CONTROLS["mask_token_id"][1](edited)
    _recommit(edited)
    code, output, report = _eval(tmp, runs["full"], "full", "eval-sampled-edited", "--export", str(edited), num_prompts=8,
                                 untrained_baseline=False, **SAMPLING)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert report is not None and report.engine is not None and report.engine.disagreement is not None
    assert "(binomial 99%" in report.engine.disagreement
