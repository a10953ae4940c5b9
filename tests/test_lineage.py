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
from helpers.paths import GOLDEN
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
from blockdraft.model import DFlashDrafter
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import ORIGIN_NAME, State, raw_input, verify_artifact
from blockdraft.store.inputs import open_input
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
    """The store holds raw/completions.jsonl and `tokenized` made from it; a training node pulls `tokenized` into its
    own folder and makes `checkpoint` (written to the store) from the pulled copy; `export` is made from the
    checkpoint."""
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


def test_export_of_a_checkpoint_pushed_to_scratch_stays_verified_when_the_scratch_copy_is_deleted(tmp_path):
    """push CKPT to a scratch store, export from the local CKPT, delete the scratch copy: the export pinned the
    checkpoint it read, which still verifies, so `verify` says verified (a push never makes a folder pin the copy it
    sent elsewhere)."""
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(GOLDEN / "target")),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                            num_draft_layers=3, gamma=3.0),
    )
    save_checkpoint(open_store(tmp_path / "run"), 10, DFlashDrafter.from_pretrained(GOLDEN / "drafter"), {},
                    cfg.resolved(), [], {})
    ckpt, runner = tmp_path / "run" / "step-00000010", CliRunner()
    pushed = runner.invoke(app, ["push", str(ckpt), f"file://{tmp_path / 'scratch' / 'ck'}"])
    assert pushed.exit_code == 0, pushed.output
    exported = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "out")])
    assert exported.exit_code == 0, exported.output
    shutil.rmtree(tmp_path / "scratch")
    verified = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert verified.exit_code == 0 and verified.stdout.startswith("verified\t"), verified.output
    # Surveyed from a prefix that held the scratch copy, its absence would read as a deleted input: stale.
    surveyed = runner.invoke(app, ["status", str(tmp_path)])
    assert surveyed.exit_code == 0 and surveyed.stdout.count("verified\t") == 2, surveyed.output
    (pin,) = verify_artifact(open_store(tmp_path / "out")).manifest.lineage
    assert pin.url == open_store(ckpt).url


def test_a_push_leaves_what_a_local_folder_pins_as_it_was(tmp_path):
    """A folder made here pins itself after a push; a pulled copy keeps pinning the store it came from after it is
    pushed elsewhere; an origin record for another manifest (the copy was remade since) is not believed."""
    made = commit_files(tmp_path / "node" / "tokenized", {"data.arrow": b"rows"}, kind="tokenized")
    push(made, f"file://{tmp_path / 'store' / 'tokenized'}")
    assert open_input(str(made)).ref.url == open_store(made).url and not (made / ORIGIN_NAME).exists()

    copy = tmp_path / "other-node" / "tokenized"
    pull(f"file://{tmp_path / 'store' / 'tokenized'}", copy)
    push(copy, f"file://{tmp_path / 'scratch' / 'tokenized'}")
    assert open_input(str(copy)).ref.url == open_store(tmp_path / "store" / "tokenized").url
    commit_files(copy, {"data.arrow": b"new rows"}, kind="tokenized")
    assert open_input(str(copy)).ref.url == open_store(copy).url


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


def test_inputs_on_the_same_s3_store_resolve_with_the_endpoint_given(tmp_path, s3_env, monkeypatch):
    """`--endpoint-url` (or store.endpoint_url) reaches the inputs' store too: a checkpoint whose input is on the same
    server is `verified` by `status` and `verify` with no AWS_ENDPOINT_URL in the environment, not
    `input unreachable here`."""
    bucket = s3_env.new_bucket()
    run = f"s3://{bucket}/run"
    commit_files(tmp_path / "tokenized", {"data.arrow": b"rows" * 200}, kind="tokenized")
    push(str(tmp_path / "tokenized"), f"{run}/tokenized")
    data = open_input(f"{run}/tokenized")
    commit_files(tmp_path / "checkpoint", {"model.safetensors": b"w" * 300}, kind="checkpoint", lineage=[data.ref])
    push(str(tmp_path / "checkpoint"), f"{run}/checkpoint")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    endpoint = ["--endpoint-url", s3_env.endpoint]
    surveyed = CliRunner().invoke(app, ["status", run, *endpoint])
    assert surveyed.exit_code == 0, surveyed.output
    assert "unreachable" not in surveyed.output and surveyed.output.count("verified\t") == 2
    (tmp_path / "c.toml").write_text(f'[store]\nendpoint_url = "{s3_env.endpoint}"\n')
    checked = CliRunner().invoke(app, ["verify", f"{run}/checkpoint", "--config", str(tmp_path / "c.toml")])
    assert (
        checked.exit_code == 0 and "verified\tcheckpoint\t" in checked.output and "unreachable" not in checked.output
    ), checked.output


def test_push_and_pull_take_a_name_under_an_s3_store_url(tmp_path, s3_env, monkeypatch):
    """With store.url on S3, `push tokenized NAME` and `pull NAME DIR` mean NAME under store.url; ./NAME stays a local
    path."""
    monkeypatch.chdir(tmp_path)  # a bare name taken as a local path would land here
    bucket = s3_env.new_bucket()
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "s3://{bucket}/run"\n')
    commit_files(tmp_path / "tokenized", {"data.arrow": b"rows" * 200}, kind="tokenized")
    config = ["--config", str(tmp_path / "c.toml")]
    pushed = CliRunner().invoke(app, ["push", str(tmp_path / "tokenized"), "data/tokenized", *config])
    assert pushed.exit_code == 0 and f"verified\ttokenized\ts3://{bucket}/run/data/tokenized" in pushed.output, (
        pushed.output
    )
    assert verify_artifact(open_store(f"s3://{bucket}/run/data/tokenized")).state is State.VERIFIED
    pulled = CliRunner().invoke(app, ["pull", "data/tokenized", str(tmp_path / "copy"), *config])
    assert pulled.exit_code == 0 and verify_artifact(open_store(tmp_path / "copy")).state is State.VERIFIED, (
        pulled.output
    )
    local = CliRunner().invoke(app, ["push", "tokenized", "./local", *config])
    assert local.exit_code == 0 and verify_artifact(open_store(tmp_path / "local")).state is State.VERIFIED, (
        local.output
    )
