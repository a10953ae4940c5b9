"""`eval` with DFlash2 (docs/DFLASH.md, "DFlash2"): a plain export-format folder as the checkpoint (a published DFlash
or DFlash2 drafter), prompts as input_ids beside a target folder with no tokenizer, the report's architecture and the
walk's acceptance beside the unary argmax's; and `eval --engine vllm` refusing a DFlash2 drafter on the CPU in one
line."""

from __future__ import annotations

import json

import pytest
from helpers.engine import ENGINE_PYTHON, needs_engine
from helpers.paths import GOLDEN, GOLDEN2
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.stages import eval as eval_stage


def _prompts(tmp_path) -> str:
    golden = json.loads((GOLDEN2 / "golden.json").read_text())
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": case["prompt"]}) + "\n" for case in golden["decode"][:3]))
    return str(path)


@pytest.mark.parametrize("fixture,architecture", [(GOLDEN2, "dflash2"), (GOLDEN, "dflash")])
def test_eval_of_a_plain_export_folder_reports_its_architecture_and_the_selectors_gain(tmp_path, fixture, architecture):
    assert not (fixture / "target" / "tokenizer.json").exists()  # input_ids need no tokenizer
    cfg = load_config(None, {
        "target": {"path": str(fixture / "target")},
        "store": {"url": str(tmp_path / "store")},
        "eval": {"untrained_baseline": False, "max_new_tokens": 16},
    })
    result = eval_stage.run(cfg, str(fixture / "drafter"), prompts=_prompts(tmp_path))
    report = result.details
    assert report.architecture == architecture and report.lossless.ok and report.num_prompts == 3
    assert report.checkpoint == str(fixture / "drafter")
    if architecture == "dflash2":
        walk, unary = report.drafters["dflash"], report.drafters["dflash_unary"]
        assert walk.cycles and unary.cycles and walk.tau != unary.tau  # the same prompts, with and without the selector
        assert any(line.startswith("selector\twalk tau") for line in eval_stage.summary_lines(report))
    else:
        assert "dflash_unary" not in report.drafters
    again = eval_stage.run(cfg, str(fixture / "drafter"), prompts=_prompts(tmp_path))
    assert again.already_done  # pinned by its files' content


@needs_engine
@pytest.mark.parametrize("how", ["config", "export"])
def test_eval_engine_vllm_refuses_a_dflash2_drafter_on_the_cpu_in_one_line(tmp_path, how):
    config = tmp_path / "blockdraft.toml"
    architecture = 'architecture = "dflash2"\n' if how == "config" else ""
    config.write_text(
        f'[target]\npath = "{(GOLDEN2 / "target").as_posix()}"\n[store]\nurl = "{(tmp_path / "store").as_posix()}"\n'
        f'[dflash]\nblock_size = 4\nmask_token_id = 511\n{architecture}'
        f'[eval]\nengine_python = "{ENGINE_PYTHON.as_posix()}"\n'
    )
    args = ["eval", "--config", str(config), "--checkpoint", str(GOLDEN2 / "drafter"), "--engine", "vllm", "--prompts",
            _prompts(tmp_path)]
    if how == "export":  # the export names its architecture, whatever the config says
        export = tmp_path / "export"
        export.mkdir()
        for name in ("config.json", "model.safetensors"):
            (export / name).write_bytes((GOLDEN2 / "drafter" / name).read_bytes())
        (export / "serving.json").write_text("{}")
        args += ["--export", str(export)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "DFlash2 drafter only on its V2 model runner" in result.output
    assert not (tmp_path / "store").exists()  # stopped before anything was decoded or exported
