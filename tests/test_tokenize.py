"""The tokenize stage end to end with the real Qwen3 tokenizer: input variants, bad rows, split, workers, resume,
verify."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.hybrid import save_qwen3_5_composite
from helpers.paths import TEMPLATES, TOKENIZER_DIR
from helpers.reporters import ProgressLog
from helpers.tokenize_data import (
    config,
    conversation,
    files_of,
    half_finished,
    make_corpus,
    piece_names,
    rows_of,
    tokenize,
    write_jsonl,
)
from transformers import AutoTokenizer
from typer.testing import CliRunner

import blockdraft
from blockdraft.cli import app
from blockdraft.config import TargetConfig, load_config
from blockdraft.data.tokenizer import resolve_tokenizer
from blockdraft.errors import ArtifactError
from blockdraft.reporter import Reporter
from blockdraft.stages.tokenize.runner import ShardRunner
from blockdraft.stages.tokenize.shard import is_held_out
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    State,
    commit_artifact,
    entry_for_local_file,
    read_manifest,
    verify_artifact,
)


def quarantine_lines(output: Path) -> list[dict]:
    return [
        json.loads(line) for p in sorted((output / "quarantine").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]


def test_rows_load_with_datasets_and_carry_exact_columns(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=1, per_file=12)
    result = tokenize(str(corpus), str(tmp_path / "out"), config(held_out_fraction=0.0))
    assert result.report.state is State.VERIFIED
    rows = rows_of(tmp_path / "out")
    assert rows["held_out"] == []
    train = rows["train"]
    assert len(train) == result.details.counts["rows_out"] == sum(1 + i % 3 for i in range(12))
    ds = datasets.load_from_disk(str(tmp_path / "out"))["train"]
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "uint8"
    for row in train:
        assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
        assert row["num_supervised"] == sum(row["loss_mask"])
    assert [(r["source_id"], r["turn"]) for r in train if r["source_id"] == "c2"] == [("c2", 0), ("c2", 1), ("c2", 2)]
    assert result.details.counts["tokens"] == sum(r["num_tokens"] for r in train)
    assert result.details.counts["supervised_tokens"] == sum(r["num_supervised"] for r in train)


def test_input_variants_normalise_to_the_same_rows(tmp_path):
    canonical = [conversation(i, turns=2) for i in range(6)]
    reference = tokenize(str(write_jsonl(tmp_path / "ref.jsonl", canonical)), str(tmp_path / "ref"), config())
    expected = rows_of(tmp_path / "ref")
    assert reference.details.counts["rows_out"] == 12

    def sharegpt(conv):
        role = {"system": "system", "user": "human", "assistant": "gpt"}
        return {
            "id": conv["id"],
            "conversations": [
                {
                    "from": role[m["role"]],
                    "value": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"
                    if "reasoning_content" in m
                    else m["content"],
                }
                for m in conv["messages"]
            ],
        }

    variants = {
        "a.jsonl.gz": canonical,
        "b.jsonl.zst": canonical,
        "c.json": None,  # a JSON array
        "d.parquet": None,
        "e.jsonl": [{"id": c["id"], "conversations": c["messages"]} for c in canonical],
        "f.jsonl": [sharegpt(c) for c in canonical],
    }
    for name, rows in variants.items():
        path = tmp_path / "variants" / name
        if name.endswith(".json"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(canonical))
        elif name.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(canonical), path)
        else:
            write_jsonl(path, rows)
        tokenize(str(path), str(tmp_path / f"out-{name}"), config())
        assert rows_of(tmp_path / f"out-{name}") == expected, name


def test_generator_token_ids_are_used_directly(tmp_path):
    rows = [
        {"id": "g1", "prompt_token_ids": [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
         "completion_token_ids": [13048, 0, 151645]},
        {"id": "g2", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5]},
        {"id": "g3", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 10**9]},
    ]
    result = tokenize(str(write_jsonl(tmp_path / "ids.jsonl", rows)), str(tmp_path / "out"),
                      config(held_out_fraction=0.0))
    train = rows_of(tmp_path / "out")["train"]
    assert [r["input_ids"] for r in train] == [rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"],
                                               [1, 2, 3, 4, 5]]
    assert [r["loss_mask"] for r in train] == [[0] * 9 + [1] * 3, [0, 0, 0, 1, 1]]
    assert result.details.counts["rejected"] == {"bad_token_ids": 1}
    assert result.details.counts["thinking"] == {"generator": 2}


BAD_ROWS = {
    "bad_json": '{"id": "broken", "messages": [',
    "no_assistant_turn": {"id": "b1", "messages": [{"role": "user", "content": "hi"}]},
    "no_user_turn": {"id": "b2",
                     "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
    "system_not_first": {"id": "b3", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                                                  {"role": "assistant", "content": "a"}]},
    "non_string_content": {"id": "b4",
                           "messages": [{"role": "user", "content": {"text": "q"}},
                                        {"role": "assistant", "content": "a"}]},
    "lone_think_close": {"id": "b5",
                         "messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "r</think>a"}]},
    "unclosed_think": {"id": "b6",
                       "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r"}]},
    "empty_turn": {"id": "b7", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
    "too_long": {"id": "b8",
                 "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "a b c"}]},
}


def test_every_bad_row_class_is_quarantined_with_its_reason_and_counted(tmp_path):
    good = [conversation(i, reasoning=False) for i in range(4)]
    rows = good[:2] + list(BAD_ROWS.values()) + good[2:]
    result = tokenize(str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "out"), config(max_length=120))
    assert result.report.state is State.VERIFIED
    assert result.details.counts["rejected"] == {reason: 1 for reason in BAD_ROWS}
    quarantined = quarantine_lines(tmp_path / "out")
    assert sorted(q["reason"] for q in quarantined) == sorted(BAD_ROWS)
    by_reason = {q["reason"]: q for q in quarantined}
    assert by_reason["system_not_first"]["source_id"] == "b3" and by_reason["too_long"]["turn"] == 0
    assert by_reason["bad_json"]["row"] == BAD_ROWS["bad_json"] and by_reason["bad_json"]["position"] == 3
    out = rows_of(tmp_path / "out")
    assert sorted(r["source_id"] for split in out.values() for r in split) == [f"c{i}" for i in range(4)]
    assert result.details.counts["rows_in"] == len(rows)
    assert result.details.counts["rows_out"] + sum(result.details.counts["rejected"].values()) == len(rows)
    assert read_manifest(open_store(tmp_path / "out"))[0].counts["rejected"] == result.details.counts["rejected"]


DROPS_CONTENT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_ERROR_ROW = {"id": "te", "messages": [  # Qwen3.6 iterates tool-call arguments with |items: a list raises
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "f", "arguments": ["not", "a", "mapping"]}}]}]}


@pytest.mark.parametrize(
    ("template", "thinking", "rows", "expected"),
    [
        ("trl_qwen3_instruct_2507", "auto", [conversation(1), conversation(2, reasoning=False)],
         {"template_dropped_reasoning": 1}),
        ("qwenlm_qwen3_nonthinking", "auto", [conversation(1), conversation(2, reasoning=False)],
         {"render_not_prefix": 1}),
        ("trl_qwen3_6", "on", [conversation(1), conversation(2, reasoning=False), TEMPLATE_ERROR_ROW],
         {"boundary_merge": 1, "template_error": 1}),
        (DROPS_CONTENT, "auto", [conversation(2, reasoning=False), conversation(3, reasoning=False)],
         {"template_dropped_content": 2}),
    ],
    ids=["2507-drops-reasoning", "nonthinking-not-prefix", "qwen3.6-merge-and-error", "drops-content"],
)
def test_template_caused_rejections_are_quarantined(tmp_path, template, thinking, rows, expected):
    if template.startswith("{%"):
        path = tmp_path / "custom.jinja"
        path.write_text(template)
    else:
        path = TEMPLATES / f"{template}.jinja"
    result = tokenize(str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "out"),
                      config(str(path), thinking=thinking))
    assert result.report.state is State.VERIFIED
    assert result.details.counts["rejected"] == expected
    assert Counter(q["reason"] for q in quarantine_lines(tmp_path / "out")) == expected
    assert result.details.counts["rows_out"] == result.details.counts["turns_in"] - sum(expected.values())


def test_held_out_split_is_by_conversation_and_recorded(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=2, per_file=60)
    result = tokenize(str(corpus), str(tmp_path / "out"), config(held_out_fraction=0.25))
    out = rows_of(tmp_path / "out")
    train_ids = {r["source_id"] for r in out["train"]}
    held_ids = {r["source_id"] for r in out["held_out"]}
    assert not train_ids & held_ids
    assert all(is_held_out(s, 0.25) for s in held_ids) and not any(is_held_out(s, 0.25) for s in train_ids)
    assert 15 <= len(held_ids) <= 45  # 120 conversations at 25%
    manifest = read_manifest(open_store(tmp_path / "out"))[0]
    assert manifest.counts["held_out_fraction"] == 0.25 and manifest.config["tokenize"]["held_out_fraction"] == 0.25
    assert manifest.counts["held_out_rows"] == len(out["held_out"]) == result.details.counts["held_out_rows"]


def test_rows_sharing_a_group_land_on_one_side_of_the_split(tmp_path):
    """Several answers to one prompt (ids of their own, one `group`) are held out together; by id alone they split."""
    rows = [{**conversation(g), "id": f"c{g}-answer{k}", "group": f"prompt-{g}"} for g in range(12) for k in range(4)]
    assert any(len({is_held_out(r["id"], 0.5) for r in rows if r["group"] == f"prompt-{g}"}) == 2 for g in range(12))
    tokenize(str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "out"), config(held_out_fraction=0.5))
    out = rows_of(tmp_path / "out")
    side = {r["source_id"]: split for split in ("train", "held_out") for r in out[split]}
    assert len(side) == len(rows)
    for g in range(12):
        sides = {side[f"c{g}-answer{k}"] for k in range(4)}
        assert sides == {"held_out" if is_held_out(f"prompt-{g}", 0.5) else "train"}
    assert {"train", "held_out"} == set(side.values())


def test_manifest_holds_template_hash_thinking_mode_counts_and_lineage(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=2, per_file=8)
    result = tokenize(str(corpus), str(tmp_path / "out"), config(thinking="auto"))
    manifest, raw = read_manifest(open_store(tmp_path / "out"))
    run = manifest.config["tokenize_run"]
    own_template = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert run["template_sha256"] == hashlib.sha256(own_template.encode()).hexdigest()
    assert run["template_matches_target"] is True and run["thinking"] == "auto" and run["end_of_turn_id"] == 151645
    thinking = manifest.counts["thinking"]
    assert (
        thinking["on"] > 0 and thinking["off"] > 0 and thinking["on"] + thinking["off"] == manifest.counts["rows_out"]
    )
    assert [Path(ref.url).name for ref in manifest.lineage] == ["part-00.jsonl", "part-01.jsonl"]
    assert all(ref.kind == "raw" and ref.checksum and ref.size for ref in manifest.lineage)
    listed = {f.path for f in manifest.files}
    assert {"dataset_dict.json", "train/state.json", "quarantine/shard-00000.jsonl"} <= listed
    # A rerun with the same config and inputs finds the artifact verified and leaves its manifest untouched.
    again = tokenize(str(corpus), str(tmp_path / "out"), config(thinking="auto"))
    assert again.already_done and read_manifest(open_store(tmp_path / "out"))[1] == raw
    assert result.report.manifest_sha256 == again.report.manifest_sha256


@pytest.mark.slow
def test_two_workers_match_one_worker_row_for_row(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=4, per_file=20)
    one = tokenize(str(corpus), str(tmp_path / "one"), config(workers=1, held_out_fraction=0.1))
    two = tokenize(str(corpus), str(tmp_path / "two"), config(workers=2, held_out_fraction=0.1))
    assert two.report.state is State.VERIFIED and len(two.details.worker_peak_rss_mib) == 4
    assert rows_of(tmp_path / "two") == rows_of(tmp_path / "one")
    assert one.details.counts == two.details.counts


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"tokenize": {"max_length": 4096}}, {"tokenize": {"max_length": 40}}),
        ({"chat_template": "trl_qwen3"}, {"chat_template": "trl_qwen3_training"}),
        ({}, {}),
    ],
    ids=["max_length-changed", "template-changed", "same-config-resumes"],
)
@pytest.mark.fault
def test_rerun_over_half_finished_output_redoes_only_mismatched_shards(tmp_path, first, second):
    corpus = make_corpus(tmp_path / "in", files=3, per_file=10)

    def run(spec, output):
        template = spec.get("chat_template")
        cfg = config(str(TEMPLATES / f"{template}.jinja") if template else None, **spec.get("tokenize", {}))
        return tokenize(str(corpus), str(output), cfg)

    run(first, tmp_path / "out")
    half_finished(tmp_path / "out", "shard-00001")
    resumed = run(second, tmp_path / "out")
    fresh = run(second, tmp_path / "fresh")
    assert resumed.report.state is State.VERIFIED
    assert resumed.details.shards_skipped == (2 if first == second else 0)
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "fresh")
    assert files_of(tmp_path / "out") == files_of(tmp_path / "fresh")
    assert resumed.details.counts == fresh.details.counts


@pytest.mark.fault
def test_verify_reports_corrupt_missing_incomplete_on_tokenized_output(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=1, per_file=10)
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(app,
                           ["tokenize", str(corpus), str(out), "--tokenizer", str(TOKENIZER_DIR), "--held-out-fraction",
                            "0"])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 0 and result.stdout.startswith("verified\ttokenized")

    shard = out / "train" / "shard-00000-part-000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", str(out)])
    assert (
        result.exit_code == 1
        and result.stdout.startswith("corrupt")
        and "train/shard-00000-part-000.arrow" in result.output
    )

    shard.unlink()
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and result.stdout.startswith("missing")

    (out / MANIFEST_NAME).unlink()
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and result.stdout.startswith("incomplete")


def test_a_template_that_is_not_the_targets_is_announced_loudly(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=1, per_file=4)
    config_file = tmp_path / "blockdraft.toml"
    config_file.write_text(f'[target]\npath = "{TOKENIZER_DIR.as_posix()}"\n')
    result = CliRunner().invoke(app, ["tokenize", str(corpus), str(tmp_path / "out"), "--config", str(config_file),
                                      "--chat-template", str(TEMPLATES / "trl_qwen3_6.jinja")])
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.output and "differs from the target tokenizer's own" in result.output
    manifest = read_manifest(open_store(tmp_path / "out"))[0]
    assert manifest.config["tokenize_run"]["template_matches_target"] is False


def test_bad_user_input_is_one_clear_line(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app,
                           ["tokenize", str(tmp_path / "nope"), str(tmp_path / "out"), "--tokenizer",
                            str(TOKENIZER_DIR)])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["tokenize", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "--tokenizer" in result.output
    result = runner.invoke(app,
                           ["tokenize", str(tmp_path / "empty"), str(tmp_path / "out"), "--tokenizer",
                            str(TOKENIZER_DIR),
                                 "--thinking", "maybe"])
    assert result.exit_code == 2 and "thinking" in result.output


def test_shards_are_streamed_in_bounded_record_batches_and_rotated(tmp_path):
    """What keeps a worker's memory flat: rows leave in record batches of at most 256, files rotate every
    rows_per_shard."""
    corpus = make_corpus(tmp_path / "in", files=1, per_file=600)
    tokenize(str(corpus), str(tmp_path / "out"), config(held_out_fraction=0.0, rows_per_shard=300))
    files = sorted((tmp_path / "out" / "train").glob("*.arrow"))
    assert len(files) >= 3  # rotated every 300 rows
    for path in files:
        with pa.ipc.open_stream(path) as reader:
            sizes = [b.num_rows for b in reader]
        assert max(sizes) <= 256 and sum(sizes) <= 300
    assert len(rows_of(tmp_path / "out")["train"]) == sum(1 + i % 3 for i in range(600))


@pytest.mark.fault
def test_a_completions_artifact_is_read_through_its_manifest_and_pinned_by_it(tmp_path):
    src = tmp_path / "completions"
    write_jsonl(src / "shard-0.jsonl.zst", [conversation(i) for i in range(5)])
    (src / "notes.txt").write_text("not a completions file")
    commit_artifact(open_store(src), "completions", [entry_for_local_file(src, src / "shard-0.jsonl.zst")],
                    config={"k": 1})
    result = tokenize(str(src), str(tmp_path / "out"), config())
    assert result.details.counts["rows_out"] == 5
    manifest = read_manifest(open_store(tmp_path / "out"))[0]
    [ref] = manifest.lineage
    assert ref.kind == "manifest" and ref.sha256 == hashlib.sha256((src / MANIFEST_NAME).read_bytes()).hexdigest()
    # The input artifact changes: the tokenized output is reported stale, by content, not by path or time.
    commit_artifact(open_store(src), "completions", [entry_for_local_file(src, src / "shard-0.jsonl.zst")],
                    config={"k": 2})
    assert verify_artifact(open_store(tmp_path / "out"), check_inputs=True).state is State.STALE


class AppendAfterFirstProgress(Reporter):
    """Appends `line` to `path` once the first input bytes are reported done: after listing, before later shards are
    read."""

    def __init__(self, path: Path, line: str) -> None:
        super().__init__()
        self.path, self.line, self.appended = path, line, False

    def progress(self, task, completed, total=None, **fields):
        if completed and not self.appended:
            with self.path.open("a") as f:
                f.write(self.line)
            self.appended = True


@pytest.mark.fault
def test_an_input_that_changes_after_listing_fails_the_shard_instead_of_recording_it(tmp_path):
    """The piece names the input's checksum; the worker proves the bytes it read have it, so a piece never lies."""
    corpus = make_corpus(tmp_path / "in", files=2, per_file=5)
    # One worker: shard 0 reports its bytes (and is recorded) before shard 1 opens its input, which has changed by then.
    reporter = AppendAfterFirstProgress(corpus / "part-01.jsonl", json.dumps(conversation(99)) + "\n")
    with pytest.raises(ArtifactError, match="part-01.jsonl changed while it was tokenized"):
        tokenize(corpus, tmp_path / "out", config(workers=1), reporter)
    assert reporter.appended and piece_names(tmp_path / "out") == ["shard-00000"]
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    # The rerun lists the input afresh, keeps shard 0 and redoes shard 1 with the new row.
    result = tokenize(corpus, tmp_path / "out", config())
    assert result.details.shards_skipped == 1 and result.details.counts["rows_in"] == 11


