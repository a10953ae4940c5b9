"""Tokenize at its edges, as a careless user meets them: a config that is not UTF-8 or has a section that is not a
table, a mask token id the tokenizer emits, inputs that are no regular files, an output that cannot be a folder or
cannot be written, a row too large to hold, a Parquet file without conversations. Each ends in one line and a non-zero
exit, or in a verified artifact that names what it left out."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import TOKENIZER_DIR
from helpers.tokenize_data import config, half_finished, piece_names, rows_of, tokenize, write_jsonl
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.data.records import HEAD_BYTES, bounded_lines
from blockdraft.errors import ConfigError
from blockdraft.stages.tokenize.report import InputFilesFailed
from blockdraft.store import open_store
from blockdraft.store.artifact import State, read_manifest, verify_artifact


def short_row(i: int, prefix: str = "r") -> dict:
    return {"id": f"{prefix}{i}",
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def cli(*args: str | Path):
    """The CLI as a user runs it; the result with its exit code and output."""
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line(result, *words: str) -> None:
    """A non-zero exit whose output is one line holding `words`, without a traceback (besides warnings and the start
    line of a run that got to tokenize, which says its plan)."""
    start = re.compile(r"tokenize: \d+ tasks of about ")
    lines = [
        line
        for line in result.output.splitlines()
        if line.strip() and not line.startswith("WARNING") and not start.match(line)
    ]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert all(w in lines[0] for w in words), result.output


def tokenize_cli(input: Path | str, output: Path | str, *extra: str | Path):
    return cli("tokenize", input, output, "--tokenizer", TOKENIZER_DIR, "--held-out-fraction", "0", *extra)


# ---- config ----


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[tokenize]\nworkers = 1\n# café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 28\); save it as UTF-8"):
        load_config(path)
    assert_one_line(
        tokenize_cli(write_jsonl(tmp_path / "in.jsonl", [short_row(0)]), tmp_path / "out", "--config", path),
        str(path), "UTF-8")


def test_a_section_that_is_not_a_table_with_a_flag_for_it_is_one_line(tmp_path):
    path = tmp_path / "five.toml"
    path.write_text("tokenize = 5\n")
    result = tokenize_cli(write_jsonl(tmp_path / "in.jsonl", [short_row(0)]), tmp_path / "out", "--config", path,
                          "--workers", "2")
    assert_one_line(result, "'tokenize' is a int, not a table", "[tokenize]")
    with pytest.raises(ConfigError, match="'tokenize'"):  # without a flag, the field check names it
        load_config(path)


@pytest.mark.parametrize(("mask", "token"), [(151645, "<|im_end|>"), (151667, "<think>")])
def test_a_mask_token_id_the_tokenizer_emits_is_refused_at_config_load(tmp_path, mask, token):
    path = tmp_path / "c.toml"
    path.write_text(f'[target]\npath = "{TOKENIZER_DIR.as_posix()}"\n[dflash]\nmask_token_id = {mask}\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    assert "\n" not in message and f"mask_token_id {mask}" in message and token in message and "151669" in message
    path.write_text(f'[target]\npath = "{TOKENIZER_DIR.as_posix()}"\n[dflash]\nmask_token_id = 151669\n')
    assert load_config(path).dflash.mask_token_id == 151669  # the first id after the added tokens: reserved


def test_a_mask_token_id_of_the_tokenizer_given_with_tokenizer_is_refused_before_any_row(tmp_path):
    """`--tokenizer` spells target.tokenizer: the mask id is checked against that tokenizer too."""
    path = tmp_path / "c.toml"
    path.write_text("[dflash]\nmask_token_id = 151645\n")
    out = tmp_path / "out"
    assert_one_line(tokenize_cli(write_jsonl(tmp_path / "in.jsonl", [short_row(0)]), out, "--config", path),
                    "mask_token_id 151645", "<|im_end|>")
    assert not out.exists()


# ---- inputs that are no regular files ----


def test_a_fifo_or_a_symlink_to_dev_zero_as_input_is_one_line_naming_it_never_a_hang(tmp_path):
    """Reading a FIFO waits for a writer forever; /dev/zero never ends. Either is refused when the inputs are listed."""
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    assert_one_line(tokenize_cli(tmp_path / "pipe.jsonl", tmp_path / "out"), "pipe.jsonl",
                    "is a FIFO (named pipe), not a regular file")
    assert_one_line(tokenize_cli(tmp_path / "zero.jsonl", tmp_path / "out"), "zero.jsonl",
                    "is a character device, not a regular file")
    folder = tmp_path / "in"
    write_jsonl(folder / "good.jsonl", [short_row(0)])
    os.mkfifo(folder / "pipe.jsonl")
    assert_one_line(tokenize_cli(folder, tmp_path / "out"), str(folder / "pipe.jsonl"), "FIFO")
    assert not (tmp_path / "out").exists()


# ---- outputs that cannot be written ----


def test_an_output_path_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("the user's notes\n")
    input = write_jsonl(tmp_path / "in.jsonl", [short_row(0)])
    assert_one_line(tokenize_cli(input, out), str(out), "is a file, not a folder")
    assert out.read_text() == "the user's notes\n"
    assert_one_line(tokenize_cli(input, out / "below"), str(out / "below"), "Not a directory")


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs /sys: a folder even root cannot write into")
def test_an_output_the_system_refuses_to_write_is_one_line_naming_it(tmp_path):
    """/sys refuses new folders even to root (tests run as root, where a chmod 0o555 folder stays writable)."""
    input = write_jsonl(tmp_path / "in.jsonl", [short_row(0)])
    assert_one_line(tokenize_cli(input, "/sys/blockdraft-out"), "cannot write the output /sys/blockdraft-out",
                    "this user can write")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder; the /sys test covers root")
def test_a_read_only_output_folder_is_one_line_naming_it(tmp_path):
    input = write_jsonl(tmp_path / "in.jsonl", [short_row(0)])
    out = tmp_path / "out"
    out.mkdir(mode=0o555)
    try:
        assert_one_line(tokenize_cli(input, out), f"cannot write the output {out}", "Permission denied")
    finally:
        out.chmod(0o755)


# ---- rows too large to hold ----


def big_row(nbytes: int) -> dict:
    """A conversation of about `nbytes` bytes that compresses little (so a compressed file of it is cut into parts
    too)."""
    text = base64.b64encode(random.Random(0).randbytes(nbytes * 3 // 4)).decode()
    return {"id": "big", "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}


class Endless(io.RawIOBase):
    """`size` bytes of one line without a newline, made as they are read: no test holds them."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = b"x" * n
        self.left -= n
        return n


