"""`eval` on the standard prompt sets: every layout of tests/fixtures/prompt-sets read, rendered as chat with the
target's template and thinking mode, and measured per set in the report and the summary; an unknown layout is one line;
a folder `datasets` saved and a hub dataset in `datasets`' own cache (offline) read the same way."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers.paths import FIXTURES
from helpers.tiny_run import make_tiny_run, tiny_config, write_config
from transformers import AutoTokenizer
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.errors import EvalError
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.eval import EvalReport
from blockdraft.stages.eval.prompts import read_eval_prompts
from blockdraft.store import open_store
from blockdraft.store.artifact import State, verify_artifact

SETS = FIXTURES / "prompt-sets"
LAYOUT_FILES = {  # file -> the layout it is recognised as
    "gsm8k.parquet": "gsm8k", "math500.jsonl": "math500", "humaneval.jsonl": "humaneval", "mbpp.parquet": "mbpp",
    "mt_bench.jsonl": "mt_bench", "alpaca.jsonl": "alpaca", "plain.jsonl": "plain",
}
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("tiny-run"))


def test_eval_on_every_layout_reports_each_set_and_prints_one_line_per_set(tmp_path, tiny_run):
    config = write_config(tmp_path, tiny_config(tmp_path, tokenize={"thinking": "off"}))
    prompts = [arg for name in LAYOUT_FILES for arg in ("--prompts", str(SETS / name))]
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(tiny_run), *prompts,
                                      "--max-new-tokens", "6", "--output", str(out), "--set",
                                      "eval.untrained_baseline=false"])
    assert result.exit_code == 0, result.output
    report = EvalReport.from_json((out / "report.json").read_text())
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    assert list(report.prompt_sets) == list(LAYOUT_FILES.values())  # named by layout, in the order given
    assert report.prompts_source == [str(SETS / name) for name in LAYOUT_FILES]
    assert report.num_prompts == 2 * len(LAYOUT_FILES)
    lines = [line for line in result.output.splitlines() if line.startswith("set ")]
    assert len(lines) == len(LAYOUT_FILES)
    for (name, layout), line in zip(LAYOUT_FILES.items(), lines, strict=True):
        figures = report.prompt_sets[layout]
        assert figures.layout == layout and figures.source == str(SETS / name) and figures.num_prompts == 2
        rows = [row for row in report.prompts if row.prompt_set == layout]
        cycles = [n for row in rows for n in row.model_extra["acceptance_lengths_dflash"]]
        dflash = figures.drafters["dflash"]
        assert dflash.tau == pytest.approx(sum(cycles) / len(cycles)) and dflash.cycles == len(cycles)
        assert dflash.position_acceptance[0] == pytest.approx(sum(n >= 2 for n in cycles) / len(cycles))
        assert dflash.speedup == pytest.approx(figures.greedy.wall_s / dflash.wall_s)
        assert set(figures.drafters) == {"dflash", "ngram"} and figures.lossless
        assert line.startswith(f"set {layout}\t{layout}, 2 prompt(s)\ttau {dflash.tau:.3f}\tspeedup "
                               f"{dflash.speedup:.2f}x")
    # Over every prompt: the cycles of all sets together.
    everything = [n for row in report.prompts for n in row.model_extra["acceptance_lengths_dflash"]]
    assert report.drafters["dflash"].tau == pytest.approx(sum(everything) / len(everything))

    # Each row became a user turn rendered with the target's template, thinking off as configured.
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET_DIR)
    chat = [{"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples does she have?"}]
    off = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False), add_special_tokens=False)["input_ids"]
    default = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
    assert len(off) != len(default)  # the thinking mode changes the prompt, so the check below can tell them apart
    assert report.prompts[0].prompt_set == "gsm8k" and report.prompts[0].prompt_len == len(off)
    alpaca = [row for row in report.prompts if row.prompt_set == "alpaca"][1]  # instruction and input, one turn
    turn = [{"role": "user", "content": "Translate the sentence into French.\n\nThe cat sleeps."}]
    text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert alpaca.prompt_len == len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_file_of_an_unknown_layout_is_one_line_naming_its_columns_and_the_layouts_known(tmp_path, tiny_run):
    config = write_config(tmp_path, tiny_config(tmp_path))
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(tiny_run),
                                      "--prompts", str(SETS / "unknown.jsonl")])
    assert result.exit_code != 0
    (line,) = result.output.strip().splitlines()
    assert "columns ['label', 'query']" in line
    for known in ("gsm8k (question)", "math500 (problem)", "humaneval (prompt)", "mbpp (text)", "mt_bench (turns)",
                  "alpaca (instruction)", "plain (input_ids/messages/prompt)"):
        assert known in line


def test_a_named_layout_is_checked_against_the_columns_and_pairs_with_its_file(tmp_path):
    cfg = load_config(None, tiny_config(tmp_path, eval={"num_prompts": 1}))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET_DIR)
    named = read_eval_prompts([str(SETS / "math500.jsonl"), str(SETS / "gsm8k.parquet")], cfg, tokenizer, tmp_path,
                              ["auto", "gsm8k"])
    assert [(s.name, s.layout, len(s.ids)) for s in named.sets] == [("math500", "math500", 1), ("gsm8k", "gsm8k", 1)]
    twice = read_eval_prompts([str(SETS / "gsm8k.parquet")] * 2, cfg, tokenizer, tmp_path)
    assert [s.name for s in twice.sets] == ["gsm8k", "gsm8k-2"] and twice.sets[0].ids == twice.sets[1].ids
    with pytest.raises(EvalError, match=r"has columns \[.*'question'.*\], not the mbpp \(text\) of the mbpp layout"):
        read_eval_prompts([str(SETS / "gsm8k.parquet")], cfg, tokenizer, tmp_path, ["mbpp"])
    with pytest.raises(EvalError, match="1 prompt set name.* for 2 prompts source"):
        read_eval_prompts([str(SETS / "gsm8k.parquet")] * 2, cfg, tokenizer, tmp_path, ["gsm8k"])
    with pytest.raises(EvalError, match="'squad' is not one eval knows"):
        read_eval_prompts([str(SETS / "gsm8k.parquet")], cfg, tokenizer, tmp_path, ["squad"])


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SETS / name).read_text().splitlines()]


def test_a_folder_datasets_saved_and_a_hub_dataset_in_its_cache_read_offline(tmp_path, monkeypatch):
    """`save_to_disk`'s layout is read with `load_from_disk`; `hf://datasets/NAME` goes through `load_dataset`, here
    offline from the cache layout `load_dataset` itself writes for a hub dataset (the hub is never reached)."""
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    cfg = load_config(None, tiny_config(tmp_path, eval={"num_prompts": 5}))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET_DIR)
    by_file = read_eval_prompts([str(SETS / "mt_bench.jsonl")], cfg, tokenizer, tmp_path / "a").sets[0]

    saved = tmp_path / "mt_bench_saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows("mt_bench.jsonl"))}).save_to_disk(str(saved))
    from_disk = read_eval_prompts([str(saved)], cfg, tokenizer, tmp_path / "b").sets[0]
    assert (from_disk.layout, from_disk.ids) == ("mt_bench", by_file.ids)
    assert from_disk.ref.kind == "folder" and len(from_disk.ref.sha256 or "") == 64  # by its files

    # The cache load_dataset keeps for a hub dataset: CACHE/OWNER___NAME/CONFIG/VERSION/HASH with its Arrow files.
    cache = tmp_path / "hf-cache"
    source = tmp_path / "mt_bench.parquet"
    datasets.Dataset.from_list(_rows("mt_bench.jsonl")).to_parquet(str(source))
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    builder = Parquet(cache_dir=str(cache), dataset_name="mt_bench_prompts", config_name="default", hash="0123abcd",
                      data_files=DataFilesDict.from_patterns({"train": [str(source)]}))
    builder.download_and_prepare()
    (built,) = [p for p in (cache / "mt_bench_prompts").iterdir() if p.is_dir()]
    built.rename(built.with_name("default"))  # the config's folder as a hub dataset's config names it
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    hub = read_eval_prompts(["hf://datasets/mt_bench_prompts?split=train"], cfg, tokenizer, tmp_path / "c").sets[0]
    assert (hub.layout, hub.ids, hub.ref.url) == ("mt_bench", by_file.ids, "hf://datasets/mt_bench_prompts?split=train")
    with pytest.raises(EvalError, match="does not load through datasets"):
        read_eval_prompts(["hf://datasets/no-such-set"], cfg, tokenizer, tmp_path / "d")