def test_a_rerun_with_the_same_config_and_input_is_already_done_and_leaves_the_manifest_alone(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=2, per_file=6)
    first = tokenize(corpus, tmp_path / "out", config())
    manifest = tmp_path / "out" / MANIFEST_NAME
    before, stat = manifest.read_bytes(), manifest.stat()
    files = files_of(tmp_path / "out")
    reporter = Reporter()
    again = tokenize(corpus, tmp_path / "out", config(workers=2), reporter)  # workers do not change the rows
    assert not first.already_done and again.already_done
    assert again.report.state is State.VERIFIED and again.report.manifest_sha256 == first.report.manifest_sha256
    assert manifest.read_bytes() == before and manifest.stat().st_mtime_ns == stat.st_mtime_ns  # not rewritten
    assert files_of(tmp_path / "out") == files
    assert again.details.shards_skipped == 2 and again.details.counts == first.details.counts
    assert not any(line.startswith("resuming") for line in reporter.lines)
    # Another config is not done: it is redone, and the manifest is rewritten.
    other = tokenize(corpus, tmp_path / "out", config(max_length=64))
    assert not other.already_done and other.details.shards_skipped == 0 and manifest.read_bytes() != before


@pytest.mark.slow
def test_progress_is_reported_in_input_bytes_with_rows_and_tokens(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=3, per_file=40)
    total = sum(p.stat().st_size for p in corpus.iterdir())
    for workers in (1, 2):
        reporter = ProgressLog()
        result = tokenize(corpus, tmp_path / f"out-{workers}", config(workers=workers), reporter)
        assert {task for task, *_ in reporter.calls} == {"tokenize"} and all(
            t == total for _, _, t, _ in reporter.calls
        )
        done = [c for _, c, _, _ in reporter.calls]
        assert done[0] == 0 and done == sorted(done) and done[-1] == total
        assert reporter.calls[-1][3] == {"rows": result.details.counts["rows_out"],
                                         "tokens": result.details.counts["tokens"]}
    # A rerun that resumes some shards reports only the bytes still to do, and says it resumes.
    half_finished(tmp_path / "out-1", "shard-00002")
    reporter = ProgressLog()
    tokenize(corpus, tmp_path / "out-1", config(), reporter)
    assert reporter.calls[-1][1] == reporter.calls[-1][2] == (corpus / "part-02.jsonl").stat().st_size
    assert "resuming: 2 of 3 shards already done (records and files match this run)" in reporter.lines


