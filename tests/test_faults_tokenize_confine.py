"""Tokenize writes nothing through a link in its output: a link planted at (or swapped in for) a split folder or the
quarantine folder is refused as resolving outside the output, one planted at a file's name or temporary name is never
written through, and nothing outside the output changes (issue 28, case 1, for tokenize's own files).

Each run uses the real stage on the tiny tokenizer's completions, through the CLI or `tokenize.run`, in one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tokenize_data import TOKENIZER_DIR, config, conversation, rows_of, tokenize, write_jsonl
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.errors import OutsideArtifactError
from blockdraft.stages.tokenize import arrow_rows
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.local import TMP_PREFIX

pytestmark = pytest.mark.fault

# The user's files in the folder a link points to, some named like the files tokenize writes and removes.
USERS_FILES = {"state.json": b"the user's state", "shard-00000-part-000.arrow": b"the user's rows",
               "shard-00000.jsonl": b"the user's quarantine", "notes.txt": b"the user's notes"}


def _completions(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in" / "a.jsonl", [conversation(i) for i in range(6)]).parent


def _users_folder(tmp_path: Path) -> Path:
    other = tmp_path / "other"
    other.mkdir()
    for name, data in USERS_FILES.items():
        (other / name).write_bytes(data)
    return other


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _plant_during_the_first_batch(monkeypatch, plant) -> None:
    """Call `plant()` once, as the shard writes its first Arrow batch: after the run's own cleanup and checks."""
    planted: list[bool] = []
    real = arrow_rows.record_batch

    def record_batch(rows, schema):
        if not planted:
            planted.append(True)
            plant()
        return real(rows, schema)

    monkeypatch.setattr(arrow_rows, "record_batch", record_batch)


@pytest.mark.parametrize("planted", ["train", "held_out", "quarantine"])
def test_a_link_planted_at_a_tokenize_outputs_folder_is_refused_and_nothing_outside_is_touched(tmp_path, planted):
    completions, other = _completions(tmp_path), _users_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(other, out / planted)

    result = CliRunner().invoke(app, ["tokenize", str(completions), str(out), "--tokenizer", str(TOKENIZER_DIR)])
    assert _contents(other) == USERS_FILES
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "resolves outside" in errors[0] and "remove that link" in errors[0], result.output
    assert f"{planted} is a link" in errors[0]
    assert not (out / MANIFEST_NAME).exists()


@pytest.mark.parametrize("planted", ["train", "held_out"])
def test_a_link_swapped_in_for_a_split_folder_mid_run_is_refused_where_it_is_opened(tmp_path, monkeypatch, planted):
    """The split folder is opened where each file is written, not checked once before: `train` swapped for a link after
    the shard opened its first file, or `held_out` planted before the commit writes its metadata, is refused."""
    completions, other = _completions(tmp_path), _users_folder(tmp_path)
    out = tmp_path / "out"

    def plant() -> None:
        if (out / planted).exists():
            os.rename(out / planted, out / f"{planted}-aside")  # stays inside the output
        os.symlink(other, out / planted)

    _plant_during_the_first_batch(monkeypatch, plant)
    with pytest.raises(OutsideArtifactError, match=f"resolves outside {out}: {planted} is a link") as raised:
        tokenize(completions, out, config(held_out_fraction=0.0, rows_per_shard=1))
    assert "\n" not in str(raised.value)
    assert _contents(other) == USERS_FILES
    assert not (out / MANIFEST_NAME).exists()


@pytest.mark.parametrize("planted", [f"train/{TMP_PREFIX}shard-00000-part-001.arrow", f"train/{TMP_PREFIX}state.json",
                                     f"{TMP_PREFIX}dataset_dict.json", "held_out/empty.arrow"])
def test_a_link_planted_mid_run_at_a_files_name_is_never_written_through(tmp_path, monkeypatch, planted):
    """A file is created under a fresh temporary name in its opened folder (O_EXCL, O_NOFOLLOW) and renamed within it:
    a link at the temporary name it had before is left alone, one at its final name is replaced, the link itself."""
    completions, other = _completions(tmp_path), _users_folder(tmp_path)
    out = tmp_path / "out"

    def plant() -> None:
        (out / planted).parent.mkdir(exist_ok=True)
        os.symlink(other / "notes.txt", out / planted)

    _plant_during_the_first_batch(monkeypatch, plant)
    tokenize(completions, out, config(held_out_fraction=0.0, rows_per_shard=1))
    assert _contents(other) == USERS_FILES
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    assert len(rows_of(out)["train"]) == 6 and rows_of(out)["held_out"] == []
