"""`export`: the z-lab format engines load, checked against the golden drafter, round-tripped, refused when wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.paths import GOLDEN
from safetensors.torch import load_file
from transformers import AutoConfig
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.config import BlockdraftConfig, DFlashConfig, TargetConfig
from blockdraft.errors import ExportError, SpecError
from blockdraft.model import DFlashDrafter, DraftCache, DrafterSpec, TargetHead, draft_step, load_target
from blockdraft.model.formats import EXPORT_KIND, PROVENANCE_NAME
from blockdraft.reporter import Reporter
from blockdraft.stages import export as export_stage
from blockdraft.stages.export import SERVING_NAME, export_drafter
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, State, commit_artifact, entry_for_local_file, verify_artifact
from blockdraft.store.inputs import open_input
from blockdraft.store.output import StageOutput, stage_key

# What SGLang/vLLM read from config.json: every one must match the reference export.
DFLASH_FIELDS = [
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings", "attention_bias", "layer_types", "use_sliding_window", "sliding_window", "rope_theta",
    "rope_scaling", "rope_parameters", "num_target_layers", "block_size", "dflash_config",
]


def destination(path: Path) -> StageOutput:
    """An export output for a drafter held in memory (no checkpoint to key it by)."""
    return StageOutput(open_store(path), EXPORT_KIND, stage_key({"test": "in-memory drafter"}))


@pytest.fixture(scope="module")
def target_config():
    return AutoConfig.from_pretrained(GOLDEN / "target")


@pytest.fixture(scope="module")
def golden_drafter():
    return DFlashDrafter.from_pretrained(GOLDEN / "drafter").eval()


def _draft_logits(drafter: DFlashDrafter, head: TargetHead, golden: dict) -> torch.Tensor:
    ids = torch.tensor(
        [[int(golden["anchor_id"].item())] + [drafter.spec.mask_token_id] * (drafter.spec.block_size - 1)]
    )
    hidden = draft_step(drafter, DraftCache(), golden["target_features"], head.embed(ids),
                        start=golden["target_features"].shape[1])
    return head.logits(hidden[:, 1:])


def test_export_of_golden_drafter_equals_reference_files(tmp_path, golden_drafter, target_config):
    result = export_drafter(golden_drafter, target_config, destination(tmp_path / "out"))
    out = tmp_path / "out"
    written, reference = (
        load_file(str(out / "model.safetensors")),
        load_file(str(GOLDEN / "drafter" / "model.safetensors")),
    )
    assert sorted(written) == sorted(reference)
    for name, tensor in reference.items():
        assert written[name].shape == tensor.shape and torch.equal(written[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    golden_config = json.loads((GOLDEN / "drafter" / "config.json").read_text())
    for field in DFLASH_FIELDS:
        assert config[field] == golden_config[field], field
    report = verify_artifact(open_store(out))
    assert report.state is State.VERIFIED and report.manifest.kind == EXPORT_KIND
    assert {f.path for f in report.manifest.files} == {"config.json", "model.safetensors", PROVENANCE_NAME,
                                                       SERVING_NAME, "README.md"}
    assert result.report.state is State.VERIFIED


def test_export_round_trip_gives_identical_logits(tmp_path, golden_drafter):
    target = load_target(str(GOLDEN / "target"), attn_implementation="eager")
    head = TargetHead.from_target(target)
    golden = load_file(str(GOLDEN / "golden.safetensors"))
    # a drafter that is not the golden one, so the round trip is not trivially the fixture's files
    spec = DrafterSpec.from_target_config(
        target.config, DFlashConfig(architecture="dflash", block_size=8, mask_token_id=500, num_draft_layers=2))
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).eval()
    for param in drafter.parameters():
        torch.nn.init.normal_(param, std=0.05)
    export_drafter(drafter, target.config, destination(tmp_path / "out"))
    loaded = DFlashDrafter.from_pretrained(tmp_path / "out").eval()
    assert loaded.spec.to_export_config() == spec.to_export_config()
    spec_features = golden["target_features"][..., : 64 * len(spec.target_layer_ids)]
    assert torch.equal(_draft_logits(loaded, head, {**golden, "target_features": spec_features}),
                       _draft_logits(drafter, head, {**golden, "target_features": spec_features}))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_schema_five_layers(tmp_path, target_config, dtype):
    """The tensor set and config engines read, in the target config's own dtype (float32 here) or the one configured."""
    spec = DrafterSpec.from_target_config(target_config,
                                          DFlashConfig(architecture="dflash", block_size=16, mask_token_id=511))
    result = export_drafter(DFlashDrafter(spec), target_config, destination(tmp_path / "out"), location="/srv/drafter",
                            dtype=dtype)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    stored = dtype or "float32"
    assert {str(t.dtype) for t in tensors.values()} == {f"torch.{stored}"}
    h, k, d, inner = 64, 5, 16, 128
    expected = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(5):
        expected |= {
            f"layers.{i}.input_layernorm.weight": (h,), f"layers.{i}.post_attention_layernorm.weight": (h,),
            f"layers.{i}.self_attn.q_proj.weight": (4 * d, h), f"layers.{i}.self_attn.k_proj.weight": (2 * d, h),
            f"layers.{i}.self_attn.v_proj.weight": (2 * d, h), f"layers.{i}.self_attn.o_proj.weight": (h, 4 * d),
            f"layers.{i}.self_attn.q_norm.weight": (d,), f"layers.{i}.self_attn.k_norm.weight": (d,),
            f"layers.{i}.mlp.gate_proj.weight": (inner, h), f"layers.{i}.mlp.up_proj.weight": (inner, h),
            f"layers.{i}.mlp.down_proj.weight": (h, inner),
        }
    assert len(tensors) == 58
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert not any("embed_tokens" in n or "lm_head" in n or n.startswith("model.") for n in tensors)

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["dflash_config"] == {"mask_token_id": 511,
                                                                      "target_layer_ids": [1, 2, 3, 4, 5],
                                                                      "block_size": 16}
    assert config["rope_theta"] == 10000.0 and config["rope_parameters"] == {"rope_theta": 10000.0,
                                                                             "rope_type": "default"}
    assert "rope_scaling" in config and config["num_target_layers"] == 8 and config["vocab_size"] == 512
    assert config["num_hidden_layers"] == 5 and config["layer_types"] == ["full_attention"] * 5
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    assert config["dtype"] == stored

    serving = json.loads((tmp_path / "out" / SERVING_NAME).read_text())
    assert serving == result.details.serving
    assert "--speculative-algorithm DFLASH" in serving["sglang_args"]
    assert (
        f"--speculative-draft-model-path /srv/drafter --speculative-num-draft-tokens 16 --dtype {stored}"
        in serving["sglang_args"]
    )
    assert serving["vllm_speculative_config"] == {"method": "dflash", "model": "/srv/drafter",
                                                  "num_speculative_tokens": 15}
    assert serving["drafter_dir"] == "/srv/drafter" and serving["pull_command"] is None and serving["dtype"] == stored


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 500}, r"mask_token_id 511 >= the target's embedding rows 500 \(config.vocab_size"),
        ({"num_hidden_layers": 5, "layer_types": ["full_attention"] * 5},
         r"target_layer_ids \[5\] outside the target's valid ids 0\.\.3"),
        ({"hidden_size": 128}, r"hidden_size 64 differs from the target's 128"),
    ],
)
def test_export_refuses_a_mismatched_target(tmp_path, golden_drafter, target_config, change, message):
    other = AutoConfig.from_pretrained(GOLDEN / "target", **change)
    with pytest.raises(SpecError, match=message):
        export_drafter(golden_drafter, other, destination(tmp_path / "out"))
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def _data_artifact(root: Path):
    """A committed stand-in for the tokenized dataset: its manifest records the template hash and thinking mode."""
    root.mkdir(parents=True)
    (root / "rows.txt").write_text("rows\n")
    store = open_store(root)
    entry = entry_for_local_file(root, root / "rows.txt")
    config = {"tokenize": {"thinking": "auto"}, "chat_template_sha256": "ab" * 32}
    commit_artifact(store, "tokenized", [entry], config=config, counts={"thinking_rows": {"on": 3, "off": 1}})
    return open_input(store).ref


