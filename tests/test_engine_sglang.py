"""`eval --engine sglang` without SGLang: its command line, its requests, the speculative counts read from its answers,
the comparison when it gives only a total, and the one line when the engine's Python has no sglang. SGLang itself has
not run in this project's CI (its CPU build needs sgl-kernel built from source); bench/gpu_check.sh runs it on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import EvalConfig, load_config
from blockdraft.errors import ConfigError, EngineError
from blockdraft.reporter import SilentReporter
from blockdraft.stages.eval.engine import ServedRun
from blockdraft.stages.eval.engine_check import compare, ours
from blockdraft.stages.eval.engine_sglang import generate_sglang, sglang_argv, sglang_spec, spec_counts
from blockdraft.stages.eval.metrics import GreedyMetrics
from blockdraft.stages.eval.report import EvalReport, Lossless, PromptRow
from blockdraft.stages.export.stage import serving_settings

# One `/generate` answer with a drafter, in SGLang's format: written here from the fields SGLang's tokenizer manager
# sets for a finished speculative request (`fill_spec_decoding_meta`), not captured from a server. Block size 4 (3
# drafted tokens): 6 verify passes accepting 0, 0, 1, 3, 3, 3 drafts, so 1 + 6 + 10 = 17 tokens with the prefill's.
SGLANG_ANSWER = {
    "text": "",
    "output_ids": list(range(100, 117)),
    "meta_info": {
        "id": "0", "finish_reason": {"type": "length", "length": 17}, "prompt_tokens": 5, "completion_tokens": 17,
        "cached_tokens": 0, "e2e_latency": 0.05, "spec_verify_ct": 6, "spec_num_correct_drafts": 10,
        "spec_num_proposed_drafts": 18, "spec_accepted_drafts": 10, "spec_proposed_drafts": 18,
        "spec_accept_rate": 10 / 18, "spec_accept_length": 17 / 6,
        "spec_correct_drafts_histogram": [2, 1, 0, 3], "spec_accept_histogram": [2, 1, 0, 3],
    },
}
GREEDY = GreedyMetrics(new_tokens=0, target_forwards=0, target_forwards_per_token=0.0, wall_s=1.0, tokens_per_s=0.0,
                       min_margin=None)


def test_the_config_takes_sglang_and_refuses_an_engine_it_does_not_run():
    assert load_config(None, {"eval": {"engine": "sglang"}}).eval.engine == "sglang"
    with pytest.raises(ConfigError, match="engine"):
        load_config(None, {"eval": {"engine": "tgi"}})


def test_the_server_runs_the_exports_sglang_args_with_the_draft_model_pointed_at_the_folder_served(tmp_path):
    serving = serving_settings("s3://bucket/run/export", 8, "org/target", "bfloat16")  # users would pull it to ./export
    spec = sglang_spec(serving, tmp_path / "export")
    assert spec == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                    str((tmp_path / "export").absolute()), "--speculative-num-draft-tokens", "8"]
    drafter = sglang_argv(Path("/env/bin/python"), "org/target", 4321, "bfloat16", 300, spec,
                          ["--attention-backend", "triton"])
    assert drafter[:5] == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", "org/target"]
    assert drafter[drafter.index("--port") + 1] == "4321" and drafter[drafter.index("--host") + 1] == "127.0.0.1"
    assert drafter[drafter.index("--dtype") + 1] == "bfloat16" and drafter.count("--dtype") == 1
    assert drafter[drafter.index("--context-length") + 1] == "300"
    assert drafter[-2:] == ["--attention-backend", "triton"] and drafter[-8:-2] == spec
    target_only = sglang_argv(Path("/env/bin/python"), "org/target", 4321, "bfloat16", None, None, [])
    assert "DFLASH" not in target_only and "--context-length" not in target_only


def test_an_export_without_sglang_args_is_one_line_naming_export(tmp_path):
    with pytest.raises(EngineError,
                       match="no sglang_args naming --speculative-draft-model-path; export the checkpoint again"):
        sglang_spec({"sglang_args": "--dtype float32"}, tmp_path)


def test_counts_per_draft_position_come_from_sglangs_histogram():
    drafts, accepted, per_position = spec_counts(SGLANG_ANSWER["meta_info"], 3)
    assert (drafts, accepted, per_position) == (6, 10, [4, 3, 3])  # position k: passes that accepted k drafts or more
    assert per_position is not None and sum(per_position) == accepted
    older = {k: v for k, v in SGLANG_ANSWER["meta_info"].items() if k != "spec_correct_drafts_histogram"}
    assert spec_counts(older, 3) == (6, 10, [4, 3, 3])  # older releases name it spec_accept_histogram only


def test_without_a_histogram_only_the_total_is_read():
    meta = {k: v for k, v in SGLANG_ANSWER["meta_info"].items() if "histogram" not in k}
    assert spec_counts(meta, 3) == (6, 10, None)
    bare = {"completion_tokens": 17, "spec_verify_ct": 6}  # what SGLang's accept length is computed from
    assert spec_counts(bare, 3) == (6, 10, None)
    assert spec_counts({"completion_tokens": 17}, 3) == (0, 0, None)  # target-only: no speculative fields


class _Answers:
    """Stands in for a `Server`: records each request body and answers with `answer`."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer, self.bodies = answer, []

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/generate"
        self.bodies.append(body)
        return self.answer