def test_a_line_longer_than_the_bound_is_skipped_in_bounded_memory():
    limit, size = 1 << 20, 48 << 20
    buffered = io.BufferedReader(Endless(size), buffer_size=1 << 20)
    tracemalloc.start()
    try:
        lines = list(bounded_lines(buffered, limit))  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(line.size, line.oversize, len(line.data)) for line in lines] == [(size, size, HEAD_BYTES)]
    assert peak < 4 * limit, f"peak {peak:,} bytes for a {size:,}-byte line with a {limit:,}-byte bound"


def row_too_large_lines(out: Path) -> list[dict]:
    lines = [
        json.loads(line) for p in sorted((out / "quarantine").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]
    assert all(len(json.dumps(q)) < 4096 for q in lines), "the quarantine holds the start of a large row only"
    return [q for q in lines if q["reason"] == "row_too_large"]


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz", "in.jsonl.zst"])
def test_a_row_over_max_row_bytes_is_quarantined_counted_and_the_others_tokenized(tmp_path, name):
    rows = [short_row(0), big_row(3 << 20), short_row(1), short_row(2)]
    input = write_jsonl(tmp_path / name, rows)
    out = tmp_path / "out"
    result = tokenize(input, out, config(held_out_fraction=0.0, max_row_bytes=1 << 20))
    counts = result.details.counts
    assert result.report.state is State.VERIFIED and counts["input_files_failed"] == 0
    assert counts["rows_in"] == 4 and counts["rows_out"] == 3 and counts["rejected"] == {"row_too_large": 1}
    assert sorted(r["source_id"] for r in rows_of(out)["train"]) == ["r0", "r1", "r2"]
    [line] = row_too_large_lines(out)
    assert line["position"] == 2 and "max_row_bytes" in line["detail"] and line["row"].startswith('{"id": "big"')
    assert f"{len(json.dumps(rows[1])):,} bytes" in line["detail"]
    result = cli("tokenize", input, tmp_path / "cli-out", "--tokenizer", TOKENIZER_DIR, "--config",
                 config_file(tmp_path, 1 << 20))
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output  # as for every rejected row


def config_file(tmp_path: Path, max_row_bytes: int) -> Path:
    path = tmp_path / "rows.toml"
    path.write_text(f"[tokenize]\nmax_row_bytes = {max_row_bytes}\nheld_out_fraction = 0.0\n")
    return path


@pytest.mark.parametrize("name", ["cut.jsonl", "cut.jsonl.gz"])
def test_a_large_row_across_the_cuts_of_a_split_file_is_quarantined_once_and_the_run_resumes(tmp_path, name):
    """A file cut into parts: the large row spans several; the part it starts in drops it, the others skip its bytes,
    and the parts' checksums still make the file's (the output verifies, a rerun is done, a resume keeps the shards)."""
    rows = [short_row(i) for i in range(200)] + [big_row(3 << 20)] + [short_row(i, "s") for i in range(200)]
    input = write_jsonl(tmp_path / name, rows)
    out = tmp_path / "out"
    cfg = config(held_out_fraction=0.0, max_row_bytes=1 << 20, task_bytes=1 << 20)
    result = tokenize(input, out, cfg)
    assert result.details.shards_total > 1 and result.report.state is State.VERIFIED
    assert result.details.counts["rejected"] == {"row_too_large": 1} and result.details.counts["rows_out"] == 400
    assert len(row_too_large_lines(out)) == 1
    # the lineage's checksum is the file's
    assert verify_artifact(open_store(out), check_inputs=True).state is State.VERIFIED
    assert tokenize(input, out, cfg).already_done
    first = piece_names(out)[0]
    half_finished(out, first)
    resumed = tokenize(input, out, cfg)
    assert resumed.report.state is State.VERIFIED and resumed.details.shards_skipped == result.details.shards_total - 1
    assert resumed.details.counts == result.details.counts


def test_a_parquet_row_over_max_row_bytes_is_quarantined_without_the_others_lost(tmp_path):
    rows = [short_row(0), big_row(3 << 20), short_row(1)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / "out"
    result = tokenize(path, out, config(held_out_fraction=0.0, max_row_bytes=1 << 20))
    assert result.details.counts["rejected"] == {"row_too_large": 1} and result.details.counts["rows_out"] == 2
    [line] = row_too_large_lines(out)
    assert line["position"] == 2 and line["row"].startswith("(a Parquet row of ")


# ---- Parquet of another schema ----


def test_a_parquet_file_without_conversation_columns_is_a_failed_input_named_in_the_manifest(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": f"plain text {i}", "label": i} for i in range(5)]),
                   folder / "texts.parquet")
    # Large enough to be cut into row-group parts at task_bytes 1024: each part refuses it.
    pq.write_table(pa.Table.from_pylist([{"prompt": f"question {i} " * 20} for i in range(400)]),
                   folder / "prompts.parquet", row_group_size=50)
    pq.write_table(pa.Table.from_pylist([short_row(i) for i in range(3)]), folder / "good.parquet")
    out = tmp_path / "out"
    with pytest.raises(InputFilesFailed) as raised:
        tokenize(folder, out, config(held_out_fraction=0.0, task_bytes=1024))
    assert raised.value.result.details.shards_total > 3
    found = read_manifest(open_store(out))
    assert found is not None
    failed = found[0].counts["failed_inputs"]
    assert (sorted(failed) == ["prompts.parquet", "texts.parquet"]
            and {f["reason"] for f in failed.values()} == {"wrong_schema"})
    assert "(text, label)" in failed["texts.parquet"]["detail"] and "'messages'" in failed["texts.parquet"]["detail"]
    assert found[0].counts["rows_out"] == 3 and verify_artifact(open_store(out)).state is State.VERIFIED
    (folder / "prompts.parquet").unlink()
    assert_one_line(tokenize_cli(folder, tmp_path / "cli-out"), "texts.parquet: wrong_schema")
