"""Lineage by origin: what an artifact was made from is checked where it lives, from any machine.

A stage that reads a pulled copy pins the store's artifact (by URL and manifest digest), so `status` on the store still
says `verified` after the node that held the copy is gone. `stale` means an input's content changed, transitively; an
input in a folder that only another machine holds is `input unreachable here`, a state of its own.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.artifacts import commit_files
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.store import open_store
from blockdraft.store.artifact import ORIGIN_NAME, State, raw_input, verify_artifact
from blockdraft.store.stage_io import open_input
from blockdraft.store.status import status
from blockdraft.store.transfer import pull, push


def _states(store_root) -> dict[str, State]:
    """State by artifact root; files without a manifest (raw uploads under `raw/`) are `incomplete` and left out."""
    states = {a.root: a.state for a in status(open_store(store_root))}
    assert states.pop("raw", State.INCOMPLETE) is State.INCOMPLETE
    return states


def _flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _build_on_a_pulled_copy(tmp_path):
    """The store holds raw/completions.jsonl and `tokenized` made from it; a training node pulls `tokenized` into its own
    folder and makes `checkpoint` (written to the store) from the pulled copy; `export` is made from the checkpoint."""
    store, node = tmp_path / "store", tmp_path / "train-node"
    (store / "raw").mkdir(parents=True)
    (store / "raw" / "completions.jsonl").write_text('{"messages": []}\n' * 50)
    raw = open_store(store / "raw")
    info = raw.head("completions.jsonl")
    assert info is not None
    commit_files(store / "tokenized", {"data.arrow": b"rows" * 200}, kind="tokenized", lineage=[raw_input(raw, info)])
    pull(f"file://{store / 'tokenized'}", node / "tokenized")
    data = open_input(str(node / "tokenized"))
    commit_files(store / "checkpoint", {"model.safetensors": b"w" * 300}, kind="checkpoint", lineage=[data.ref])
    ckpt = open_input(str(store / "checkpoint"))
    commit_files(store / "export", {"config.json": b"{}"}, kind="export", lineage=[ckpt.ref])
    return store, node, data


def test_a_stage_reading_a_pulled_copy_pins_the_store_artifact(tmp_path):
    store, node, data = _build_on_a_pulled_copy(tmp_path)
    origin = json.loads((node / "tokenized" / ORIGIN_NAME).read_text())
    assert origin["url"] == open_store(store / "tokenized").url
    assert data.ref.url == open_store(store / "tokenized").url  # not the node's folder
    assert data.ref.sha256 == origin["manifest_sha256"] == open_input(str(store / "tokenized")).ref.sha256
    # The origin record is beside the manifest, not in it: the copy stays byte for byte the store's artifact.
    assert ORIGIN_NAME not in {e.path for e in data.manifest.files}
    assert verify_artifact(open_store(node / "tokenized")).state is State.VERIFIED


def test_status_on_the_store_after_the_training_node_is_gone(tmp_path):
    store, node, _ = _build_on_a_pulled_copy(tmp_path)
    shutil.rmtree(node)
    assert _states(store) == {"tokenized": State.VERIFIED, "checkpoint": State.VERIFIED, "export": State.VERIFIED}

    # One byte of the tokenized artifact's input changes at the store: every dependant, however far, turns stale.
    _flip_byte(store / "raw" / "completions.jsonl")
    states = _states(store)
    assert states == {"tokenized": State.STALE, "checkpoint": State.STALE, "export": State.STALE}
    report = verify_artifact(open_store(store / "export"), check_inputs=True)
    assert report.state is State.STALE and "checkpoint" in report.problems[0].detail


def test_an_input_artifact_whose_files_no_longer_verify_makes_its_dependants_stale(tmp_path):
    store, _, _ = _build_on_a_pulled_copy(tmp_path)
    _flip_byte(store / "tokenized" / "data.arrow")  # same manifest, a file that no longer matches it
    states = _states(store)
    assert states["tokenized"] is State.CORRUPT
    assert states["checkpoint"] is State.STALE and states["export"] is State.STALE


def test_a_pin_that_changed_at_its_origin_is_stale_even_when_the_pulled_copy_is_intact(tmp_path):
    store, node, _ = _build_on_a_pulled_copy(tmp_path)
    commit_files(store / "tokenized", {"data.arrow": b"other rows"}, kind="tokenized")
    assert verify_artifact(open_store(node / "tokenized")).state is State.VERIFIED
    assert _states(store)["checkpoint"] is State.STALE


def test_an_input_only_another_machine_holds_is_unreachable_not_stale(tmp_path):
    """Tokenized from a file on the tokenize node's own disk: from another machine (the node's folder absent) the pin
    cannot be checked. `status` says so, and does not fail: the artifact's own files verified."""
    node, store = tmp_path / "tokenize-node", tmp_path / "store"
    (node / "in").mkdir(parents=True)
    (node / "in" / "completions.jsonl").write_text("{}\n" * 10)
    local = open_store(node / "in")
    info = local.head("completions.jsonl")
    assert info is not None
    commit_files(store / "tokenized", {"data.arrow": b"rows"}, kind="tokenized", lineage=[raw_input(local, info)])
    tokenized = open_input(str(store / "tokenized"))
    commit_files(store / "checkpoint", {"w": b"w"}, kind="checkpoint", lineage=[tokenized.ref])
    assert _states(store) == {"tokenized": State.VERIFIED, "checkpoint": State.VERIFIED}

    shutil.rmtree(node)
    assert _states(store) == {"tokenized": State.UNREACHABLE, "checkpoint": State.UNREACHABLE}
    out = CliRunner().invoke(app, ["status", str(store)])
    assert out.exit_code == 0, out.output
    assert out.stdout.count("input unreachable here\t") == 2
    assert "stale" not in out.stdout


