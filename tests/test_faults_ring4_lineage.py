"""Trust, fourth ring (issue 47): what `status` says about an artifact's inputs is checked, never assumed.

Every input an artifact pins is one `status` checks again (a folder `datasets` saved, a published drafter's folder: each
pinned by its files' content), or one it says it does not check (rows read from the hub: `input unchecked`, never plain
`verified`). An eval is keyed by its checkpoint's URL, however it was spelled, so another spelling finds it done; an
export pins the eval its card gives, so replacing that eval makes the export stale. What an artifact only measured
(a checkpoint's train.eval_data) makes that artifact stale, not what is made from it.
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
from transformers import AutoConfig
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.spec import DrafterSpec
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export as export_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages.train import resolved_training_config, save_checkpoint
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
    """The drafter as the Hub's cache holds it: a snapshot folder whose files are links to blobs beside it."""
    published, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    published.mkdir()
    shutil.copytree(GOLDEN / "drafter", blobs)
    for blob in blobs.iterdir():
        (published / blob.name).symlink_to(Path("..") / "blobs" / blob.name)
    golden = json.loads((GOLDEN / "golden.json").read_text())
    rows = [{"input_ids": case["prompt"]} for case in golden["decode"][:2]]
    prompts = _prompts_file(tmp_path / "prompts.jsonl", rows)
    cfg = load_config(None, {"target": {"path": str(GOLDEN / "target")}, "store": {"url": str(tmp_path / "store")},
                             "eval": {"untrained_baseline": False, "max_new_tokens": 4}})
    made = eval_stage.run(cfg, str(published), prompts=prompts)
    said = _verify(made.url)
    assert said.exit_code == 0 and said.stdout.startswith("verified\t"), said.output

    weights = blobs / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    said = _verify(made.url)
    assert said.exit_code == 1 and said.stdout.startswith("stale\t") and "changed since" in said.output, said.output


def test_another_spelling_of_the_checkpoint_finds_its_eval_and_an_export_whose_eval_is_replaced_is_stale(
    tmp_path, tiny_run, monkeypatch
):
    cfg = _eval_config(tmp_path, prompts=[_prompts_file(tmp_path / "prompts.jsonl", PROMPT_ROWS[:2])])
    monkeypatch.chdir(tiny_run.parent)
    first = eval_stage.run(cfg, tiny_run.name)  # a relative path
    cited = open_store(first.url).url
    for spelling in (str(tiny_run), f"file://{tiny_run}"):
        again = eval_stage.run(cfg, spelling)
        assert again.already_done and again.url == first.url
        assert again.report.manifest_sha256 == first.report.manifest_sha256
    exported = export_stage.run(cfg, str(tiny_run), str(tmp_path / "store" / "export"))
    assert _checked(exported.url).state is State.VERIFIED

    # The eval the card gives, replaced where it lies (other prompts): the card's figures are no longer of it.
    other = _prompts_file(tmp_path / "other.jsonl", PROMPT_ROWS[1:])
    replaced = eval_stage.run(cfg, str(tiny_run), first.url, prompts=other)
    assert replaced.report.manifest_sha256 != first.report.manifest_sha256
    stale = _checked(exported.url)
    assert stale.state is State.STALE and stale.problems[0].detail == f"input {cited} changed since", stale.problems
    assert exported.report.manifest is not None  # it pinned the eval its card gives, as measured
    pins = [(ref.kind, ref.sha256) for ref in exported.report.manifest.lineage[1:]]
    assert pins == [("measured", first.report.manifest_sha256)]
    # Exported again, the card gives the eval there now, and the export pins it.
    renewed = export_stage.run(cfg, str(tiny_run), str(tmp_path / "store" / "export"))
    assert renewed.report.manifest is not None
    assert renewed.report.manifest.lineage[1].sha256 == replaced.report.manifest_sha256
    assert _checked(renewed.url).state is State.VERIFIED


def _run_with_eval_data(tmp: Path) -> tuple[Path, Path]:
    """(a checkpoint of an untrained tiny drafter trained on a real tokenize output, its train.eval_data): the second
    tokenized from other conversations and pinned as what its held-out figures were measured on."""
    lines = (TINY_TARGET_DIR / "completions.jsonl").read_text().splitlines(keepends=True)
    cfg = load_config(None, tiny_config(tmp, train={"data": str(tmp / "tokenized")}))
    for name, part in (("tokenized", lines[:8]), ("eval-data", lines[8:12])):
        (tmp / f"{name}.jsonl").write_text("".join(part))
        tokenize_stage.run(cfg, str(tmp / f"{name}.jsonl"), str(tmp / name))
    drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(TINY_TARGET_DIR), cfg.dflash))
    data, eval_data = open_input(str(tmp / "tokenized")), open_input(str(tmp / "eval-data"))
    resolved = resolved_training_config(cfg, drafter.spec, str(tmp / "run"), data.manifest.config["tokenize_run"])
    save_checkpoint(open_store(tmp / "run"), 5, drafter, {}, resolved, [data.ref], {"step": 5},
                    measured_on=[eval_data.ref])
    return tmp / "run" / "step-00000005", tmp / "eval-data"


def test_an_export_made_after_train_eval_data_is_deleted_or_remade_is_verified(tmp_path):
    checkpoint, eval_data = _run_with_eval_data(tmp_path)
    cfg = load_config(None, tiny_config(tmp_path))
    shutil.rmtree(eval_data)
    assert _checked(str(checkpoint), tmp_path).state is State.STALE  # its held-out figures are of rows that are gone
    exported = export_stage.run(cfg, str(checkpoint), str(tmp_path / "store" / "export"))
    assert _checked(exported.url, tmp_path).state is State.VERIFIED  # its weights are what the export read
    said = _verify(exported.url)
    assert said.exit_code == 0 and said.stdout.startswith("verified\t"), said.output

    lines = (TINY_TARGET_DIR / "completions.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "eval-data.jsonl").write_text("".join(lines[12:14]))
    tokenize_stage.run(cfg, str(tmp_path / "eval-data.jsonl"), str(eval_data))  # remade from other rows
    assert _checked(str(checkpoint), tmp_path).state is State.STALE
    again = export_stage.run(cfg, str(checkpoint), str(tmp_path / "store" / "export-2"))
    assert _checked(again.url, tmp_path).state is State.VERIFIED
    assert _checked(exported.url, tmp_path).state is State.VERIFIED
