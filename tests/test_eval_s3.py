"""`eval` with everything on S3 (a real SeaweedFS server on 127.0.0.1): a training output and an export read back with
checksums, the report committed there as a verified artifact."""

from __future__ import annotations

import json
from pathlib import Path

from blockdraft.config import load_config
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.stages.eval.stage import run_eval
from blockdraft.stages.export.stage import export
from blockdraft.stages.train.checkpoint import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact

GOLDEN = Path(__file__).parent / "fixtures" / "dflash-golden"



def test_eval_reads_checkpoint_and_export_from_s3_and_commits_the_report_there(s3_bucket, tmp_path):
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden[:2]))
    cfg = load_config(None, {
        "target": {"path": str(GOLDEN / "target")},
        "dflash": {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5], "num_draft_layers": 3, "gamma": 4.0},
        "store": {"url": f"s3://{s3_bucket}/store"},
        "eval": {"untrained_baseline": False},
    })
    run = f"s3://{s3_bucket}/runs/r1"
    save_checkpoint(open_store(run, cfg.store), 7, DFlashDrafter.from_pretrained(GOLDEN / "drafter"), {}, cfg.resolved(), [], {})
    exported = f"s3://{s3_bucket}/exports/r1"
    export(run, exported, cfg)

    remote_prompts = f"s3://{s3_bucket}/prompts"
    open_store(remote_prompts, cfg.store).put_file("held-out.jsonl", prompts)

    for source, prompt_url in ((run, str(prompts)), (exported, f"{remote_prompts}/held-out.jsonl")):
        report, url = run_eval(cfg, source, prompts=prompt_url, max_new_tokens=24)
        assert url.startswith(f"s3://{s3_bucket}/store/eval/")
        verified = verify_artifact(open_store(url, cfg.store))
        assert verified.state is State.VERIFIED and verified.manifest.kind == "eval", verified.summary()
        stored = json.loads(open_store(url, cfg.store).read_bytes("report.json"))
        assert [p["acceptance_lengths_dflash"] for p in stored["prompts"]] == [c["acceptance_lengths"] for c in golden[:2]]
        assert stored["lossless"]["ok"] and set(stored["drafters"]) == {"dflash", "ngram"}
        assert report["checkpoint"] == source
        assert verified.manifest.lineage[1].url.endswith(Path(prompt_url).name) and verified.manifest.lineage[1].size
