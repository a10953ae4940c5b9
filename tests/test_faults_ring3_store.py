"""Third ring of faults, the store and data side: nothing written where it does not belong (a planted link in a working
folder, a demo folder or a progress page holding someone else's files), a suspended writer that comes back after its lease
was taken over, a row nested deeper than Python recurses, and the messages that named the wrong cause."""

from __future__ import annotations

import json

import pytest
from helpers.tokenize_data import config, conversation, rows_of, tokenize, write_jsonl

from blockdraft.config import load_config
from blockdraft.errors import BlockdraftError
from blockdraft.stages.eval.prompts import prompts_from_jsonl
from blockdraft.store.ownership import WRITING_NAME

DEEP = 50_000


def deep_rows() -> list[str]:
    """An array and an object each nested `DEEP` levels: valid JSON no recursive parser can hold."""
    return ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_row_nested_50000_deep_is_quarantined_as_bad_json_and_the_run_goes_on(tmp_path, workers):
    rows = [json.dumps(conversation(0)), *deep_rows(), json.dumps(conversation(1))]
    source = write_jsonl(tmp_path / "in" / "deep.jsonl", rows)
    (tmp_path / "in" / "deep-array.json").write_text("[" + ",".join([json.dumps(conversation(2)), *deep_rows()]) + "]")
    out = tmp_path / "out"
    result = tokenize(source.parent, out, config(held_out_fraction=0.0, workers=workers))
    counts = result.details.counts
    assert counts["input_files_failed"] == 0 and counts["rejected"] == {"bad_json": 4}, counts
    assert sorted(r["source_id"] for r in rows_of(out)["train"]) == ["c0", "c1", "c2"]
    assert not (out / WRITING_NAME).exists()


def test_eval_prompts_nested_50000_deep_are_one_line_naming_the_row(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + deep_rows()[1] + "\n")
    with pytest.raises(BlockdraftError, match="prompts.jsonl line 2 is not valid JSON"):
        prompts_from_jsonl(prompts, None, load_config(None, {}), 10)
