"""The dtype each engine runs our drafter in, by the engines' own rules, checked against the export.

The rules, as the engines' sources state them (read for this test; encoded below as small functions, not copied):

- SGLang, sgl-project/sglang, `python/sglang/srt/configs/model_config.py`, `_get_and_verify_dtype` (called by
  `ModelConfig.__init__` with the model's text config and the server's `dtype`): the config's dtype is its `dtype` field
  (`torch_dtype` for a plain dict), float32 when it names none. With `--dtype auto` a float32 config runs in float16
  (bfloat16 for Gemma model types) and any other dtype runs as named; an explicit `--dtype` wins.
- The SGLang draft model goes through that same function with the same flag: `DFlashWorker.__init__`
  (`python/sglang/srt/speculative/dflash_worker.py`) builds the draft runner as a `TpModelWorker` with
  `is_draft_worker=True` from a copy of the server args; `TpModelWorker` (`python/sglang/srt/managers/tp_worker.py`)
  then builds its config with
  `ModelConfig.from_server_args(..., model_path=server_args.speculative_draft_model_path, is_draft_model=True)`, and
  `ModelConfig.from_server_args` passes `dtype=server_args.dtype`. So under `--dtype auto` the drafter's dtype comes
  from the drafter's own config.json, independently of the target's.
- vLLM, vllm-project/vllm, `vllm/config/speculative.py`, `SpeculativeConfig.__post_init__`: the draft model's
  `ModelConfig` is built with `dtype=self.target_model_config.dtype`, so the drafter runs in the target's dtype whatever
  its config says.

Hence the export stores the target's dtype: SGLang under `--dtype auto` then runs drafter and target alike, and vLLM's
cast is a no-op. A float32 export beside a bf16 target is the bug this guards against: SGLang would run it in float16.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import GOLDEN
from safetensors.torch import load_file
from transformers import AutoConfig

from blockdraft.errors import ConfigError
from blockdraft.model import DFlashDrafter
from blockdraft.model.formats import EXPORT_KIND
from blockdraft.model.target import target_dtype
from blockdraft.stages.export import SERVING_NAME, export_drafter
from blockdraft.store import open_store
from blockdraft.store.output import StageOutput, stage_key

_SGLANG_NAMES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
                 "bfloat16": "bfloat16"}


def sglang_config_dtype(config: dict) -> str:
    """What SGLang reads as a config's own dtype: `dtype`, else `torch_dtype`; unnamed or unknown is float32."""
    return _SGLANG_NAMES.get(str(config.get("dtype") or config.get("torch_dtype")), "float32")


def sglang_dtype(config: dict, flag: str = "auto") -> str:
    """The dtype SGLang runs a model (target or drafter) with this config.json in, under `--dtype flag`."""
    if flag != "auto":
        return _SGLANG_NAMES[flag]
    named = sglang_config_dtype(config)
    if named == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return named


def vllm_draft_dtype(target_runs_in: str) -> str:
    """The dtype vLLM runs the drafter in: the target's."""
    return target_runs_in


def _export(tmp_path, target_config) -> tuple[dict, dict, dict]:
    """Export the golden drafter (fp32 weights) for `target_config`: (config.json, serving.json, tensors)."""
    drafter = DFlashDrafter.from_pretrained(GOLDEN / "drafter")
    out = StageOutput(open_store(tmp_path / "export"), EXPORT_KIND, stage_key({"test": "serving dtype"}))
    export_drafter(drafter, target_config, out, location=str(tmp_path / "export"))
    folder = tmp_path / "export"
    return (json.loads((folder / "config.json").read_text()), json.loads((folder / SERVING_NAME).read_text()),
            load_file(str(folder / "model.safetensors")))


def _flag(serving: dict) -> str:
    args = serving["sglang_args"].split()
    return args[args.index("--dtype") + 1]


def test_engines_run_the_export_of_a_bf16_target_in_bf16(tmp_path):
    target = AutoConfig.from_pretrained(GOLDEN / "target", dtype="bfloat16")  # a Qwen3-style bf16 checkpoint's config
    target_json = target.to_dict()
    exported, serving, tensors = _export(tmp_path, target)

    # SGLang, `--dtype auto`: the drafter's dtype comes from the export's config.json and equals the target's
    assert sglang_dtype(exported) == sglang_dtype(target_json) == "bfloat16"
    # the printed command passes the target's dtype: drafter and target agree under it too
    assert _flag(serving) == "bfloat16" and sglang_dtype(exported, _flag(serving)) == sglang_dtype(
        target_json, _flag(serving)
    )
    # vLLM casts the drafter to the target's dtype: the stored tensors already are, so nothing is rounded at load
    assert {str(t.dtype).removeprefix("torch.") for t in tensors.values()} == {
        vllm_draft_dtype(sglang_dtype(target_json))
    }


def test_a_float32_export_would_run_in_float16_beside_a_bf16_target(tmp_path):
    """The bug: a drafter stored in float32 (or with no dtype named, as the golden fixture) becomes float16 under
    auto."""
    target_json = AutoConfig.from_pretrained(GOLDEN / "target", dtype="bfloat16").to_dict()
    DFlashDrafter.from_pretrained(GOLDEN / "drafter").save_pretrained(tmp_path / "fp32")  # the parameters' own dtype
    fp32_export = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert fp32_export["dtype"] == "float32"
    assert sglang_dtype(fp32_export) == "float16" != sglang_dtype(target_json)
    assert sglang_dtype(json.loads((GOLDEN / "drafter" / "config.json").read_text())) == "float16"


def test_a_float32_target_exports_float32_and_the_command_keeps_it(tmp_path):
    target = AutoConfig.from_pretrained(GOLDEN / "target")  # the tiny fp32 target: unchanged behaviour
    exported, serving, tensors = _export(tmp_path, target)
    assert exported["dtype"] == "float32" and {t.dtype for t in tensors.values()} == {torch.float32}
    assert sglang_dtype(exported) == sglang_dtype(target.to_dict())  # both downcast alike under auto
    assert _flag(serving) == "float32"


def test_target_dtype_reads_the_config_as_sglang_does(tmp_path):
    """`target.dtype` unset: the target config's own dtype, read as SGLang reads it (dtype, older torch_dtype, else
    float32)."""
    older = json.loads((GOLDEN / "target" / "config.json").read_text())
    older.pop("dtype", None)
    cases = {"bf16": {**older, "dtype": "bfloat16"}, "torch_dtype": {**older, "torch_dtype": "float16"},
             "unnamed": older}
    for name, config in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        hf_config = AutoConfig.from_pretrained(tmp_path / name)
        assert target_dtype(None, hf_config) == sglang_config_dtype(config), name
    assert target_dtype("bfloat16", AutoConfig.from_pretrained(tmp_path / "unnamed")) == "bfloat16"  # target.dtype wins

    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**older, "dtype": "float8_e4m3fn"}))
    with pytest.raises(ConfigError, match="set target.dtype"):
        target_dtype(None, AutoConfig.from_pretrained(tmp_path / "fp8"))
