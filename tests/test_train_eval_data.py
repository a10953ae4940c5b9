"""train.eval_data (issue 29 item 1): the held-out figures and the decoded checkpoints read the rows of a tokenized
artifact of their own (both its splits), in place of train.data's held-out split; the checkpoint pins it as a second
input, so `status` says the checkpoint is stale when it changes; bad eval data is refused in one line before
training."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from helpers.train_data import config_file, make_rows, write_tokenized
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.model.formats import checkpoint_key, trained_on
from blockdraft.stages import eval as eval_stage
from blockdraft.stages.train import run
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact
from blockdraft.store.transfer import push

# What tokenize records of how its rows were made (the manifest's config.tokenize_run), as train compares it.
MADE = {"template_sha256": "a" * 64, "tokenizer_sha256": "b" * 64, "thinking": "auto", "end_of_turn_id": 7}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return make_rows(6, prompt_len=6, new_tokens=24, seed=0)


@pytest.fixture(scope="module")
def data_url(tmp_path_factory, rows) -> str:
    """train.data tokenized with no held-out rows (held_out_fraction 0)."""
    return write_tokenized(tmp_path_factory.mktemp("data"), rows[:4], [], MADE)


def _eval_data(folder, rows, made=MADE) -> str:
    """A separate tokenized artifact with one row in each split: both are held-out rows of the run."""
    return write_tokenized(folder, rows[4:5], rows[5:6], made)


def test_eval_data_gives_the_held_out_figures_the_decoded_prompts_and_a_pinned_second_input(tmp_path, rows, data_url):
    eval_url = _eval_data(tmp_path / "eval", rows)
    cfg = load_config(config_file(tmp_path, data_url, eval_data=eval_url, max_steps=4, checkpoint_every=4, eval_every=2,
                                  decode_eval_prompts=1, target_agreement_rows=0))
    result = run(cfg).details
    entries = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "eval" in e] == [2, 4]
    assert entries[-1]["eval"]["rows"] == 2 and entries[-1]["eval"]["tau_estimate"] >= 1.0  # both of its splits
    checkpoint = tmp_path / "ckpt" / checkpoint_key(4)
    report = verify_artifact(open_store(checkpoint))
    assert report.manifest is not None
    counts = report.manifest.counts
    assert counts["held_out_tau"] == round(entries[-1]["eval"]["tau_estimate"], 3)
    assert counts["decoded_tau"] >= 1.0 and counts["decoded_lossless"] is True  # decoded on eval_data's prompts
    assert "held-out" in result.summary and "held-out -" not in result.summary
    # Pinned: train.data first (what export calls the training data), then train.eval_data, each by its manifest.
    lineage = report.manifest.lineage
    assert [ref.url for ref in lineage] == [open_store(data_url).url, open_store(eval_url).url]
    assert lineage[1].sha256 == verify_artifact(open_store(eval_url)).manifest_sha256
    assert trained_on(report.manifest) == lineage[:1]
    assert json.loads((checkpoint / "blockdraft-config.json").read_text())["train"]["eval_data"] == eval_url
    # Another eval set at the same place: the checkpoint's held-out figures are no longer of it.
    assert verify_artifact(open_store(checkpoint), check_inputs=True).state is State.VERIFIED
    shutil.rmtree(eval_url)
    _eval_data(tmp_path / "eval", rows[::-1])
    assert verify_artifact(open_store(checkpoint), check_inputs=True).state is State.STALE


def test_eval_without_prompts_decodes_every_row_of_eval_data_as_training_did(tmp_path, rows, data_url):
    """With train.eval_data set, eval's default prompts are the rows training held out: every row of train.eval_data,
    in the order training decoded them, so eval's tau is the checkpoint's decoded tau. train.data here has no held-out
    row at all, so taking its held-out split would find none."""
    eval_url = _eval_data(tmp_path / "eval", rows)
    cfg = load_config(config_file(tmp_path, data_url, eval_data=eval_url, max_steps=4, checkpoint_every=4,
                                  decode_eval_prompts=2, target_agreement_rows=0))
    trained = run(cfg)
    report = eval_stage.run(cfg, trained.url, str(tmp_path / "eval-report")).details
    # both rows: its train split and its held-out one
    assert report.prompts_source == [eval_url] and report.num_prompts == 2
    decoded = trained.report.manifest.counts["decoded_tau"]
    assert decoded == pytest.approx(report.drafters["dflash"].tau, abs=0.01) and report.lossless.ok


def test_bad_eval_data_is_refused_in_one_line_before_training(tmp_path, rows, data_url):
    def refused(eval_data: str, error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            run(load_config(config_file(tmp_path, data_url, eval_data=eval_data, max_steps=2)))
        assert not any((tmp_path / "ckpt").glob("step-*"))

    def url(path: str) -> str:  # as the lines name a store
        return re.escape(open_store(path).url.rstrip("/"))

    other_tokenizer = _eval_data(tmp_path / "other-tokenizer", rows, {**MADE, "tokenizer_sha256": "c" * 64})
    refused(other_tokenizer, ConfigError, rf"^train.eval_data {url(other_tokenizer)} was tokenized with another "
                                          r"tokenizer \(tokenizer_sha256 c{12}\.\.\.\) than train.data "
                                          rf"{url(data_url)} \(b{{12}}\.\.\.\): .*tokenize the eval conversations with "
                                          r"train.data's")
    other_template = _eval_data(tmp_path / "other-template", rows, {**MADE, "template_sha256": "d" * 64})
    refused(other_template, ConfigError, f"^train.eval_data {url(other_template)} was tokenized with another chat "
                                         "template")
    missing = str(tmp_path / "no-such-eval")
    refused(missing, ArtifactError, rf"^train.eval_data {url(missing)} does not exist \(nothing there\); check the "
                                    r"path or URL$")
    refused(data_url, ConfigError, f"^train.eval_data {url(data_url)} is the artifact train.data {url(data_url)} "
                                   ".*unset it")
    empty = write_tokenized(tmp_path / "empty", [], [], MADE)
    refused(empty, ArtifactError, f"^train.eval_data {url(empty)} holds no rows in either split; tokenize more")
    inside = _eval_data(tmp_path / "run" / "eval", rows)
    with pytest.raises(ConfigError, match=f"^train.eval_data {url(inside)} lies inside the output .*; a stage never "
                                          "reads what it writes"):
        run(load_config(config_file(tmp_path, data_url, eval_data=inside, output=str(tmp_path / "run"), max_steps=2)))
    assert not any((tmp_path / "run").glob("step-*"))
    # The command line says it in one line, without a traceback.
    out = CliRunner().invoke(app,
                             ["train", "--config", str(config_file(tmp_path, data_url, eval_data=other_tokenizer))])
    assert out.exit_code != 0 and "Traceback" not in out.output
    assert "train.eval_data " in out.stderr and "was tokenized with another tokenizer" in out.stderr.replace("\n", "")


def test_eval_data_in_a_bucket_is_pulled_to_the_cache_with_its_checksums_and_pinned_at_the_bucket(
    s3_bucket, tmp_path, rows, data_url
):
    local = _eval_data(tmp_path / "eval", rows)
    eval_url = f"s3://{s3_bucket}/data/eval"
    push(local, eval_url)
    cfg = load_config(config_file(tmp_path, data_url, eval_data=eval_url, max_steps=2, checkpoint_every=2,
                                  target_agreement_rows=0))
    result = run(cfg)
    digest = verify_artifact(open_store(eval_url, cfg.store)).manifest_sha256
    assert digest is not None and (tmp_path / "logs" / f"data-{digest[:16]}" / "dataset_dict.json").is_file()
    assert result.report.manifest is not None and result.details.signal["held_out_tau"] >= 1.0
    assert [(ref.url, ref.sha256) for ref in result.report.manifest.lineage[1:]] == [
        (open_store(eval_url, cfg.store).url, digest)
    ]


def test_ranks_reading_other_eval_data_at_the_same_path_are_refused_naming_the_node(tmp_path):
    """Two real gloo ranks with the same train.data: with the same train.eval_data digest they agree; with another (each
    node's own copy) every rank stops with the same line naming node 1 and train.eval_data."""
    import socket

    import torch.multiprocessing as mp
    from helpers.agree_rank import compare_data

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rounds = [[["c" * 64, "e" * 64]] * 2, [["c" * 64, "a" * 64], ["c" * 64, "b" * 64]]]
    mp.spawn(compare_data, args=(port, "tok", rounds, str(tmp_path), "evaltok"), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}-0").read_text() for r in (0, 1)] == ["agreed", "agreed"]
    said = [(tmp_path / f"rank{r}-1").read_text() for r in (0, 1)]
    assert said[0] == said[1] and said[0].startswith("node 1 (rank 1) reads other data at train.eval_data evaltok"), (
        said
    )
    assert "manifest sha256 bbbbbbbbbbbb..., node 0's aaaaaaaaaaaa..." in said[0]
