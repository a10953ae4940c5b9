"""`eval --engine vllm`: the export served by vLLM's CPU build (`make engine`) reproduces our decode's acceptance
exactly in float32 for a full-attention and a sliding-window drafter, and no server outlives the command, however it
ends. The drafters are trained once per test run (`helpers.engine.trained_once`); an export that differs from its
checkpoint is in test_engine_controls.py, the check at temperature in test_engine_sampled.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.engine import (
    DRAFTERS,
    ENGINE_PYTHON,
    PROMPTS,
    engine_config,
    export_all,
    needs_engine,
    processes_of_session,
    run_eval,
    trained_here,
    write_config,
)

pytestmark = [needs_engine, pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_here(tmp_path_factory, "engine")


@pytest.fixture(scope="module")
def exports(trained):
    return export_all(*trained)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_the_engine_reproduces_our_acceptance_exactly_in_float32(trained, drafter):
    tmp, runs = trained
    # no untrained drafter's decode: the engine is compared with the trained one's only
    code, output, report = run_eval(tmp, runs[drafter], drafter, f"eval-{drafter}", untrained_baseline=False)
    assert code == 0, output
    assert report is not None and report.engine is not None
    engine = report.engine
    print(drafter, engine.model_dump())
    assert engine.rule == "exact" and engine.disagreement is None and engine.version.startswith("vllm-0.32")
    assert engine.outputs_equal_target_only == engine.num_prompts == PROMPTS  # lossless in the engine
    assert engine.drafts == engine.ours_cycles > 0
    assert engine.accepted_per_position == engine.ours_accepted_per_position
    assert engine.accepted_per_position[1] > 0, ("no draft accepted past the first position: the comparison would "
                                                 "cover one")
    assert abs(engine.tau - engine.ours_tau) < 1e-9
    assert "engine\tagrees (exact)" in output


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
    config = write_config(tmp, engine_config(tmp, "full", num_prompts=4, max_new_tokens=16, untrained_baseline=False),
                          f"kill-{phase}.toml")
    argv = [sys.executable, "-m", "blockdraft", "eval", "--config", str(config), "--checkpoint", str(runs["full"]),
            "--engine", "vllm", "--export", str(exports["full"]), "--output", str(tmp / f"kill-{phase}")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"})
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
    while phase != "comparing" and not sessions and time.monotonic() < deadline:
        # the server of this phase is being started
        sessions |= {s for s in map(_session_of, _children(proc.pid)) if s is not None and s != os.getsid(0)}
        time.sleep(0.2)
    assert sessions or phase == "comparing", "no server process was seen"
    time.sleep(2)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while any(processes_of_session(s) for s in sessions) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(processes_of_session(s) for s in sessions), ("left running: "
                                                                f"{[processes_of_session(s) for s in sessions]}")
    assert ENGINE_PYTHON.is_file()
