"""Trust, fourth ring (issue 47): what `status` says about an artifact's inputs is checked, never assumed.

Every input an artifact pins is one `status` checks again (a folder `datasets` saved, a published drafter's folder: each
pinned by its files' content), or one it says it does not check (rows read from the hub: `input unchecked`, never plain
`verified`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from helpers.artifacts import commit_files
from helpers.paths import GOLDEN
from helpers.tiny_run import make_tiny_run, tiny_config
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.stages import eval as eval_stage
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef, State, VerifyReport, verify_artifact
from blockdraft.store.inputs import open_input

pytestmark = pytest.mark.fault

PROMPT_ROWS = [{"prompt": "The capital of France is"}, {"prompt": "Name a primary colour."},
               {"prompt": "Two and two make"}]


def _checked(url: str, within: Path | None = None) -> VerifyReport:
    """The artifact at `url` as `verify` judges it (`status` when surveying `within`): its files, and its inputs
    transitively."""
    return verify_artifact(open_store(url), check_inputs=True, within=open_store(within).url if within else None)


def _verify(url: str):
    return CliRunner().invoke(app, ["verify", url])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("tiny-run"))


def _eval_config(tmp: Path, **eval_settings) -> BlockdraftConfig:
    settings = {"untrained_baseline": False, "num_prompts": 2, "max_new_tokens": 4, **eval_settings}
    return load_config(None, tiny_config(tmp, eval=settings))


def _prompts_file(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_an_eval_of_a_folder_datasets_saved_is_stale_once_its_rows_change_or_it_is_gone(tmp_path, tiny_run):
    saved = tmp_path / "prompts-saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(PROMPT_ROWS[:2])}).save_to_disk(str(saved))
    made = eval_stage.run(_eval_config(tmp_path), str(tiny_run), prompts=str(saved))
    assert _checked(made.url).state is State.VERIFIED

    shutil.rmtree(saved)  # the same folder saved again with other rows
    datasets.DatasetDict({"test": datasets.Dataset.from_list(PROMPT_ROWS[1:])}).save_to_disk(str(saved))
    changed = _checked(made.url)
    assert changed.state is State.STALE and "changed since" in changed.problems[0].detail, changed.problems

    shutil.rmtree(saved)
    gone = _checked(made.url)
    assert gone.state is State.STALE, gone.problems
    assert gone.problems[0].detail == f"input {open_store(saved).url} is gone"
    said = _verify(made.url)
    assert said.exit_code == 1 and said.stdout.startswith("stale\t"), said.output


def test_an_input_status_cannot_check_is_said_unchecked_never_plain_verified(tmp_path):
    """Rows read from the hub are pinned by their sha256, which `status` cannot read again: the artifact, and what is
    made from it, say `input unchecked` (exit 0: nothing is known to have changed), and its lineage says which input."""
    store = tmp_path / "store"
    hub = InputRef(kind="dataset", url="hf://datasets/owner/prompts?split=test", sha256="0" * 64)
    commit_files(store / "eval", {"report.json": b"{}"}, kind="eval", lineage=[hub])
    commit_files(store / "export", {"config.json": b"{}"}, kind="export", lineage=[open_input(str(store / "eval")).ref])
    surveyed = CliRunner().invoke(app, ["status", str(store)])
    assert surveyed.exit_code == 0, surveyed.output
    lines = surveyed.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["input unchecked", "input unchecked"], lines
    assert f"{hub.url} (sha256:000000000000, dataset rows: not checked)" in lines[0]
    said = _verify(str(store / "export"))
    assert said.exit_code == 0 and said.stdout.startswith("input unchecked\t"), said.output
    assert "has an input unchecked" in said.output


def test_an_eval_of_a_published_drafter_folder_is_verified_until_a_file_of_it_changes(tmp_path):
    published = tmp_path / "published"
    shutil.copytree(GOLDEN / "drafter", published)
    golden = json.loads((GOLDEN / "golden.json").read_text())
    rows = [{"input_ids": case["prompt"]} for case in golden["decode"][:2]]
    prompts = _prompts_file(tmp_path / "prompts.jsonl", rows)
    cfg = load_config(None, {"target": {"path": str(GOLDEN / "target")}, "store": {"url": str(tmp_path / "store")},
                             "eval": {"untrained_baseline": False, "max_new_tokens": 4}})
    made = eval_stage.run(cfg, str(published), prompts=prompts)
    said = _verify(made.url)
    assert said.exit_code == 0 and said.stdout.startswith("verified\t"), said.output

    weights = published / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    said = _verify(made.url)
    assert said.exit_code == 1 and said.stdout.startswith("stale\t") and "changed since" in said.output, said.output