def _checkpoint(tmp_path: Path, golden_drafter: DFlashDrafter, mask_token_id: int = 511) -> Path:
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(GOLDEN / "target")),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=mask_token_id,
                            target_layer_ids=[1, 3, 5], num_draft_layers=3, gamma=3.0),
    )
    run = tmp_path / "run"
    data = _data_artifact(tmp_path / "data")
    for step in (10, 20):
        save_checkpoint(open_store(run), step, golden_drafter, {"step": step}, cfg.resolved(), [data], {"step": step})
    return run


@pytest.mark.fault
def test_export_from_training_run_records_provenance(tmp_path, golden_drafter):
    run = _checkpoint(tmp_path, golden_drafter)
    (run / "step-00000020" / MANIFEST_NAME).unlink()  # the newest push never committed: export must take step 10
    out = tmp_path / "export"
    result = export_stage.run(BlockdraftConfig(), str(run), str(out))
    assert verify_artifact(open_store(out)).state is State.VERIFIED
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], golden_drafter.fc.weight)
    assert result.report.manifest.lineage[0].url == open_store(run / "step-00000010").url
    provenance = json.loads((out / PROVENANCE_NAME).read_text())
    assert provenance["dflash"] == {"mask_token_id": 511, "target_layer_ids": [1, 3, 5], "block_size": 4,
                                    "num_target_layers": 8, "layer_types": ["full_attention"] * 3,
                                    "sliding_window": None, "rope_scaling": None, "gamma": 3.0,
                                    "architecture": "dflash"}
    assert provenance["config"]["target"]["path"] == str(GOLDEN / "target")
    (data,) = provenance["data"]
    assert data["kind_of_input"] == "tokenized" and len(data["sha256"]) == 64
    assert data["config.chat_template_sha256"] == "ab" * 32
    assert data["config.tokenize.thinking"] == "auto" and data["counts.thinking_rows"] == {"on": 3, "off": 1}


