"""Tokenize splits work by size, not by file, with the real Qwen3 tokenizer: one large input is cut into tasks (byte
ranges of a plain JSONL, decompressed ranges of .gz/.zst, Parquet row groups) that give exactly the rows of the unsplit
run; each task is resumable on its own; a file cut short fails whole however many tasks read it; the input is
checksummed by the tasks that read it, never by the parent first; JSON arrays are streamed; Arrow files are cut by
bytes."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers.tokenize_data import config, conversation, half_finished, piece_names, rows_of, tokenize, write_jsonl

from blockdraft.data import records
from blockdraft.data.ranges import MAX_STREAM_PARTS, ReadRange, split_file
from blockdraft.stages.tokenize.report import InputFilesFailed
from blockdraft.store import local as local_store
from blockdraft.store import open_store
from blockdraft.store.artifact import State, read_manifest, verify_artifact
from blockdraft.store.checksum import crc64nvme_file

SMALL_TASKS = 8 << 10  # bytes: a corpus of ~100 KB is cut into 16 parts


def corpus_rows(n: int = 400) -> list:
    """Conversations of varied length, with blank lines, lines that are not JSON and rows that are rejected, so that
    task boundaries land inside every kind of line."""
    rows: list = []
    for i in range(n):
        rows.append(conversation(i, turns=1 + i % 3, reasoning=i % 4 != 1))
        if i % 37 == 5:
            rows.append("")
        if i % 53 == 7:
            rows.append('{"id": "broken", "messages": [')
        if i % 61 == 11:
            rows.append({"id": f"no-assistant-{i}", "messages": [{"role": "user", "content": "hi " * (i % 40)}]})
    return rows


def quarantined(output: Path) -> list[tuple]:
    """Every quarantine line, in task order, without where it was found (a task that starts mid-file knows no line
    number)."""
    lines = [
        json.loads(line) for p in sorted((output / "quarantine").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]
    return [(q["input"], q["source_id"], q["turn"], q["reason"], q["row"]) for q in lines]


def manifest_of(output: Path):
    found = read_manifest(open_store(output))
    assert found is not None
    return found[0]


def write_format(path: Path, rows: list) -> Path:
    """JSON Lines (plain, .gz, or .zst in one streamed frame without a content size), or Parquet in row groups of 16."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".parquet"):
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_struct_array(pa.array([r for r in rows if isinstance(r, dict)])), buf,
                       row_group_size=16)
        path.write_bytes(buf.getvalue())
        return path
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
        data = compressor.compress(data) + compressor.flush()
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.gz", "big.jsonl.zst", "big.parquet"])
def test_one_large_file_cut_into_tasks_gives_the_rows_of_the_unsplit_run(tmp_path, name):
    rows = corpus_rows()
    if name.endswith(".parquet"):  # a Parquet row is an object: no blank or broken lines
        rows = [r for r in rows if isinstance(r, dict)]
    src = write_format(tmp_path / "in" / name, rows)
    whole = tokenize(src, tmp_path / "whole", config(held_out_fraction=0.2))
    split = tokenize(src, tmp_path / "split", config(held_out_fraction=0.2, task_bytes=SMALL_TASKS, workers=2))
    assert whole.details.shards_total == 1 and split.details.shards_total > 1
    assert split.report.state is State.VERIFIED
    # The same rows in the same order on the same side of the split, the same rejections, the same counts.
    assert rows_of(tmp_path / "split") == rows_of(tmp_path / "whole")
    assert quarantined(tmp_path / "split") == quarantined(tmp_path / "whole")
    counts = {k: v for k, v in split.details.counts.items() if k != "shards"}
    assert counts == {k: v for k, v in whole.details.counts.items() if k != "shards"}
    assert counts["rows_in"] == len([r for r in rows if r != ""]) and counts["input_files"] == 1
    # Every task recorded its own piece, and the lineage names the file by the checksum its tasks read together.
    assert len(piece_names(tmp_path / "split")) == split.details.shards_total
    [ref] = manifest_of(tmp_path / "split").lineage
    assert ref.checksum == crc64nvme_file(src)[1] == manifest_of(tmp_path / "whole").lineage[0].checksum


def test_a_plain_jsonl_is_cut_into_a_power_of_two_of_line_ranges_that_tile_it(tmp_path):
    src = write_format(tmp_path / "a.jsonl", corpus_rows(300))
    size = src.stat().st_size
    parts = split_file(lambda: src.open("rb"), src.name, size, SMALL_TASKS)
    assert len(parts) in (16, 32, 64) and all(p.kind == "lines" for p, _ in parts)
    assert parts[0][0].start == 0 and parts[-1][0].end == size and sum(share for _, share in parts) == size
    assert all(a.end == b.start for (a, _), (b, _) in zip(parts, parts[1:], strict=False))
    assert max(share for _, share in parts) <= SMALL_TASKS
    # A JSON array is not cut: one task streams it.
    array = tmp_path / "b.json"
    array.write_text(json.dumps([conversation(i) for i in range(300)]))
    assert split_file(lambda: array.open("rb"), array.name, array.stat().st_size, SMALL_TASKS) == [
        (ReadRange(), array.stat().st_size)
    ]
    # A compressed stream of unknown decompressed size is cut into at most MAX_STREAM_PARTS decompressed ranges.
    zst = write_format(tmp_path / "c.jsonl.zst", corpus_rows(3000))
    parts = split_file(lambda: zst.open("rb"), zst.name, zst.stat().st_size, 1024)
    assert len(parts) == MAX_STREAM_PARTS and parts[-1][0].end is None and all(p.kind == "stream" for p, _ in parts)


