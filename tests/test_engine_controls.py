"""`eval --engine vllm` catches an export that differs from its checkpoint (another sliding window, other target layers,
another mask id, the other drafter's weights), greedy and at temperature: each edited export loads and serves without
complaint in vLLM, and only the comparison with our decode can tell."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.engine import SAMPLING, export_all, needs_engine, run_eval, trained_here

from blockdraft.store import open_store
from blockdraft.store.artifact import entry_for_local_file
from blockdraft.store.manifest import MANIFEST_NAME, Manifest

pytestmark = [needs_engine, pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_here(tmp_path_factory, "engine-controls")


@pytest.fixture(scope="module")
def exports(trained):
    return export_all(*trained)


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
    # another drafter's taps, still inside the target
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in ids]


# name: (the drafter whose export is edited, the edit). Each yields an export that vLLM loads and serves without
# complaint.
CONTROLS = {
    "sliding_window": ("sliding", lambda f: _edit_config(f, lambda c: c.update(sliding_window=4))),
    "target_layer_ids": ("full", lambda f: _edit_config(f, _shifted_layer_ids)),
    "mask_token_id": ("full", lambda f: _edit_config(
        f, lambda c: c["dflash_config"].update(mask_token_id=c["dflash_config"]["mask_token_id"] + 1))),
    "weights": ("full", None),  # the other checkpoint's model.safetensors
}
# Prompts each edited export is served on. Over 8 prompts the edits moved the largest per-position rate by 0.59
# (sliding_window, mask_token_id), 0.37 (weights) and 0.11 (target_layer_ids) against a tolerance of 0.02 plus two
# flipped drafts: 4 prompts keep the first three far outside it, the smallest gap keeps its 8.
PROMPTS_FOR = {"sliding_window": 4, "mask_token_id": 4, "weights": 4, "target_layer_ids": 8}


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
    code, output, report = run_eval(tmp, runs[drafter], drafter, f"eval-{control}", "--export", str(edited),
                                 num_prompts=PROMPTS_FOR[control], untrained_baseline=False)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert "the engine disagrees with our decode at draft position(s)" in " ".join(output.split())
    assert report is not None and report.engine is not None and report.engine.disagreement is not None
    assert (
        report.engine.accepted_per_position != report.engine.ours_accepted_per_position
        or report.engine.drafts != report.engine.ours_cycles
    )


@pytest.mark.fault
def test_at_temperature_an_export_that_differs_from_its_checkpoint_is_caught(trained, exports):
    """An export whose mask id is off by one. At temperature the check has the power of its sample: an export with
    shifted target layer ids moved vLLM's tau by 0.09 over 32 decodes here, inside the interval (the greedy check
    catches it)."""
    tmp, runs = trained
    edited = tmp / "edited-sampled"
    shutil.copytree(exports["full"], edited)
    CONTROLS["mask_token_id"][1](edited)
    _recommit(edited)
    code, output, report = run_eval(tmp, runs["full"], "full", "eval-sampled-edited", "--export", str(edited),
                                    num_prompts=8, untrained_baseline=False, **SAMPLING)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert report is not None and report.engine is not None and report.engine.disagreement is not None
    assert "(binomial 99%" in report.engine.disagreement