def test_an_input_gone_from_the_surveyed_store_is_stale(tmp_path):
    """Inside the surveyed prefix an absent input is gone (deleted), not out of reach."""
    store = tmp_path / "store"
    commit_files(store / "raw-src", {"x": b"1"}, kind="completions")
    source = open_input(str(store / "raw-src"))
    commit_files(store / "tokenized", {"y": b"2"}, kind="tokenized", lineage=[source.ref])
    shutil.rmtree(store / "raw-src")
    assert _states(store) == {"tokenized": State.STALE}
    out = CliRunner().invoke(app, ["status", str(store)])
    assert out.exit_code == 1 and out.stdout.startswith("stale\t")


def test_a_pushed_folder_names_the_store_copy(tmp_path):
    """A stage that wrote locally and pushed (tokenize node -> store): a later stage reading the local folder pins the store's."""
    local = commit_files(tmp_path / "node" / "tokenized", {"data.arrow": b"rows"}, kind="tokenized")
    push(local, f"file://{tmp_path / 'store' / 'tokenized'}")
    assert open_input(str(local)).ref.url == open_store(tmp_path / "store" / "tokenized").url
    # An origin record for another manifest (the local artifact was remade since) is not believed.
    commit_files(local, {"data.arrow": b"new rows"}, kind="tokenized")
    assert open_input(str(local)).ref.url == open_store(local).url


@pytest.mark.s3
def test_a_copy_pulled_from_s3_pins_the_bucket(tmp_path, s3_env):
    bucket = s3_env.new_bucket()
    local = commit_files(tmp_path / "made", {"data.arrow": b"rows" * 100}, kind="tokenized")
    url = f"s3://{bucket}/run/tokenized"
    push(local, url)
    pull(url, tmp_path / "node" / "tokenized")
    data = open_input(str(tmp_path / "node" / "tokenized"))
    assert data.ref.url == open_store(url).url  # the bucket prefix, as a stage reading it there would pin it
    commit_files(tmp_path / "ckpt", {"w": b"w"}, kind="checkpoint", lineage=[data.ref])
    shutil.rmtree(tmp_path / "node")
    assert verify_artifact(open_store(tmp_path / "ckpt"), check_inputs=True).state is State.VERIFIED
