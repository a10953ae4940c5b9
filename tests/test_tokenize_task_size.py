"""Tokenize sizes its tasks for its workers, with the real Qwen3 tokenizer and real files: about 4 tasks a worker over
all the input bytes, never more than `tokenize.task_bytes` a task and never less than `tokenize.min_task_bytes`, so one
large file keeps every worker busy and a small one stays whole; the rows and their order are the same for any number of
workers, and a resume with another number of workers cuts the input as the run it resumes did and keeps its finished
tasks."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.tokenize_data import config, conversation, half_finished, piece_names, rows_of, tokenize, write_jsonl

from blockdraft.data.inputs import list_inputs
from blockdraft.reporter import Reporter
from blockdraft.stages.tokenize import tasks

# A scaled-down large file: ~160 KB cut with task sizes in KiB behaves as 40 MB does with the defaults (16 MiB, 1 MiB).
SMALL = {"task_bytes": 64 << 10, "min_task_bytes": 4 << 10}


def big_file(folder: Path, n: int = 400) -> Path:
    return write_jsonl(folder / "big.jsonl", [conversation(i, turns=1 + i % 3, reasoning=i % 4 != 1) for i in range(n)])


def plan(folder: Path, workers: int, **tokenize) -> tuple[int, list]:
    """(task size, tasks) the stage plans for `folder` with `workers` and these [tokenize] values."""
    opts = config(workers=workers, **tokenize).tokenize
    store, files, _ = list_inputs(str(folder), None)
    size = tasks.task_size(sum(f.size for f in files), workers, opts.task_bytes, opts.min_task_bytes)
    return size, tasks.plan_tasks(store, files, size)


def test_one_40_mb_file_is_cut_into_several_tasks_per_worker_within_task_bytes(tmp_path):
    line = json.dumps(conversation(7, turns=3)) + "\n"
    src = tmp_path / "in" / "big.jsonl"
    src.parent.mkdir()
    src.write_text(line * (40_000_000 // len(line)))  # about 40 MB, as in the issue; only planned, never tokenized
    default = config().tokenize
    size, two = plan(src.parent, workers=2)
    assert len(two) >= 2 * 2 and all(t.share <= size <= default.task_bytes for t in two)
    size, one = plan(src.parent, workers=1)
    assert 2 <= len(one) < len(two) and all(t.share <= size <= default.task_bytes for t in one)
    _, many = plan(src.parent, workers=64)  # more workers than 1 MiB tasks: the floor holds
    assert (
        all(t.share >= default.min_task_bytes // 2 for t in many)
        and len(many) <= src.stat().st_size // default.min_task_bytes * 2
    )


def test_same_rows_in_the_same_order_with_one_or_two_workers(tmp_path):
    src = big_file(tmp_path / "in")
    one_lines, two_lines = Reporter(), Reporter()
    one = tokenize(src, tmp_path / "one", config(workers=1, **SMALL), one_lines)
    two = tokenize(src, tmp_path / "two", config(workers=2, **SMALL), two_lines)
    # The same file, cut for each run's workers: at least 2 tasks a worker, none above task_bytes.
    assert two.details.shards_total >= 2 * 2 and two.details.shards_total > one.details.shards_total >= 2
    assert src.stat().st_size / one.details.shards_total <= SMALL["task_bytes"]
    assert len(piece_names(tmp_path / "two")) == two.details.shards_total
    assert rows_of(tmp_path / "two") == rows_of(tmp_path / "one")
    without_shards = [{k: v for k, v in r.details.counts.items() if k != "shards"} for r in (one, two)]
    assert without_shards[0] == without_shards[1]
    assert (
        f"tokenize: {two.details.shards_total} tasks of about 20 KiB for 2 workers (task size 20 KiB)"
        in two_lines.lines
    )
    assert any(line.startswith(f"tokenize: {one.details.shards_total} tasks of about") for line in one_lines.lines)


def test_an_input_under_the_floor_stays_one_task(tmp_path):
    src = big_file(tmp_path / "in", n=60)  # ~25 KB: 2 workers would want tasks of ~3 KB
    assert src.stat().st_size < 32 << 10
    result = tokenize(src, tmp_path / "out", config(workers=2, task_bytes=64 << 10, min_task_bytes=32 << 10))
    assert result.details.shards_total == 1 and piece_names(tmp_path / "out") == ["shard-00000"]


def test_a_resume_with_another_worker_count_keeps_the_finished_tasks(tmp_path):
    src = big_file(tmp_path / "in")
    out = tmp_path / "out"
    first = tokenize(src, out, config(workers=1, **SMALL))
    assert first.details.shards_total == 4
    uninterrupted = rows_of(out)
    half_finished(out, "shard-00000-0002")  # killed before its third task finished
    reporter = Reporter()
    again = tokenize(src, out, config(workers=2, **SMALL), reporter)
    assert again.details.shards_skipped == 3 and again.details.shards_total == 4
    assert "resuming: 3 of 4 shards already done (records and files match this run)" in reporter.lines
    assert any(
        "the size the finished shards of the run it resumes were cut with, to keep them" in line
        for line in reporter.lines
    )
    assert rows_of(out) == uninterrupted

    # Pieces no cut of this run matches (another config here) are said to be redone, and the input is cut for 2 workers.
    reporter = Reporter()
    other = tokenize(src, out, config(workers=2, held_out_fraction=0.2, **SMALL), reporter)
    assert other.details.shards_total == 8 and other.details.shards_skipped == 0
    assert any(
        line.startswith("redoing the input of 4 finished shards that do not match this run") for line in reporter.lines
    )
