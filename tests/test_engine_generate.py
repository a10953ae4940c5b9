"""`generate --engine openai` against vLLM serving the tiny target (`make engine`): the completions carry the engine's
own token ids, and `tokenize` trains on exactly those ids."""

from __future__ import annotations

import datasets
import pytest
from helpers.engine import ENGINE_PYTHON, needs_engine, write_config
from helpers.generate_data import output_rows
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.stages.eval.engine import SERVED_NAME, free_argv, serving

pytestmark = [needs_engine, pytest.mark.slow, pytest.mark.engine]
NEW_TOKENS = 200  # long enough that every answer closes its <think> block (a cut one is quarantined)


def test_generate_against_vllm_keeps_the_engines_token_ids_through_tokenize(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((TINY_TARGET_DIR / "prompts.jsonl").read_text().splitlines(keepends=True)[:6]))
    sections = {"target": {"path": str(TINY_TARGET_DIR)}, "store": {"url": str(tmp_path / "store")},
                "tokenize": {"held_out_fraction": 0.0}, "eval": {"engine": "vllm", "engine_python": str(ENGINE_PYTHON)},
                "generate": {"max_new_tokens": NEW_TOKENS, "concurrency": 2}}
    config = write_config(tmp_path, sections)
    cfg = load_config(config)
    argv = free_argv(ENGINE_PYTHON, "vllm", str(TINY_TARGET_DIR), "float32", 1024, None, [])
    with serving(argv, tmp_path, "generate", cfg.eval) as server:
        result = CliRunner().invoke(app, ["generate", str(prompts), str(tmp_path / "completions"), "--config",
                                          str(config), "--engine", "openai", "--base-url", f"{server.url}/v1",
                                          "--model", SERVED_NAME])
        assert result.exit_code == 0, result.output
        rows = output_rows(tmp_path / "completions")
        assert len(rows) == 6 and all(r["prompt_token_ids"] and r["completion_token_ids"] for r in rows)
        # The ids are the engine's: the same prompt ids sent as a plain completion come back with the same completion.
        for row in rows:
            answer = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": row["prompt_token_ids"],
                                                     "max_tokens": NEW_TOKENS, "temperature": 0.0,
                                                     "return_token_ids": True, "skip_special_tokens": False})
            assert answer["choices"][0]["token_ids"] == row["completion_token_ids"]

    tokenized = CliRunner().invoke(app, ["tokenize", str(tmp_path / "completions"), str(tmp_path / "tokenized"),
                                         "--config", str(config)])
    assert tokenized.exit_code == 0, tokenized.output
    trained_on = {tuple(r["input_ids"]) for r in datasets.load_from_disk(str(tmp_path / "tokenized"))["train"]}
    assert len(trained_on) == 6 and trained_on == {tuple(r["prompt_token_ids"] + r["completion_token_ids"])
                                                   for r in rows}