def test_the_parent_never_reads_an_input_before_the_tasks_do(tmp_path, monkeypatch):
    """The input is checksummed once, by the tasks that read it; a local listing reads no input bytes."""
    src = write_format(tmp_path / "in" / "big.jsonl", corpus_rows(200))
    checksummed: list[Path] = []
    real = local_store.file_checksum

    def recording(path: Path, *args, **kwargs):
        checksummed.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(local_store, "file_checksum", recording)
    result = tokenize(src, tmp_path / "out", config(task_bytes=SMALL_TASKS))
    assert result.details.shards_total > 1 and src not in checksummed
    assert manifest_of(tmp_path / "out").lineage[0].checksum == crc64nvme_file(src)[1]


@pytest.mark.fault
def test_a_rerun_of_a_half_finished_split_run_keeps_the_finished_tasks(tmp_path):
    src = write_format(tmp_path / "in" / "big.jsonl", corpus_rows())
    cfg = config(held_out_fraction=0.2, task_bytes=SMALL_TASKS)
    first = tokenize(src, tmp_path / "out", cfg)
    names = piece_names(tmp_path / "out")
    assert len(names) == first.details.shards_total > 2
    half_finished(tmp_path / "out", names[1])
    resumed = tokenize(src, tmp_path / "out", cfg)
    assert resumed.details.shards_skipped == len(names) - 1 and resumed.report.state is State.VERIFIED
    fresh = tokenize(src, tmp_path / "fresh", cfg)
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "fresh") and resumed.details.counts == fresh.details.counts


@pytest.mark.fault
def test_a_byte_changed_in_place_redoes_only_the_task_that_read_it(tmp_path):
    """A changed mtime alone does not redo a task: the bytes it read are checked against the checksum it recorded."""
    rows = corpus_rows()
    src = write_format(tmp_path / "in" / "big.jsonl", rows)
    cfg = config(task_bytes=SMALL_TASKS)
    first = tokenize(src, tmp_path / "out", cfg)
    data = bytearray(src.read_bytes())
    at = data.index(b"The answer is 300.")  # the same length, another value: one conversation's answer changes
    data[at : at + 18] = b"The answer is 301."
    src.write_bytes(bytes(data))
    again = tokenize(src, tmp_path / "out", cfg)
    assert not again.already_done and again.details.shards_skipped == first.details.shards_total - 1
    tokenize(src, tmp_path / "fresh", cfg)
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "fresh")
    assert manifest_of(tmp_path / "out").lineage[0].checksum == crc64nvme_file(src)[1]


@pytest.mark.fault
def test_a_byte_changed_past_a_parts_end_redoes_the_part_whose_last_line_holds_it(tmp_path):
    """A part reads on past its range to finish its last line: a change there is a change to that part's rows too."""
    src = write_format(tmp_path / "in" / "big.jsonl", [conversation(i, turns=2) for i in range(300)])
    cfg = config(held_out_fraction=0.0, task_bytes=SMALL_TASKS)
    first = tokenize(src, tmp_path / "out", cfg)
    data = bytearray(src.read_bytes())
    ends = [part.end for part, _ in split_file(lambda: src.open("rb"), src.name, len(data), SMALL_TASKS)[:-1]]

    def digit_past(end: int) -> int | None:
        """A digit of the line that straddles `end` (so the part before owns the line), after `end`."""
        tail = data[end : data.index(b"\n", end)]
        found = next((k for k, byte in enumerate(tail) if chr(byte).isdigit()), None)
        return None if data[end - 1 : end] == b"\n" or found is None else end + found

    at = next(a for end in ends if end is not None and (a := digit_past(end)) is not None)
    data[at : at + 1] = b"7" if data[at : at + 1] != b"7" else b"8"
    src.write_bytes(bytes(data))
    again = tokenize(src, tmp_path / "out", cfg)
    tokenize(src, tmp_path / "fresh", cfg)
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "fresh")
    # the part that owns the line, the part that holds the byte
    assert again.details.shards_skipped == first.details.shards_total - 2


@pytest.mark.slow
def test_two_workers_on_one_file_run_every_task_and_match_one_worker(tmp_path):
    src = write_format(tmp_path / "in" / "big.jsonl", corpus_rows())
    one = tokenize(src, tmp_path / "one", config(task_bytes=SMALL_TASKS, workers=1))
    two = tokenize(src, tmp_path / "two", config(task_bytes=SMALL_TASKS, workers=2))
    assert two.details.shards_total > 1 and len(two.details.worker_cpu_seconds) == two.details.shards_total
    assert sorted(piece_names(tmp_path / "two")) == sorted(piece_names(tmp_path / "one"))
    assert len(piece_names(tmp_path / "two")) == two.details.shards_total
    assert rows_of(tmp_path / "two") == rows_of(tmp_path / "one") and two.details.counts == one.details.counts


