"""`train` against a real S3 server (SeaweedFS on 127.0.0.1): data pulled with checksums, checkpoints pushed and
verified there, resume pulled back from there; a checkpoint whose upload never committed is not resumed from."""

from __future__ import annotations

import pytest
from helpers.train_data import config_file, logged_losses, make_rows, write_tokenized

from blockdraft.config import load_config
from blockdraft.model.formats import CHECKPOINT_KIND, checkpoint_key, find_resumable
from blockdraft.stages.train import run
from blockdraft.store import open_store
from blockdraft.store.artifact import State, uncommit, verify_artifact
from blockdraft.store.output import StageOutput
from blockdraft.store.transfer import push

pytestmark = pytest.mark.s3


@pytest.mark.fault
@pytest.mark.slow
def test_train_from_and_to_s3_resumes_from_the_last_committed_checkpoint(s3_bucket, tmp_path):
    local_data = tmp_path / "tokenized"
    local_data.mkdir()
    rows = make_rows(3, prompt_len=5, new_tokens=24, seed=1)
    write_tokenized(local_data, rows[:2], rows[2:])
    data_url = f"s3://{s3_bucket}/data/tokenized"
    push(local_data, data_url)

    out_url = f"s3://{s3_bucket}/runs/r1"
    cfg = load_config(config_file(tmp_path, data_url, output=out_url, max_steps=6, checkpoint_every=2, batch_size=1))
    first = run(cfg)
    out = open_store(out_url, cfg.store)
    assert first.url == out.child(checkpoint_key(6)).url and first.report.state is State.VERIFIED
    for step in (2, 4, 6):
        report = verify_artifact(out.child(checkpoint_key(step)), check_inputs=True)
        assert report.state is State.VERIFIED, report.summary()
        assert report.manifest.lineage[0].url == open_store(data_url, cfg.store).url

    # As if the push of step 6 had died before its manifest: the upload and its writer's mark are there, the commit is
    # not.
    uncommit(out.child(checkpoint_key(6)))
    StageOutput(out.child(checkpoint_key(6)), CHECKPOINT_KIND, "").mark_writing()
    assert find_resumable(out).step == 4
    again = run(cfg).details
    assert again.resumed_from == 4
    assert [e["loss"] for e in again.metrics] == [e["loss"] for e in first.details.metrics[4:]]
    assert verify_artifact(out.child(checkpoint_key(6))).state is State.VERIFIED
    assert sorted(logged_losses(tmp_path / "logs")) == list(range(1, 7))