SECOND_RUN = """
import sys
from blockdraft.config import load_config
from blockdraft.errors import LeaseError
from blockdraft.stages.tokenize import run
try:
    run(load_config(None, {"target": {"path": sys.argv[3]}, "tokenize": {"workers": 1}}), sys.argv[1], sys.argv[2])
except LeaseError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_second_run_on_the_same_output_is_refused_by_the_lease_while_the_first_holds_it(tmp_path):
    corpus = make_corpus(tmp_path / "in", files=2, per_file=3)
    src = str(Path(blockdraft.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}

    class SecondRunInside(Reporter):
        def __init__(self) -> None:
            super().__init__()
            self.refusal: subprocess.CompletedProcess | None = None

        def progress(self, task, completed, total=None, **fields):
            if completed and self.refusal is None:  # another process, as the lease is this process's to share
                argv = [sys.executable, "-c", SECOND_RUN, str(corpus), str(tmp_path / "out"), str(TOKENIZER_DIR)]
                self.refusal = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    reporter = SecondRunInside()
    assert tokenize(corpus, tmp_path / "out", config(), reporter).report.state is State.VERIFIED
    assert reporter.refusal is not None and reporter.refusal.returncode == 3, (
        reporter.refusal and reporter.refusal.stderr
    )
    [line] = reporter.refusal.stdout.splitlines()
    assert (
        line.startswith(f"file://{tmp_path / 'out'} is being written by pid {os.getpid()} on ")
        and "wait for it to finish" in line
    )


# Qwen3.5 / Qwen3.6 targets: the stage on multi-turn rows with the real templates, thinking on and off.
QWEN3_6_ROW = {"id": "q36", "messages": [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "reasoning_content": "Seven is prime.", "content": "7."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "reasoning_content": "Two plus three.", "content": "5"},
]}
QWEN3_6_SUPERVISED = {0: "Seven is prime.\n</think>\n\n7.<|im_end|>", 1: "Hi!<|im_end|>",
                      2: "Two plus three.\n</think>\n\n5<|im_end|>"}


def _decoded(tok, row: dict) -> tuple[str, str]:
    """(prompt text, supervised text) of a stored row; the supervised span must be one contiguous run."""
    mask = row["loss_mask"]
    first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
    assert all(mask[first : last + 1]) and not any(mask[last + 1 :])
    ids = row["input_ids"]
    return tok.decode(ids[:first], skip_special_tokens=False), tok.decode(ids[first : last + 1],
                                                                          skip_special_tokens=False)


def test_a_qwen3_6_hybrid_target_tokenizes_multi_turn_rows_with_its_own_template_exactly(tmp_path):
    target = save_qwen3_5_composite(tmp_path / "target")
    cfg = load_config(None, {"target": {"path": str(target)}, "tokenize": {"held_out_fraction": 0.0}})
    result = tokenize(str(write_jsonl(tmp_path / "in.jsonl", [QWEN3_6_ROW])), str(tmp_path / "out"), cfg)
    assert result.report.state is State.VERIFIED and result.details.counts["rejected"] == {}
    tok = AutoTokenizer.from_pretrained(target)
    run = read_manifest(open_store(tmp_path / "out"))[0].config["tokenize_run"]
    assert run["template_matches_target"] is True and run["end_of_turn_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    rows = rows_of(tmp_path / "out")["train"]
    assert [r["turn"] for r in rows] == [0, 1, 2]
    for row in rows:
        prompt, supervised = _decoded(tok, row)
        assert supervised == QWEN3_6_SUPERVISED[row["turn"]]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n" if row["turn"] != 1 else "<think>\n\n</think>\n\n")
        assert "Seven is prime." not in prompt  # dropped before a later user message, as the template does at serving


@pytest.mark.parametrize("template",
                         ["trl_qwen3_5_think", "trl_qwen3_5_nothink", "trl_qwen3_6", "trl_qwen3_6_training"])
@pytest.mark.parametrize(("thinking", "kept", "rejected"), [
    ("on", [0, 2], {"boundary_merge": 1}),  # turn 1 has empty reasoning: "<think>\n" + "\n" merge into one token
    ("off", [1], {"render_not_prefix": 2}),  # reasoning cannot follow the prompt's closed empty think block
])
def test_qwen3_5_and_3_6_templates_with_thinking_forced_on_or_off(tmp_path, template, thinking, kept, rejected):
    result = tokenize(str(write_jsonl(tmp_path / "in.jsonl", [QWEN3_6_ROW])), str(tmp_path / "out"),
                      config(str(TEMPLATES / f"{template}.jinja"), thinking=thinking, held_out_fraction=0.0))
    assert result.details.counts["rejected"] == rejected
    assert Counter(q["reason"] for q in quarantine_lines(tmp_path / "out")) == rejected
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rows = rows_of(tmp_path / "out")["train"]
    assert [r["turn"] for r in rows] == kept
    for row in rows:
        prompt, supervised = _decoded(tok, row)
        assert supervised == QWEN3_6_SUPERVISED[row["turn"]]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n" if thinking == "on" else "<think>\n\n</think>\n\n")
        assert ("Seven is prime." in prompt) == (template.endswith("_training") and row["turn"] > 0)


def test_one_worker_runs_in_this_process_unless_asked_to_spawn_it():
    src, _ = resolve_tokenizer(TargetConfig(path=str(TOKENIZER_DIR)))
    with ShardRunner(1, src) as in_process:
        assert in_process.pool is None
    with ShardRunner(1, src, spawn_one=True) as spawned:
        assert spawned.pool is not None
        assert spawned.pool.submit(os.getpid).result() != os.getpid()
