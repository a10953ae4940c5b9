"""`eval --engine vllm` at temperature: vLLM's CPU build with `make engine`'s expand fix, told the draft rule our decode
ran, agrees with our sampled decode within the binomial interval."""

from __future__ import annotations

import pytest
from helpers.engine import SAMPLING, needs_engine, run_eval, trained_here

pytestmark = [needs_engine, pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_here(tmp_path_factory, "engine-sampled")


@pytest.mark.parametrize("proposal", ["vllm", "vllm-probabilistic"])
def test_at_temperature_the_engine_agrees_with_our_decode_under_its_draft_rule(trained, proposal):
    """vLLM's CPU build with `make engine`'s expand fix, at T 0.6 / top-p 0.95 / top-k 20, told the draft rule our
    decode ran (`draft_sample_method`), gives per-position acceptance and tau within the binomial interval of ours."""
    tmp, runs = trained
    code, output, report = run_eval(tmp, runs["full"], "full", f"eval-sampled-{proposal}", untrained_baseline=False,
                                    num_prompts=8, proposal=proposal, samples_per_prompt=2, **SAMPLING)
    assert code == 0, output
    assert report is not None and report.engine is not None and report.sampled is not None
    engine = report.engine
    print(proposal, engine.model_dump())
    assert report.sampled.proposal == proposal and f"{proposal} drafts" in engine.rule
    assert engine.disagreement is None and engine.temperature == 0.6
    assert engine.drafts > 100 and engine.ours_cycles > 100
    assert engine.accepted_per_position[1] > 0, ("no draft accepted past the first position at temperature: sampling "
                                                 "broken")
    assert "engine\tagrees (binomial 99%" in output
