"""Tokenize at its edges, as a careless user meets them: a config that is not UTF-8 or has a section that is not a table,
a mask token id the tokenizer emits, inputs that are no regular files, an output that cannot be a folder or cannot be
written, a row too large to hold, a Parquet file without conversations. Each ends in one line and a non-zero exit, or in
a verified artifact that names what it left out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.paths import TOKENIZER_DIR
from helpers.tokenize_data import write_jsonl
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import ConfigError


def short_row(i: int, prefix: str = "r") -> dict:
    return {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def cli(*args: str | Path):
    """The CLI as a user runs it; the result with its exit code and output."""
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line(result, *words: str) -> None:
    """A non-zero exit whose output is one line holding `words`, without a traceback."""
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith("WARNING")]
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
    assert_one_line(tokenize_cli(write_jsonl(tmp_path / "in.jsonl", [short_row(0)]), tmp_path / "out", "--config", path),
                    str(path), "UTF-8")


def test_a_section_that_is_not_a_table_with_a_flag_for_it_is_one_line(tmp_path):
    path = tmp_path / "five.toml"
    path.write_text("tokenize = 5\n")
    result = tokenize_cli(write_jsonl(tmp_path / "in.jsonl", [short_row(0)]), tmp_path / "out", "--config", path, "--workers", "2")
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
    """The tokenizer a tokenize run uses may come from --tokenizer, not the config's target: checked there too."""
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
    assert_one_line(tokenize_cli(tmp_path / "pipe.jsonl", tmp_path / "out"), "pipe.jsonl", "is a FIFO (named pipe), not a regular file")
    assert_one_line(tokenize_cli(tmp_path / "zero.jsonl", tmp_path / "out"), "zero.jsonl", "is a character device, not a regular file")
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
    assert_one_line(tokenize_cli(input, "/sys/blockdraft-out"), "cannot write the output /sys/blockdraft-out", "this user can write")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder; the /sys test covers root")
def test_a_read_only_output_folder_is_one_line_naming_it(tmp_path):
    input = write_jsonl(tmp_path / "in.jsonl", [short_row(0)])
    out = tmp_path / "out"
    out.mkdir(mode=0o555)
    try:
        assert_one_line(tokenize_cli(input, out), f"cannot write the output {out}", "Permission denied")
    finally:
        out.chmod(0o755)
