"""The demo's pipeline (`--profile ci`) end to end: every artifact verified at the destination, eval lossless.

The same pipeline runs on the embedded local-folder store and on a real S3 server (SeaweedFS), as `blockdraft demo`
with `--store s3://...` would.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.pipeline import run_demo
from blockdraft.store import open_store
from blockdraft.store.artifact import State
from blockdraft.store.status import status

STAGES = {"completions", "tokenized", "eval", "export"}


def _check(result) -> None:
    roots = set(result.states)
    assert STAGES <= roots, result.states
    assert any(root.startswith("checkpoints/step-") for root in roots), result.states
    assert set(result.states.values()) == {"verified"}, result.states
    assert result.lossless
    assert set(result.tau) >= {"dflash", "ngram", "untrained"}
    assert result.speedup > 0
    # The status page is rendered from the same destination reads.
    page = (result.workdir / "PROGRESS.md").read_text()
    assert page.count("**verified**") == len(result.states)


@pytest.mark.slow
def test_demo_ci_profile_on_the_local_store(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--profile", "ci"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "speedup over target-only greedy" in out.stdout and "lossless: yes" in out.stdout
    assert (
        "dflash tau greedy" in out.stdout
        and "at temperature 0.6, top-p 0.95, top-k 20, vllm's draft rule:" in out.stdout
    )
    # The demo holds out a tenth of its conversations: training measures its held-out figures and decodes its checkpoint
    # on them, the line sets them beside eval's, and the target's own answers raise no training-signal warning.
    own = next(line for line in lines if line.startswith("training's own figures: "))
    assert re.search(r"held-out \d+\.\d\d, decoded \d+\.\d\d \(\d+\.\d\dx on 2 prompts\)", own), own
    assert "WARNING" not in out.output, out.output
    table = dict(line.split("\t") for line in lines if "\t" in line)
    assert table.pop("artifact") == "state"
    assert STAGES <= set(table) and set(table.values()) == {"verified"}, table
    # The store is a folder inside the workdir by default, and the export is what SGLang/vLLM load.
    export = tmp_path / "work" / "store" / "export"
    assert json.loads((export / "config.json").read_text())["dflash_config"]["block_size"] == 8

    # Two machines: the training node pulled `tokenized` into its own folder and trained from it. With that folder gone
    # (another machine's disk), status on the store still finds every artifact verified: lineage pins the store's copy.
    store = tmp_path / "work" / "store"
    shutil.rmtree(tmp_path / "work" / "train-node")
    after = runner.invoke(app, ["status", str(store)])
    assert after.exit_code == 0, after.output
    assert {line.split("\t")[0] for line in after.stdout.splitlines()} == {"verified"}, after.stdout
    # One byte of the tokenized artifact's input changes at the store: everything made from it turns stale.
    shard = next(p for p in sorted((store / "completions").rglob("*.jsonl*")) if p.is_file())
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    states = {a.root.split("/")[0]: a.state for a in status(open_store(store))}
    assert states == {"completions": State.CORRUPT, "tokenized": State.STALE, "checkpoints": State.STALE,
                      "eval": State.STALE, "export": State.STALE}, states


@pytest.mark.s3
@pytest.mark.slow
def test_demo_ci_profile_against_s3(tmp_path, s3_env):
    bucket = s3_env.new_bucket()
    result = run_demo(tmp_path / "work", f"s3://{bucket}/demo", "ci")
    _check(result)
    assert result.store_url == f"s3://{bucket}/demo"
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "demo/export/config.json" in keys and "demo/export/blockdraft-manifest.json" in keys


@pytest.mark.slow
def test_demo_ci_profile_on_the_tiny_hybrid_target_with_a_sliding_window_drafter(tmp_path):
    """`--target hybrid`: the same pipeline on the Qwen3.5-style hybrid target, a drafter with a sliding-window layer,
    eval lossless through the linear-attention rollback, and an export that declares its sliding layer."""
    runner = CliRunner()
    out = runner.invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--profile", "ci", "--target", "hybrid"])
    assert out.exit_code == 0, out.output
    assert "lossless: yes" in out.stdout
    table = dict(line.split("\t") for line in out.stdout.splitlines() if "\t" in line)
    assert table.pop("artifact") == "state" and STAGES <= set(table) and set(table.values()) == {"verified"}, table
    store = tmp_path / "work" / "store"
    manifest = json.loads((store / "completions" / "blockdraft-manifest.json").read_text())
    assert manifest["config"]["target"]["path"].endswith("tiny-hybrid-target")
    exported = json.loads((store / "export" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention", "full_attention"]
    assert exported["use_sliding_window"] is True and exported["sliding_window"] == 32
    assert exported["dflash_config"]["block_size"] == 8 and exported["dflash_config"]["mask_token_id"] == 448


@pytest.mark.slow
def test_demo_ci_profile_with_a_dflash2_drafter(tmp_path):
    """`--drafter dflash2`: the same pipeline trains, evaluates (lossless, the walk proposing) and exports a DFlash2
    drafter; the printed taus are the eval report's."""
    out = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--profile", "ci", "--drafter",
                                   "dflash2"])
    assert out.exit_code == 0, out.output
    assert "lossless: yes" in out.stdout
    table = dict(line.split("\t") for line in out.stdout.splitlines() if "\t" in line)
    assert table.pop("artifact") == "state" and STAGES <= set(table) and set(table.values()) == {"verified"}, table
    store = tmp_path / "work" / "store"
    exported = json.loads((store / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["is_causal"] is False
    assert exported["dflash_config"]["selector_rank"] == 64 and exported["dflash_config"]["conv_kernel_size"] == 2
    report = json.loads((store / "eval" / "report.json").read_text())
    assert f"tau dflash2 walk {report['drafters']['dflash']['tau']:.2f}" in out.stdout


def test_demo_refuses_an_unknown_target_or_drafter(tmp_path):
    out = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--target", "mamba"])
    assert out.exit_code != 0 and "--target must be one of tiny, hybrid" in out.output
    out = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "work"), "--drafter", "medusa"])
    assert out.exit_code != 0 and "--drafter must be one of dflash, dflash2" in out.output
    assert not (tmp_path / "work").exists()


def test_the_demo_says_when_its_drafter_does_not_beat_ngram_lookup(tmp_path):
    from blockdraft.pipeline import DemoResult, demo_lines

    serving = {"sglang_command": "sglang ...", "vllm_command": "vllm ..."}
    weak = DemoResult(workdir=tmp_path, store_url="file://store", tau={"dflash": 1.20, "ngram": 1.26}, serving=serving)
    strong = DemoResult(workdir=tmp_path, store_url="file://store", tau={"dflash": 3.75, "ngram": 1.30},
                        serving=serving)
    said = "the drafter does not beat n-gram lookup on these prompts (1.20 <= 1.26)"
    assert any(line.startswith(said) for line in demo_lines(weak))
    assert not any("does not beat n-gram" in line for line in demo_lines(strong))
