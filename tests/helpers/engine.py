"""The serving engine's environment (`make engine` builds `.venv-engine`) and the drafters its tests serve: trained here
on the tiny target's own completions, one with a full-attention layer and one with a sliding-window layer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train as train_stage
from blockdraft.stages.eval.report import EvalReport

REPO = Path(__file__).resolve().parent.parent.parent
ENGINE_PYTHON = REPO / ".venv-engine" / "bin" / "python"
needs_engine = pytest.mark.skipif(not ENGINE_PYTHON.is_file(),
                                  reason="no .venv-engine here: `make engine` builds vLLM's environment")

# name: the drafter's layers. Both train TRAIN_STEPS steps, enough that drafts are accepted beyond the first position.
DRAFTERS = {
    "full": {"num_draft_layers": 1},
    "sliding": {"num_draft_layers": 1, "layer_types": ["sliding_attention"], "sliding_window": 16},
}
TRAIN_STEPS = 200
PROMPTS = 16
NEW_TOKENS = 48


def engine_config(tmp: Path, drafter: str, **eval_settings) -> dict:
    """The config of one engine test: the tiny target, `drafter`'s shape, the engine's environment, 16 held-out
    prompts."""
    fixture = json.loads((TINY_TARGET_DIR / "fixture.json").read_text())
    return {
        "target": {"path": str(TINY_TARGET_DIR)},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.0},
        # vLLM's CPU build serves DFlash drafters only (DFlash2 needs its GPU runner)
        "dflash": {"architecture": "dflash", "block_size": 8, "mask_token_id": fixture["mask_token_id"],
                   "num_anchors": 32, **DRAFTERS[drafter]},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / f"run-{drafter}"),
                  "log_dir": str(tmp / f"logs-{drafter}"),
                  "max_steps": TRAIN_STEPS, "batch_size": 4, "global_batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05,
                  "checkpoint_every": TRAIN_STEPS, "seed": 0},
        "eval": {"num_prompts": PROMPTS, "max_new_tokens": NEW_TOKENS,
                 "prompts": str(TINY_TARGET_DIR / "prompts.jsonl"),
                 "engine_python": str(ENGINE_PYTHON), **eval_settings},
    }


def train_drafters(tmp: Path) -> dict[str, Path]:
    """Tokenize the tiny target's completions once and train each of `DRAFTERS` on them: {name: its training output}."""
    base = engine_config(tmp, "full")
    tokenize_stage.run(load_config(None, base), str(TINY_TARGET_DIR / "completions.jsonl"), str(tmp / "tokenized"))
    runs = {}
    for name in DRAFTERS:
        train_stage.run(load_config(None, engine_config(tmp, name)))
        runs[name] = tmp / f"run-{name}"
    return runs


def trained_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`train_drafters` once per test run, into a folder every pytest-xdist worker shares: the first worker to ask
    trains, the others wait on the lock and find the drafters done. Tests copy the runs out before using them."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "engine-drafters"
    with FileLock(f"{shared}.lock"):
        if not (shared / "trained").is_file():
            shutil.rmtree(shared, ignore_errors=True)  # a run that died half way
            shared.mkdir(parents=True)
            train_drafters(shared)
            (shared / "trained").touch()
    return shared


def trained_here(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, dict[str, Path]]:
    """A folder of the calling module's own, holding a copy of the tokenized data and of each trained drafter's run, as
    `train_drafters` leaves them: (the folder, {name: run})."""
    shared = trained_once(tmp_path_factory)
    tmp = tmp_path_factory.mktemp(name)
    shutil.copytree(shared / "tokenized", tmp / "tokenized")
    runs = {}
    for drafter in DRAFTERS:
        runs[drafter] = tmp / f"run-{drafter}"
        shutil.copytree(shared / f"run-{drafter}", runs[drafter])
    return tmp, runs


def write_config(tmp: Path, sections: dict, name: str = "blockdraft.toml") -> Path:
    from blockdraft.pipeline import write_toml

    path = tmp / name
    write_toml(path, sections)
    return path


def processes_of_session(sid: int) -> list[int]:
    """Pids of the live processes in session `sid` (an engine server and everything it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(entry))
    return pids


def engine_sessions(marker: str) -> set[int]:
    """Sessions of the live processes whose command line contains `marker` (the engine servers of one test)."""
    sessions = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker in cmdline and "vllm.entrypoints" in cmdline:
                sessions.add(int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[3]))
        except OSError:
            continue
    return sessions


SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's thinking-mode settings


def export_all(tmp: Path, runs: dict[str, Path]) -> dict[str, Path]:
    """`blockdraft export` of each trained drafter, as users make it: {name: the export folder}."""
    made = {}
    for name, run in runs.items():
        made[name] = tmp / f"export-{name}"
        result = CliRunner().invoke(app, ["export", str(run), str(made[name])])
        assert result.exit_code == 0, result.output
    return made


def run_eval(tmp: Path, run: Path, drafter: str, out: str, *extra: str,
             **settings) -> tuple[int, str, EvalReport | None]:
    """`blockdraft eval --engine vllm` of `run` with `drafter`'s config and `settings` over the eval section: (exit
    code, output, the report when one was written)."""
    config = write_config(tmp, engine_config(tmp, drafter, **settings), f"{out}.toml")
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(run), "--engine", "vllm",
                                      "--output", str(tmp / out), *extra])
    report = tmp / out / "report.json"
    return result.exit_code, result.output, EvalReport.from_json(report.read_text()) if report.exists() else None