def test_prompts_go_in_as_token_ids_greedy_and_the_counts_are_summed_over_them_not_the_warm_up():
    server = _Answers(SGLANG_ANSWER)
    run = generate_sglang(server, [[1, 2, 3], [4, 5]], 17, [7], 3, SilentReporter(),  # type: ignore[arg-type]
                          "engine drafter", "sglang 0.0")
    assert server.bodies[1] == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 17, "temperature": 0.0,
                                                                            "stop_token_ids": [7],
                                                                            "skip_special_tokens": False}}
    # warm-up, then each prompt
    assert server.bodies[0]["sampling_params"]["max_new_tokens"] == 2 and len(server.bodies) == 3
    assert run.outputs == [list(range(100, 117))] * 2 and run.version == "sglang 0.0"
    assert (run.drafts, run.accepted_per_position, run.accepted) == (12, [8, 6, 6], 20)
    totals = {**SGLANG_ANSWER, "meta_info": {"completion_tokens": 17, "spec_verify_ct": 6}}
    tau_only = generate_sglang(_Answers(totals), [[1, 2, 3]], 17, [7], 3, SilentReporter(),  # type: ignore[arg-type]
                               "engine drafter", "")
    assert (tau_only.drafts, tau_only.accepted_per_position, tau_only.accepted) == (6, [], 10)


def _report(lengths: list[list[int]]) -> EvalReport:
    rows = [
        PromptRow(index=i, prompt_set="plain", prompt_len=5, new_tokens=0, acceptance_lengths_dflash=ls)
        for i, ls in enumerate(lengths)
    ]
    return EvalReport(block_size=4, mask_token_id=9, target_layer_ids=[1], max_new_tokens=1000, num_prompts=len(rows),
                      stop_token_ids=[2], target_dtype="bfloat16", greedy=GREEDY, drafters={},
                      lossless=Lossless(ok=True, tolerance=0.0, divergences=[]), prompts=rows)


def test_an_engine_without_per_position_counts_is_held_to_tau_alone():
    report = _report([[4, 2, 1]] * 20)
    cycles, accepted = ours(report)
    cfg = EvalConfig(engine="sglang")
    target_only = ServedRun([[1, 2]], 1.0, 0, [], "sglang")
    same = compare(cfg, ServedRun([[1, 2]], 1.0, cycles, [], "sglang", accepted_total=sum(accepted)), target_only,
                   report, "bfloat16")
    assert (
        same.rule == "tau within 0.03 (below float32): sglang reported no per-position counts"
        and same.disagreement is None
    )
    assert same.tau == pytest.approx(same.ours_tau)
    short = compare(cfg, ServedRun([[1, 2]], 1.0, cycles, [], "sglang", accepted_total=sum(accepted) // 2), target_only,
                    report, "bfloat16")
    assert (
        short.disagreement is not None
        and "in tau" in short.disagreement
        and f"tau {short.tau:.3f}" in short.disagreement
    )


def test_an_engine_python_without_sglang_stops_at_once_with_one_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[eval]\nengine = "sglang"\nengine_python = "{sys.executable}"\n')  # this Python has no sglang
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(tmp_path / "run")])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        "has no sglang module; install sglang into a Python on a GPU machine" in output
        and "sgl-kernel built from source" in output
    )
