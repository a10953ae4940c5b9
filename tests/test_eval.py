"""`eval` end to end: a committed checkpoint, real decoding against target-only greedy, the report artifact, and the
refusals (checkpoint vs config, hybrid targets)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from helpers.paths import GOLDEN, TEMPLATES, TOKENIZER_DIR
from helpers.reporters import ProgressLog
from transformers import AutoConfig, AutoTokenizer, Qwen3Config
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.decode.speculative import GreedyResult, SpecResult
from blockdraft.errors import ArtifactError, DecodeError, EvalError, SpecError
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages.eval import EvalReport, first_divergence, summary_lines
from blockdraft.stages.eval.drafter_input import check_checkpoint_matches, open_checkpoint
from blockdraft.stages.eval.prompts import held_out_prompts
from blockdraft.stages.train import resolved_training_config, save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, verify_artifact
from blockdraft.store.inputs import open_input

GOLDEN_DFLASH = {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5], "num_draft_layers": 3,
                 "gamma": 4.0}


def golden_config(tmp: Path, **sections):
    data = {"target": {"path": str(GOLDEN / "target")}, "dflash": dict(GOLDEN_DFLASH),
            "store": {"url": str(tmp / "store")}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return load_config(None, data)


def conversation(i: int) -> dict:
    return {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i + 3}?"},
            {"role": "assistant", "content": f"It is {2 * i + 3}.",
             "reasoning_content": f"{i} + {i + 3} = {2 * i + 3}."},
        ],
    }


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> str:
    """A real tokenize output (Qwen3 tokenizer and its own template) with a held-out split."""
    tmp = tmp_path_factory.mktemp("tokenized")
    (tmp / "in").mkdir()
    (tmp / "in" / "part-00.jsonl").write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(24)))
    cfg = load_config(None, {"target": {"path": str(TOKENIZER_DIR)}, "tokenize": {"held_out_fraction": 0.5}})
    tokenize_stage.run(cfg, str(tmp / "in"), str(tmp / "out"))
    return str(tmp / "out")


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory, tokenized) -> Path:
    """A training output holding one committed checkpoint of the golden drafter, its data lineage the tokenized
    artifact."""
    tmp = tmp_path_factory.mktemp("run")
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    cfg = golden_config(tmp, train={"data": tokenized})
    data = verify_artifact(open_store(tokenized)).manifest.config["tokenize_run"]  # what train pins from its data
    resolved = resolved_training_config(cfg, drafter.spec, str(tmp / "ckpt"), data)
    save_checkpoint(open_store(tmp / "ckpt"), 40, drafter, {}, resolved, [open_input(open_store(tokenized)).ref],
                    {"step": 40})
    return tmp / "ckpt"


@pytest.mark.slow
def test_eval_command_reproduces_golden_decodes_and_commits_a_verified_report(tmp_path, golden_run):
    golden = json.loads((GOLDEN / "golden.json").read_text())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden["decode"]))
    config = tmp_path / "blockdraft.toml"
    config.write_text(
        f'[target]\npath = "{(GOLDEN / "target").as_posix()}"\n'
        # layer ids: the default spread, [1, 3, 5]
        "[dflash]\nblock_size = 4\nmask_token_id = 511\nnum_draft_layers = 3\n"
        f'[store]\nurl = "{(tmp_path / "store").as_posix()}"\n'
    )
    out = tmp_path / "report"
    result = CliRunner().invoke(
        app, ["eval", "--config", str(config), "--checkpoint", str(golden_run), "--prompts", str(prompts),
              "--max-new-tokens", "24", "--output", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "lossless\tok" in result.output and "dflash\ttau 3.8" in result.output

    verified = verify_artifact(open_store(out), check_inputs=True)
    assert verified.state is State.VERIFIED, verified.summary()
    assert verified.manifest.kind == "eval"
    assert {f.path for f in verified.manifest.files} == {"report.json", "tau_histogram.png", "position_acceptance.png"}
    assert [Path(ref.url).name for ref in verified.manifest.lineage] == ["step-00000040", "prompts.jsonl"]
    for png in ("tau_histogram.png", "position_acceptance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((out / "report.json").read_text())
    assert list(report) == [
        "block_size", "mask_token_id", "target_layer_ids", "max_new_tokens", "num_prompts", "stop_token_ids",
        "target_dtype", "greedy", "drafters", "lossless", "prompts", "checkpoint", "target", "prompts_source",
        "template_sha256", "engine", "sampled", "prompt_sets", "architecture",
    ]
    assert report["engine"] is None and report["sampled"] is None  # no engine asked for, temperature 0: greedy only
    assert list(report["greedy"]) == ["new_tokens", "target_forwards", "target_forwards_per_token", "wall_s",
                                      "tokens_per_s", "min_margin"]
    assert list(report["drafters"]) == ["dflash", "ngram", "untrained"]
    assert list(report["drafters"]["dflash"]) == [
        "tau", "cycles", "histogram", "position_acceptance", "conditional_acceptance", "new_tokens", "target_forwards",
        "target_forwards_per_token", "wall_s", "tokens_per_s", "draft_s", "verify_s", "rollback_s", "speedup",
    ]
    # a full-attention target has no linear-attention state to roll back
    assert report["drafters"]["dflash"]["rollback_s"] == 0.0
    assert list(report["prompts"][0]) == [
        "index", "prompt_set", "prompt_len", "new_tokens", "tau_dflash", "acceptance_lengths_dflash", "tau_ngram",
        "acceptance_lengths_ngram", "tau_untrained", "acceptance_lengths_untrained",
    ]
    assert report["checkpoint"] == str(golden_run) and report["prompts_source"] == [str(prompts)]
    assert list(report["prompt_sets"]) == ["plain"]  # one set, whose figures are those over every prompt
    assert report["prompt_sets"]["plain"]["drafters"]["dflash"]["tau"] == report["drafters"]["dflash"]["tau"]
    assert [p["acceptance_lengths_dflash"] for p in report["prompts"]] == [
        c["acceptance_lengths"] for c in golden["decode"]
    ]
    assert report["lossless"] == {"ok": True, "tolerance": 1e-4, "divergences": []}
    assert len(report["template_sha256"]) == 64  # pinned in the checkpoint from its data
    cycles = [n for c in golden["decode"] for n in c["acceptance_lengths"]]
    dflash = report["drafters"]["dflash"]
    assert dflash["tau"] == pytest.approx(sum(cycles) / len(cycles))
    assert dflash["histogram"] == {str(j): cycles.count(j) for j in range(1, 5)}
    assert dflash["position_acceptance"][0] == pytest.approx(sum(n >= 2 for n in cycles) / len(cycles))
    assert dflash["target_forwards"] == len(cycles) + 4  # one prefill per prompt
    assert dflash["new_tokens"] == report["greedy"]["new_tokens"] == 4 * 24
    assert report["greedy"]["target_forwards_per_token"] == 1.0
    assert dflash["target_forwards_per_token"] == pytest.approx((len(cycles) + 4) / 96)
    # The trained golden drafter beats both baselines run on the same prompts.
    assert report["drafters"]["untrained"]["tau"] < 1.5 and report["drafters"]["ngram"]["tau"] < dflash["tau"]
    assert all(m["tokens_per_s"] > 0 and m["speedup"] > 0 for m in report["drafters"].values())


@pytest.mark.parametrize(
    "dflash,field",
    [
        ({"block_size": 8}, "dflash.block_size"),
        ({"mask_token_id": 510}, "dflash.mask_token_id"),
        ({"target_layer_ids": [1, 2, 5]}, "dflash.target_layer_ids"),
        ({"target_layer_ids": None, "num_draft_layers": 2}, "dflash.target_layer_ids"),  # default spread [1, 5]
    ],
)
def test_eval_refuses_a_checkpoint_that_contradicts_the_config(tmp_path, golden_run, dflash, field):
    cfg = golden_config(tmp_path, dflash=dflash)
    with pytest.raises(EvalError, match=rf"trained with {field} = .*set {field} = "):
        eval_stage.run(cfg, str(golden_run), prompts=str(tmp_path / "unused.jsonl"))


def test_eval_refuses_a_chat_template_other_than_the_training_rows(tmp_path, golden_run):
    other = TEMPLATES / "trl_qwen3_5_think.jinja"
    cfg = golden_config(tmp_path, target={"tokenizer": str(TOKENIZER_DIR), "chat_template": str(other)})
    with pytest.raises(EvalError, match=r"chat template sha256 \w{12}.*set target\.chat_template"):
        eval_stage.run(cfg, str(golden_run), prompts=str(tmp_path / "unused.jsonl"))
    # The tokenizer's own template is the one the rows were rendered with: accepted.
    same = golden_config(tmp_path, target={"tokenizer": str(TOKENIZER_DIR)})

    ckpt = open_checkpoint(str(golden_run), same.store, tmp_path)
    assert ckpt.template_sha256 is not None
    check_checkpoint_matches(same, ckpt, AutoConfig.from_pretrained(GOLDEN / "target"))


def test_eval_command_refuses_with_one_line_naming_the_field(tmp_path, golden_run):
    config = tmp_path / "blockdraft.toml"
    config.write_text(f'[target]\npath = "{(GOLDEN / "target").as_posix()}"\n'
                      '[dflash]\nblock_size = 6\nmask_token_id = 511\nnum_draft_layers = 3\n')
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(golden_run)])
    assert result.exit_code == 2
    assert "dflash.block_size" in result.output and "Traceback" not in result.output


def test_eval_refuses_target_layer_kinds_it_cannot_roll_back_by_name(tmp_path, golden_run):
    # Sliding-window target layers are not supported by the decode loop's rollback; linear attention is
    # (tests/test_hybrid_decode.py).
    Qwen3Config(num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4).save_pretrained(
        tmp_path / "sliding"
    )
    cfg = golden_config(tmp_path, target={"path": str(tmp_path / "sliding")})
    with pytest.raises(DecodeError, match=r"layer types \['sliding_attention'\].*not be lossless"):
        eval_stage.run(cfg, str(golden_run))


def test_eval_refuses_an_artifact_that_is_not_a_drafter(tmp_path, tokenized):
    with pytest.raises(ArtifactError, match="'tokenized' artifact, not a drafter"):
        eval_stage.run(golden_config(tmp_path), tokenized, prompts=str(tmp_path / "unused.jsonl"))


def test_prompts_come_from_the_held_out_rows_up_to_the_first_supervised_token(tmp_path, tokenized):
    data = open_input(tokenized)
    prompts = held_out_prompts(data, limit=100, workdir=tmp_path)
    held = datasets.load_from_disk(tokenized)["held_out"]
    assert 0 < len(prompts) == len(held) < 24
    assert data.ref.kind == "manifest" and data.ref.sha256
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for ids, row in zip(prompts, held, strict=True):
        assert (
            row["input_ids"][: len(ids)] == ids
            and row["loss_mask"][len(ids)] == 1
            and not any(row["loss_mask"][: len(ids)])
        )
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert held_out_prompts(data, limit=2, workdir=tmp_path) == prompts[:2]


def test_divergences_are_reported_with_margin_and_fail_beyond_tolerance():
    greedy = GreedyResult(tokens=[1, 2, 3, 4, 5], prompt_len=2, margins=[0.5, 3e-7, 0.8])
    same = SpecResult(tokens=[1, 2, 3, 4, 5], prompt_len=2, acceptance_lengths=[2, 1])
    assert first_divergence("dflash", 0, same, greedy, 1e-4) is None
    near_tie = first_divergence("dflash", 0, SpecResult([1, 2, 3, 9, 5], 2, [3]), greedy, 1e-4)
    assert (near_tie.position, near_tie.new_token_index, near_tie.spec_token, near_tie.target_token) == (3, 1, 9, 4)
    assert near_tie.margin == 3e-7 and near_tie.tolerated
    real = first_divergence("ngram", 1, SpecResult([1, 2, 7, 4, 5], 2, [3]), greedy, 1e-4)
    assert real.position == 2 and real.margin == 0.5 and not real.tolerated
    report = EvalReport.model_validate({
        "block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5], "max_new_tokens": 3, "num_prompts": 2,
        "stop_token_ids": [], "target_dtype": "float32", "drafters": {}, "prompts": [],
        "greedy": {"new_tokens": 3, "target_forwards": 3, "target_forwards_per_token": 1.0, "wall_s": 3.0,
                   "tokens_per_s": 1.0, "min_margin": 3e-7},
        "lossless": {"ok": False, "tolerance": 1e-4, "divergences": [near_tie, real]},
    })
    lines = summary_lines(report)
    assert "lossless\tFAILED\t2 divergence(s)" in lines[1]
    assert "near-tie" in lines[2] and "ngram prompt 1 position 2" in lines[3] and "beyond tolerance" in lines[3]


def test_eval_refuses_prompts_tokenized_for_another_model(tmp_path, golden_run, tokenized):
    # Qwen3-tokenized held-out rows hold ids far beyond the golden target's 512-row embedding.
    cfg = golden_config(tmp_path, train={"data": tokenized})
    with pytest.raises(EvalError, match=r"prompt token id \d+ is outside the target's vocabulary \(0\.\.511\)"):
        eval_stage.run(cfg, str(golden_run))


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_wrong_target_path_is_one_line_naming_the_field(tmp_path, command):
    config = tmp_path / "blockdraft.toml"
    config.write_text(
        f'[target]\npath = "{(tmp_path / "no-such-model").as_posix()}"\n[dflash]\nmask_token_id = 5\n'
        f'[store]\nurl = "{(tmp_path / "store").as_posix()}"\n'
        f'[train]\ndata = "{(tmp_path / "data").as_posix()}"\nlog_dir = "{(tmp_path / "logs").as_posix()}"\n'
    )
    args = (
        ["eval", "--config", str(config), "--checkpoint", str(tmp_path / "ckpt")]
        if command == "eval"
        else ["train", "--config", str(config)]
    )
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "target.path" in result.output and "Traceback" not in result.output


def test_a_second_eval_of_the_same_checkpoint_prompts_and_settings_is_already_done(tmp_path, golden_run):
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden))
    cfg = golden_config(tmp_path, eval={"max_new_tokens": 8})
    out = tmp_path / "report"
    reporter = ProgressLog()
    first = eval_stage.run(cfg, str(golden_run), str(out), reporter, prompts=str(prompts))
    assert not first.already_done and first.report.state is State.VERIFIED and first.stage == "eval"
    # one step per prompt
    assert [call[:3] for call in reporter.calls] == [("eval", 0, 2), ("eval", 1, 2), ("eval", 2, 2)]
    assert EvalReport.from_json((out / "report.json").read_text()) == first.details
    manifest = (out / MANIFEST_NAME).read_bytes()

    again = eval_stage.run(cfg, str(golden_run), str(out), reporter, prompts=str(prompts))
    assert again.already_done and again.report.state is State.VERIFIED
    assert again.details == first.details  # the stored report, not a new run (its timings would differ)
    assert (out / MANIFEST_NAME).read_bytes() == manifest
    assert len(reporter.calls) == 3 and "already holds" in reporter.lines[-1]

    changed = golden_config(tmp_path, eval={"max_new_tokens": 8, "untrained_baseline": False})
    rerun = eval_stage.run(changed, str(golden_run), str(out), prompts=str(prompts))
    assert not rerun.already_done and set(rerun.details.drafters) == {"dflash", "ngram"}
    assert (out / MANIFEST_NAME).read_bytes() != manifest
    assert verify_artifact(open_store(out)).state is State.VERIFIED

    longer = eval_stage.run(cfg, str(golden_run), str(out), prompts=str(prompts), max_new_tokens=12)
    assert not longer.already_done and longer.details.max_new_tokens == 12


def test_eval_at_temperature_reports_sampled_acceptance_with_intervals_beside_unchanged_greedy(tmp_path, golden_run):
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden))
    config = tmp_path / "blockdraft.toml"
    config.write_text(
        f'[target]\npath = "{(GOLDEN / "target").as_posix()}"\n'
        "[dflash]\nblock_size = 4\nmask_token_id = 511\nnum_draft_layers = 3\n"
        f'[store]\nurl = "{(tmp_path / "store").as_posix()}"\n[eval]\nuntrained_baseline = false\n'
    )
    base = ["eval", "--config", str(config), "--checkpoint", str(golden_run), "--prompts", str(prompts),
            "--max-new-tokens", "24"]
    # The golden drafter drafts the same few tokens whatever the context, so off the golden path its argmax drafts (the
    # default rule) are never in the target's top-k at T 0.6; vLLM's probabilistic rule samples them and gets some in.
    sampled = [*base, "--temperature", "0.6", "--top-p", "0.95", "--top-k", "20", "--samples-per-prompt", "3", "--seed",
               "5", "--proposal", "vllm-probabilistic"]
    result = CliRunner().invoke(app, [*sampled, "--output", str(tmp_path / "t06")])
    assert result.exit_code == 0, result.output
    assert (
        "sampled\ttemperature 0.6 top-p 0.95 top-k 20, draft rule vllm-probabilistic: 6 decodes (3 per prompt, seed 5)"
        in result.output
    )
    report = EvalReport.from_json((tmp_path / "t06" / "report.json").read_text())
    # Greedy is measured as before: the golden vectors' acceptance, token for token lossless.
    assert ([p.acceptance_lengths_dflash for p in report.prompts]  # type: ignore[attr-defined]
            == [c["acceptance_lengths"] for c in golden])
    assert report.lossless.ok
    s = report.sampled
    assert s is not None and ((s.temperature, s.top_p, s.top_k, s.seed, s.samples_per_prompt, s.decodes)
                              == (0.6, 0.95, 20, 5, 3, 6))
    dflash = s.drafters["dflash"]
    assert len(dflash.acceptance_lengths) == 6 and dflash.metrics.cycles == sum(map(len, dflash.acceptance_lengths))
    assert dflash.tau_ci95[0] <= dflash.metrics.tau <= dflash.tau_ci95[1] and dflash.tau_ci95[0] < dflash.tau_ci95[1]
    assert all(lo <= r <= hi for r, (lo, hi) in zip(dflash.metrics.position_acceptance,
                                                    dflash.position_acceptance_ci95))
    assert dflash.metrics.tau < report.drafters["dflash"].tau  # the golden drafter was trained on greedy continuations
    assert set(s.drafters) == {"dflash", "ngram"} and s.target_only.new_tokens == 6 * 24
    assert (
        f"dflash\ttau {dflash.metrics.tau:.3f} [{dflash.tau_ci95[0]:.3f}, {dflash.tau_ci95[1]:.3f}] at T=0.6"
        in result.output
    )
    for png in ("tau_histogram_sampled.png", "position_acceptance_sampled.png", "tau_histogram.png"):
        assert (tmp_path / "t06" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The settings are part of the eval's key: the same command is already done, another temperature or seed is not.
    again = CliRunner().invoke(app, [*sampled, "--output", str(tmp_path / "t06")])
    assert again.exit_code == 0 and "already holds" in again.output
    other = CliRunner().invoke(app, [*sampled, "--seed", "6", "--output", str(tmp_path / "t06")])
    assert other.exit_code == 0 and "already holds" not in other.output
    assert (EvalReport.from_json((tmp_path / "t06" / "report.json").read_text())
            .sampled.drafters["dflash"].acceptance_lengths != dflash.acceptance_lengths)  # type: ignore[union-attr]


def test_eval_without_output_writes_to_the_store_and_finds_its_report_there_again(tmp_path, golden_run):
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"][:1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden))
    cfg = golden_config(tmp_path, eval={"max_new_tokens": 4, "untrained_baseline": False})
    first = eval_stage.run(cfg, str(golden_run), prompts=str(prompts))
    assert first.url.startswith(str(tmp_path / "store" / "eval") + "/")
    again = eval_stage.run(cfg, str(golden_run), prompts=str(prompts))
    assert again.already_done and again.url == first.url


def test_a_published_style_drafter_is_decoded_beside_the_checkpoint_as_baseline(tmp_path, golden_run):
    """eval.baseline: a plain drafter folder (no manifest, as a published drafter comes) is checked against the target
    and decoded on the same prompts; here it is the checkpoint's own drafter, so its figures equal the checkpoint's."""
    golden = json.loads((GOLDEN / "golden.json").read_text())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden["decode"][:2]))
    cfg = golden_config(tmp_path, eval={"baseline": str(GOLDEN / "drafter"), "untrained_baseline": False})
    report = eval_stage.run(cfg, str(golden_run), str(tmp_path / "out"), prompts=str(prompts),
                            max_new_tokens=16).details
    assert set(report.drafters) == {"dflash", "ngram", "baseline"} and report.lossless.ok
    assert report.drafters["baseline"].tau == report.drafters["dflash"].tau > 1
    assert (
        report.prompts[0].model_extra["acceptance_lengths_baseline"]
        == report.prompts[0].model_extra["acceptance_lengths_dflash"]
    )


def test_a_baseline_drafter_for_another_target_is_refused_naming_it(tmp_path, golden_run):
    other = tmp_path / "other"
    spec = DFlashDrafter.from_pretrained(GOLDEN / "drafter").spec
    spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads = 32, 2, 1  # built for a narrower target
    DFlashDrafter(spec).save_pretrained(other)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = golden_config(tmp_path, eval={"baseline": str(other)})
    with pytest.raises(SpecError, match=rf"eval.baseline {other}: drafter hidden_size 32 differs from the target's 64"):
        eval_stage.run(cfg, str(golden_run), str(tmp_path / "out"), prompts=str(prompts), max_new_tokens=4)


def test_a_baseline_whose_weights_are_garbage_is_one_line_naming_the_file(tmp_path, golden_run):
    baseline = tmp_path / "published"
    baseline.mkdir()
    (baseline / "config.json").write_bytes((GOLDEN / "drafter" / "config.json").read_bytes())
    (baseline / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 100)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    config = tmp_path / "blockdraft.toml"
    dflash = "\n".join(f"{k} = {json.dumps(v)}" for k, v in GOLDEN_DFLASH.items())
    config.write_text(f'[target]\npath = "{(GOLDEN / "target").as_posix()}"\n[dflash]\n{dflash}\n'
                      f'[store]\nurl = "{(tmp_path / "store").as_posix()}"\n')
    result = CliRunner().invoke(app, ["eval", "--config", str(config), "--checkpoint", str(golden_run), "--prompts",
                                      str(prompts), "--baseline", str(baseline), "--max-new-tokens", "4"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: eval.baseline {baseline}: {baseline / 'model.safetensors'} is not readable (")
    assert errors[0].endswith("give a drafter folder in the export format")


def test_the_eval_report_keeps_no_credential_from_the_checkpoint_target_or_prompt_paths_it_records(
    tmp_path, golden_run
):
    """The report records the checkpoint, target and prompt sources as given: a token in any of them (here hf_ token
    shapes in the folder names) is fingerprinted there, as every pinned setting is."""
    secret = "hf_" + "Q7" * 18
    held = tmp_path / secret
    shutil.copytree(golden_run, held / "ckpt")
    shutil.copytree(GOLDEN / "target", held / "target")
    golden = json.loads((GOLDEN / "golden.json").read_text())["decode"][:1]
    prompts = held / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden))
    cfg = golden_config(tmp_path, target={"path": str(held / "target")}, eval={"untrained_baseline": False})
    result = eval_stage.run(cfg, str(held / "ckpt"), str(tmp_path / "eval"), prompts=str(prompts), max_new_tokens=8)
    report = result.details
    assert report.checkpoint is not None and report.target is not None and report.prompts_source
    for recorded in (report.checkpoint, report.target, *report.prompts_source):
        assert secret not in recorded and "[redacted:" in recorded
    assert secret not in (tmp_path / "eval" / "report.json").read_text()  # the set's source too
    # The manifest's lineage keeps each input's URL as it opens, so that status can check it again: an input whose path
    # is itself a credential is the one place such a name stays.
