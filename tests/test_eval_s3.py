"""`eval` with everything on S3 (a real SeaweedFS server on 127.0.0.1): a training output and an export read back with
checksums, the report committed there as a verified artifact; held-out prompts read from a tokenized artifact there
without fetching its train split."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers.paths import GOLDEN, TOKENIZER_DIR

from blockdraft.config import load_config
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import export as export_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages.eval.prompts import held_out_prompts
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.inputs import open_input
from blockdraft.store.transfer import push

pytestmark = pytest.mark.s3


@pytest.mark.slow
def test_eval_reads_checkpoint_and_export_from_s3_and_commits_the_report_there(s3_bucket, tmp_path):
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden[:2]))
    cfg = load_config(None, {
        "target": {"path": str(GOLDEN / "target")},
        "dflash": {"architecture": "dflash", "block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5],
                   "num_draft_layers": 3, "gamma": 4.0},
        "store": {"url": f"s3://{s3_bucket}/store"},
        "eval": {"untrained_baseline": False},
    })
    run = f"s3://{s3_bucket}/runs/r1"
    save_checkpoint(open_store(run, cfg.store), 7, DFlashDrafter.from_pretrained(GOLDEN / "drafter"), {},
                    cfg.resolved(), [], {})
    exported = f"s3://{s3_bucket}/exports/r1"
    export_stage.run(cfg, run, exported)

    remote_prompts = f"s3://{s3_bucket}/prompts"
    open_store(remote_prompts, cfg.store).put_file("held-out.jsonl", prompts)

    for source, prompt_url in ((run, str(prompts)), (exported, f"{remote_prompts}/held-out.jsonl")):
        result = eval_stage.run(cfg, source, prompts=prompt_url, max_new_tokens=24)
        url = result.url
        assert url.startswith(f"s3://{s3_bucket}/store/eval/") and not result.already_done
        verified = verify_artifact(open_store(url, cfg.store))
        assert verified.state is State.VERIFIED and verified.manifest.kind == "eval", verified.summary()
        stored = json.loads(open_store(url, cfg.store).read_bytes("report.json"))
        assert [p["acceptance_lengths_dflash"] for p in stored["prompts"]] == [
            c["acceptance_lengths"] for c in golden[:2]
        ]
        assert stored["lossless"]["ok"] and set(stored["drafters"]) == {"dflash", "ngram"}
        assert result.details.checkpoint == source
        assert verified.manifest.lineage[1].url.endswith(Path(prompt_url).name) and verified.manifest.lineage[1].size

        manifest = open_store(url, cfg.store).read_bytes(MANIFEST_NAME)
        again = eval_stage.run(cfg, source, prompts=prompt_url, max_new_tokens=24)
        assert again.already_done and again.url == url and again.details == result.details
        assert open_store(url, cfg.store).read_bytes(MANIFEST_NAME) == manifest


def _conversation(i: int) -> dict:
    return {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i + 3}?"},
            {"role": "assistant", "content": f"It is {2 * i + 3}."},
        ],
    }


def test_held_out_prompts_from_s3_fetch_only_the_held_out_split(s3_bucket, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part-00.jsonl").write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(24)))
    cfg = load_config(None, {"target": {"path": str(TOKENIZER_DIR)}, "tokenize": {"held_out_fraction": 0.5}})
    tokenize_stage.run(cfg, str(tmp_path / "in"), str(tmp_path / "tokenized"))
    remote = f"s3://{s3_bucket}/tokenized"
    push(tmp_path / "tokenized", remote, cfg.store)

    data = open_input(remote, cfg.store)
    assert any(e.path.startswith("train/") for e in data.manifest.files)
    prompts = held_out_prompts(data, limit=100, workdir=tmp_path / "work")
    fetched = {
        p.relative_to(tmp_path / "work" / "prompts").as_posix()
        for p in (tmp_path / "work" / "prompts").rglob("*")
        if p.is_file()
    }
    # The held-out split's rows and the state.json that orders them: nothing of train, nothing else.
    assert fetched == {
        e.path
        for e in data.manifest.files
        if e.path.startswith("held_out/") and e.path.endswith((".arrow", "/state.json"))
    }
    held = datasets.load_from_disk(str(tmp_path / "tokenized"))["held_out"]
    assert 0 < len(prompts) == len(held)
    assert prompts == held_out_prompts(open_input(tmp_path / "tokenized"), limit=100, workdir=tmp_path / "local")