@pytest.mark.fault
def test_a_cut_zst_read_by_several_tasks_fails_that_whole_file(tmp_path):
    folder = tmp_path / "in"
    whole = write_format(tmp_path / "whole.jsonl.zst", corpus_rows(3000)).read_bytes()
    (folder / "cut.jsonl.zst").parent.mkdir(parents=True)
    (folder / "cut.jsonl.zst").write_bytes(whole[: len(whole) * 2 // 3])
    write_jsonl(folder / "good.jsonl", [conversation(i) for i in range(5)])
    with pytest.raises(InputFilesFailed, match=r"cut\.jsonl\.zst: truncated_input") as raised:
        tokenize(folder, tmp_path / "out", config(held_out_fraction=0.0, task_bytes=1024))
    result = raised.value.result
    assert result.details.shards_total > 2 and result.report.state is State.VERIFIED
    counts = result.details.counts
    assert counts["input_files_failed"] == 1 and list(counts["failed_inputs"]) == ["cut.jsonl.zst"]
    assert counts["rows_in"] == 5 and sorted(r["source_id"] for r in rows_of(tmp_path / "out")["train"]) == [
        f"c{i}" for i in range(5)
    ]
    assert counts["failed_inputs"]["cut.jsonl.zst"]["rows_read_before_failure"] > 0
    # One line names it; none of its tasks left a piece, a row file or a quarantine file.
    assert [(q[0], q[3]) for q in quarantined(tmp_path / "out")] == [("cut.jsonl.zst", "truncated_input")]
    assert all(not name.startswith("shard-00000-") for name in piece_names(tmp_path / "out"))
    listed = {f.path for f in manifest_of(tmp_path / "out").files}
    assert {p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.arrow")} <= listed | {
        "held_out/empty.arrow"
    }


def test_a_json_array_is_streamed_and_an_element_too_large_is_refused_with_a_jsonl_hint(tmp_path, monkeypatch):
    rows = [conversation(i) for i in range(40)]
    array = tmp_path / "in" / "rows.json"
    array.parent.mkdir()
    array.write_text(json.dumps(rows, indent=1))
    monkeypatch.setattr(records, "ARRAY_READ", 512)  # the array arrives in many small reads
    result = tokenize(array, tmp_path / "out", config(held_out_fraction=0.0, task_bytes=1024))
    assert result.details.shards_total == 1 and [r["source_id"] for r in rows_of(tmp_path / "out")["train"]] == [
        f"c{i}" for i in range(40)
    ]
    monkeypatch.setattr(records, "MAX_ARRAY_ELEMENT", 100)
    with pytest.raises(InputFilesFailed) as raised:
        tokenize(array, tmp_path / "refused", config(held_out_fraction=0.0))
    detail = raised.value.result.details.counts["failed_inputs"]["rows.json"]["detail"]
    assert "larger than" in detail and "JSON Lines" in detail


def test_arrow_files_are_cut_by_bytes(tmp_path):
    src = write_format(tmp_path / "in" / "a.jsonl", [conversation(i, turns=2) for i in range(300)])
    result = tokenize(src, tmp_path / "out", config(held_out_fraction=0.0, file_bytes=64 << 10))
    files = sorted((tmp_path / "out" / "train").glob("shard-*.arrow"))
    assert len(files) >= 3 and result.details.shards_total == 1
    batch_bytes = max(b.nbytes for p in files for b in pa.ipc.open_stream(p))
    assert all(p.stat().st_size < (64 << 10) + batch_bytes + 4096 for p in files)
    assert len(rows_of(tmp_path / "out")["train"]) == result.details.counts["rows_out"] == 600
    assert verify_artifact(open_store(tmp_path / "out")).state is State.VERIFIED


@pytest.mark.s3
def test_a_large_object_on_s3_is_read_in_byte_ranges_by_several_tasks(s3_bucket, s3_env, tmp_path):
    rows = corpus_rows(300)
    src = write_format(tmp_path / "local" / "big.jsonl", rows)
    s3_env.client().put_object(Bucket=s3_bucket, Key="raw/big.jsonl", Body=src.read_bytes())
    tokenize(src, tmp_path / "ref", config(held_out_fraction=0.2))
    split = tokenize(f"s3://{s3_bucket}/raw", tmp_path / "out",
                     config(held_out_fraction=0.2, task_bytes=SMALL_TASKS, workers=2))
    assert split.details.shards_total > 1 and split.report.state is State.VERIFIED
    assert rows_of(tmp_path / "out") == rows_of(tmp_path / "ref") and quarantined(tmp_path / "out") == quarantined(
        tmp_path / "ref"
    )
    [ref] = manifest_of(tmp_path / "out").lineage
    assert ref.url == f"s3://{s3_bucket}/raw/big.jsonl" and ref.etag and ref.size == src.stat().st_size