def test_export_cli_prints_serving_settings_and_refuses_bad_input(tmp_path, golden_drafter):
    run = _checkpoint(tmp_path, golden_drafter)
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(run / "step-00000020"), f"file://{tmp_path / 'export'}"])
    assert ok.exit_code == 0, ok.output
    assert "--speculative-algorithm DFLASH" in ok.output and '"num_speculative_tokens": 3' in ok.output
    # a file:// destination is served as the folder it names, in the target's dtype, with nothing to pull
    assert f"--speculative-draft-model-path {tmp_path / 'export'} " in ok.output and "--dtype float32" in ok.output
    assert f'"model": "{tmp_path / "export"}"' in ok.output and "file://" not in ok.stdout.split("SGLang:", 1)[1]
    assert "blockdraft pull" not in ok.output

    # a checkpoint whose pinned config contradicts its config.json
    bad = _checkpoint(tmp_path / "bad", golden_drafter, mask_token_id=510)
    refused = runner.invoke(app, ["export", str(bad), str(tmp_path / "bad-export")])
    assert refused.exit_code == 2
    assert "dflash.mask_token_id is 510" in refused.output and "Traceback" not in refused.output

    # a target with fewer embedding rows than the mask id
    small = tmp_path / "small-target"
    AutoConfig.from_pretrained(GOLDEN / "target", vocab_size=300).save_pretrained(small)
    refused = runner.invoke(app, ["export", str(run), str(tmp_path / "small-export"), "--target", str(small)])
    assert refused.exit_code == 2 and "mask_token_id 511 >= the target's embedding rows 300" in refused.output

    unverified = runner.invoke(app, ["export", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert unverified.exit_code == 2 and "not a verified checkpoint" in unverified.output


def test_export_refuses_an_artifact_that_is_not_a_checkpoint(tmp_path):
    data = tmp_path / "data"
    _data_artifact(data)
    with pytest.raises(Exception, match="'tokenized' artifact, not a drafter checkpoint"):
        export_stage.run(BlockdraftConfig(), str(data), str(tmp_path / "out"))


def test_export_refuses_a_drafter_without_its_pinned_config(tmp_path, golden_drafter):
    export_stage.run(BlockdraftConfig(), str(_checkpoint(tmp_path, golden_drafter)), str(tmp_path / "export"))
    with pytest.raises(ExportError,
                       match=r"lists no blockdraft-config\.json: it is not a blockdraft training checkpoint"):
        export_stage.run(BlockdraftConfig(), str(tmp_path / "export"), str(tmp_path / "again"))  # an export pins none


def test_a_second_export_of_the_same_checkpoint_is_already_done_and_another_target_exports_again(
    tmp_path, golden_drafter
):
    run = _checkpoint(tmp_path, golden_drafter)
    out = tmp_path / "export"
    first = export_stage.run(BlockdraftConfig(), str(run), str(out))
    assert not first.already_done and first.stage == "export" and first.report.state is State.VERIFIED
    manifest = (out / MANIFEST_NAME).read_bytes()

    reporter = Reporter()
    again = export_stage.run(BlockdraftConfig(), str(run), str(out), reporter)
    assert again.already_done and again.report.state is State.VERIFIED and again.url == first.url
    assert again.details == first.details  # read back from serving.json and blockdraft-export.json
    assert (out / MANIFEST_NAME).read_bytes() == manifest and "already holds" in reporter.lines[-1]

    # The serving settings name the target: another one is another export.
    other_target = tmp_path / "other-target"
    AutoConfig.from_pretrained(GOLDEN / "target").save_pretrained(other_target)
    other = export_stage.run(BlockdraftConfig(target=TargetConfig(path=str(other_target))), str(run), str(out))
    assert not other.already_done and str(other_target) in other.details.serving["sglang_command"]
    assert (out / MANIFEST_NAME).read_bytes() != manifest
    assert verify_artifact(open_store(out)).state is State.VERIFIED


# The published Qwen3.6-27B drafter's shape: 4 sliding layers + 1 full, window 2048, for a 64-layer target.
PUBLISHED_STYLE = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16", "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "vocab_size": 248320,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": True, "sliding_window": 2048,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "max_window_layers": 5,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "num_target_layers": 64, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16},
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536}


@pytest.mark.parametrize("rope", ["default", "yarn-parameters", "yarn-scaling"])
def test_published_style_config_parses(rope):
    config = dict(PUBLISHED_STYLE)
    if rope == "yarn-parameters":
        config["rope_parameters"] = {"rope_theta": 10000000, **YARN}
    elif rope == "yarn-scaling":
        config = ({k: v for k, v in config.items() if k != "rope_parameters"}
                  | {"rope_theta": 10000000, "rope_scaling": YARN})
    spec = DrafterSpec.from_export_config(config)
    assert spec.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and spec.sliding_window == 2048
    assert (spec.hidden_size, spec.num_target_layers, spec.block_size, spec.mask_token_id) == (5120, 64, 16, 248070)
    assert spec.target_layer_ids == [1, 16, 31, 46, 61] and spec.vocab_size == 248320 and spec.rope_theta == 1e7
    assert spec.rope_type == ("default" if rope == "default" else "yarn")
    exported = spec.to_export_config()
    assert exported["use_sliding_window"] is True and exported["sliding_window"] == 2048
    assert DrafterSpec.from_export_config(exported) == spec


def _tiny_published(rope_scaling: dict | None) -> DFlashDrafter:
    """The published drafter's structure at tiny width: 4 sliding + 1 full layer, window 20, block 16."""
    config = dict(PUBLISHED_STYLE, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, sliding_window=20, max_position_embeddings=4096)
    if rope_scaling:
        config["rope_parameters"] = {"rope_theta": 10000000, **rope_scaling, "original_max_position_embeddings": 1024}
    torch.manual_seed(0)
    return DFlashDrafter(DrafterSpec.from_export_config(config)).to(torch.bfloat16).eval()


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default", "yarn"])
def test_tiny_published_style_round_trips_in_bf16(tmp_path, rope_scaling):
    from transformers import Qwen3Config

    drafter = _tiny_published(rope_scaling)
    paths = drafter.save_pretrained(tmp_path)
    config = json.loads(paths[0].read_text())
    assert config["dtype"] == "bfloat16" and config["layer_types"][-1] == "full_attention"
    assert config["use_sliding_window"] is True and config["sliding_window"] == 20
    assert all(t.dtype == torch.bfloat16 for t in load_file(paths[1]).values())
    # the reference drafter's config class is a Qwen3Config: the export must read as one, with the same fields
    qwen3 = Qwen3Config(**config)
    assert qwen3.layer_types == config["layer_types"] and qwen3.sliding_window == 20
    assert qwen3.rope_parameters["rope_type"] == ("yarn" if rope_scaling else "default")
    assert qwen3.rope_parameters["rope_theta"] == 1e7

    again = DFlashDrafter.from_pretrained(tmp_path).eval()
    assert again.spec == drafter.spec and next(again.parameters()).dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, 40, 5 * 32, generator=g).to(torch.bfloat16)  # context 40 > window 20
    block = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    first = draft_step(drafter, DraftCache(), features, block, start=40)
    second = draft_step(again, DraftCache(), features, block, start=40)
    assert torch.isfinite(first.float()).all() and torch.equal(first, second)


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    """The golden target saved in bf16: its config.json names "dtype": "bfloat16", as Qwen3/3.5/3.6 checkpoints do."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16-target")
    AutoModelForCausalLM.from_pretrained(GOLDEN / "target", dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def test_export_of_a_bf16_target_checkpoint_is_bf16_and_keeps_the_logits(tmp_path, golden_drafter, bf16_target):
    """The checkpoint holds fp32 master weights; the export of it for a bf16 target stores every tensor in bf16, says so
    in config.json, prints SGLang's --dtype bfloat16, and loads back with the fp32 drafter's logits within bf16
    rounding."""
    cfg = BlockdraftConfig(
        target=TargetConfig(path=str(bf16_target)),
        dflash=DFlashConfig(architecture="dflash", block_size=4, mask_token_id=511, target_layer_ids=[1, 3, 5],
                            num_draft_layers=3, gamma=3.0),
    )
    run = tmp_path / "run"
    save_checkpoint(open_store(run), 5, golden_drafter, {"step": 5}, cfg.resolved(), [], {"step": 5})
    out = tmp_path / "export"
    result = export_stage.run(cfg, str(run), str(out))

    assert {t.dtype for t in load_file(str(run / "step-00000005" / "model.safetensors")).values()} == {torch.float32}
    config = json.loads((out / "config.json").read_text())
    written, reference = (
        load_file(str(out / "model.safetensors")),
        load_file(str(GOLDEN / "drafter" / "model.safetensors")),
    )
    assert config["dtype"] == "bfloat16" and {t.dtype for t in written.values()} == {torch.bfloat16}
    assert sorted(written) == sorted(reference) and all(
        torch.equal(written[n], t.to(torch.bfloat16)) for n, t in reference.items()
    )
    for field in DFLASH_FIELDS:  # nothing else about the format changes
        assert config[field] == json.loads((GOLDEN / "drafter" / "config.json").read_text())[field], field
    assert (
        "--dtype bfloat16" in result.details.serving["sglang_command"]
        and result.details.provenance["dtype"] == "bfloat16"
    )

    loaded = DFlashDrafter.from_pretrained(out).eval()
    assert next(loaded.parameters()).dtype == torch.bfloat16
    target = load_target(str(bf16_target), attn_implementation="eager")
    assert target.dtype == torch.bfloat16  # target.dtype unset: the target config's own dtype
    golden = load_file(str(GOLDEN / "golden.safetensors"))
    head32 = TargetHead.from_target(load_target(str(GOLDEN / "target"), attn_implementation="eager"))
    expected = _draft_logits(golden_drafter, head32, golden)
    served = _draft_logits(loaded, TargetHead.from_target(target),
                           {**golden, "target_features": golden["target_features"].bfloat16()})
    assert served.dtype == torch.bfloat16 and torch.equal(served.argmax(-1), expected.argmax(-1))
    # bf16 keeps 8 significant bits: after the rounded layers, within a few hundredths of the logits' scale (0.42 of
    # 12.7 here)
    torch.testing.assert_close(served.float(), expected, rtol=0.0, atol=0.05 * float(expected.abs().max()))


@pytest.mark.parametrize(("ids", "why"), [([5, 1, 3], "5 before 1"), ([3, 3], "3 repeated")])
def test_an_export_with_unsorted_or_repeated_layer_ids_is_refused_at_load(tmp_path, ids, why):
    """A drafter folder whose dflash_config.target_layer_ids the engines cannot serve: loading it (an eval baseline, a
    train.init_from, an export of a checkpoint) fails with one line naming the field."""
    from blockdraft.stages.train.setup import load_init_drafter

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((GOLDEN / "drafter" / "model.safetensors").read_bytes())
    config = json.loads((GOLDEN / "drafter" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(config))
    for load in (DFlashDrafter.from_pretrained, lambda path: load_init_drafter(str(path), None)):
        with pytest.raises(SpecError) as refused:
            load(folder)
        message = str(refused.value)
        assert "dflash_config.target_layer_ids" in message and f"strictly ascending and unique ({why})" in message
        assert "\n" not in message
