"""A target split over several devices by layer (`placement.target_devices` entries that are lists): the split, the
`device_map` it loads with, the memory plan per device, features equal to the whole target's, and a tiny mixture-of-
experts target trained end to end with its layers over two devices (on the CPU, two entries of one device: the same
per-layer hooks run as across GPUs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.engine import write_config
from helpers.moe import build_moe_target

from blockdraft.config import load_config
from blockdraft.errors import ConfigError
from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model import TargetModel, load_target
from blockdraft.model.spec import TargetShape
from blockdraft.model.split import meta_target, split_target
from blockdraft.model.target import load_target_config
from blockdraft.reporter import Reporter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import tokenize
from blockdraft.stages.train.launch import launch
from blockdraft.stages.train.memory import memory_plan

MASK = json.loads((TINY_TARGET_DIR / "fixture.json").read_text())["mask_token_id"]


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory):
    return build_moe_target(tmp_path_factory.mktemp("moe-target"))


def _targets(moe_target):
    return {"dense": TINY_TARGET_DIR, "hybrid": TINY_HYBRID_TARGET_DIR, "moe": moe_target}


@pytest.mark.parametrize("kind", ["dense", "hybrid", "moe"])
@pytest.mark.parametrize("devices", [2, 3])
def test_the_split_runs_the_layers_in_order_and_places_every_weight_once(kind, devices, moe_target):
    hf_config = load_target_config(str(_targets(moe_target)[kind]))
    model = meta_target(hf_config, torch.float32)
    layers = TargetShape.from_config(hf_config).num_layers
    split = split_target(model, layers, [f"cuda:{i}" for i in range(devices)])
    assert list(split.layer_devices) == sorted(split.layer_devices) and len(split.layer_devices) == layers
    assert set(split.layer_devices) == set(range(devices))  # every device gets layers
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert sum(split.weight_bytes(i) for i in range(devices)) == total
    placed = split.device_map()
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        owners = [key for key in placed if name == key or name.startswith(key + ".")]
        assert len(owners) == 1, (name, owners)
    # the layers go to devices in equal shares of the weights: no device holds more than its share and one layer
    share = total / devices
    assert max(split.weight_bytes(i) for i in range(devices)) <= share + max(split.layer_bytes)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "moe"])
def test_a_split_target_loads_as_planned_and_computes_the_whole_targets_features(kind, moe_target):
    path = str(_targets(moe_target)[kind])
    reporter = Reporter()
    split_model = load_target(path, ["cpu", "cpu"], torch.float32, reporter=reporter)
    whole = load_target(path, "cpu", torch.float32)
    hf_config = load_target_config(path)
    planned = split_target(meta_target(hf_config, torch.float32), TargetShape.from_config(hf_config).num_layers,
                           ["cpu", "cpu"])
    assert split_model.hf_device_map == planned.device_map()  # the model's own record of where each part went
    assert all(p.device.type == "cpu" for p in split_model.parameters())  # held there, not offloaded to be streamed
    assert reporter.lines == [planned.describe()]
    layers = [i for i in (1, 2, 4) if i <= TargetShape.from_config(hf_config).num_layers - 2]
    ids = torch.randint(0, 440, (2, 19), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    got, got_final = TargetModel(split_model, layers).features_and_final(ids, mask)
    want, want_final = TargetModel(whole, layers).features_and_final(ids, mask)
    assert torch.equal(got, want) and torch.equal(got_final, want_final)


def _plan_config(target, groups, drafters):
    return load_config(None, {"target": {"path": str(target)}, "dflash": {"mask_token_id": MASK, "num_draft_layers": 1},
                              "placement": {"target_devices": groups, "drafter_devices": drafters},
                              "train": {"batch_size": 2, "max_length": 256}})


def test_the_memory_plan_plans_each_device_of_a_split_and_refuses_one_that_does_not_fit(moe_target):
    whole = memory_plan(_plan_config(moe_target, ["cuda:0"], ["cuda:2"]), capacity=lambda d: None)
    split = memory_plan(_plan_config(moe_target, [["cuda:0", "cuda:1"]], ["cuda:2"]), capacity=lambda d: None)
    weights = lambda plan, device: sum(  # noqa: E731
        each for p in plan.devices if p.device == device for label, (each, _) in p.items.items()
        if label.startswith("target weights"))
    assert weights(split, "cuda:0") > 0 and weights(split, "cuda:1") > 0
    assert weights(split, "cuda:0") + weights(split, "cuda:1") == weights(whole, "cuda:0")
    assert any(line.startswith("target split by layer: layers 0-") for line in split.facts)
    # a capacity that holds the whole target's half but not the other half's forward: the device named, in one line
    need = {p.device: p.total for p in split.devices}
    tight = memory_plan(_plan_config(moe_target, [["cuda:0", "cuda:1"]], ["cuda:2"]),
                        capacity=lambda d: need[d] - 1 if d == "cuda:1" else need[d])
    assert (problem := tight.problem()) is not None and problem.startswith("memory plan: cuda:1 needs")


def test_a_split_that_does_not_fit_is_refused_before_the_target_loads(tmp_path, moe_target, monkeypatch):
    import blockdraft.stages.train.setup as setup

    monkeypatch.setattr(setup, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    sections = _sections(tmp_path, moe_target, device_memory_gb=0.001)
    tokenize.run(load_config(None, sections), str(TINY_TARGET_DIR / "completions.jsonl"), str(tmp_path / "tokenized"))
    with pytest.raises(ConfigError, match="^memory plan: cpu needs"):
        launch(str(write_config(tmp_path, sections)))


def _sections(tmp, target, **train_settings):
    return {
        "target": {"path": str(target)},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.0},
        "placement": {"target_devices": [["cpu", "cpu"]]},
        "dflash": {"block_size": 8, "mask_token_id": MASK, "num_draft_layers": 1, "num_anchors": 8},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / "run"), "log_dir": str(tmp / "logs"),
                  "max_steps": 4, "batch_size": 2, "global_batch_size": 2, "checkpoint_every": 4, "seed": 0,
                  "decode_eval_prompts": 0, **train_settings},
        "eval": {"num_prompts": 2, "max_new_tokens": 12, "untrained_baseline": False},
    }


def test_a_moe_target_split_over_two_devices_trains_and_evaluates(tmp_path, moe_target):
    sections = _sections(tmp_path, moe_target)
    cfg = load_config(None, sections)
    tokenize.run(cfg, str(TINY_TARGET_DIR / "completions.jsonl"), str(tmp_path / "tokenized"))
    reporter = Reporter()
    launched = launch(str(write_config(tmp_path, sections)), reporter=reporter)  # as `blockdraft train` runs
    assert launched.result is not None
    result = launched.result.details
    assert result.steps == result.steps_run == 4
    assert any(line.startswith("target split by layer: layers 0-") for line in reporter.lines)
    assert any("target weights (float32, layers 0-" in line for line in reporter.lines)  # the plan, as printed
    report = eval_stage.run(cfg, str(tmp_path / "run"), prompts=str(TINY_TARGET_DIR / "prompts.jsonl")).details
    assert report.lossless.ok and report.num_prompts == 2


def plan_on_80gb(fixture, mask, groups, drafters):
    """The memory plan of the architecture-only target `fixture` (tests/fixtures) placed on GPUs of 80 GB."""
    return memory_plan(load_config(None, {
        "target": {"path": str(Path(__file__).parent / "fixtures" / fixture)}, "dflash": {"mask_token_id": mask},
        "placement": {"target_devices": groups, "drafter_devices": drafters},
        "train": {"device_memory_gb": 80}}))


def test_qwen3_235b_fits_eight_80gb_gpus_only_split_over_seven():
    """The published Qwen3-235B-A22B (470 GB in bf16, its config.json alone) on eight GPUs of 80 GB: split over seven
    with the drafter on the eighth it fits; two ranks sharing a six-GPU split hold two replicas and are refused."""
    def plan(groups, drafters):
        return plan_on_80gb("qwen3-235b-a22b", 151669, groups, drafters)

    seven = plan([[f"cuda:{i}" for i in range(7)]], ["cuda:7"])
    assert seven.problem() is None and len(seven.devices) == 8
    assert all(60e9 < p.total < 75e9 for p in seven.devices[:7])  # about 470 GB / 7 each, plus a forward
    shared = plan([[f"cuda:{i}" for i in range(6)]], ["cuda:6", "cuda:7"])
    assert (problem := shared.problem()) is not None
    assert problem.startswith("memory plan: cuda:0 needs") and "device group" in problem


def test_qwen3_5_122b_fits_four_80gb_gpus_for_one_rank_and_not_three_for_two():
    """Qwen3.5-122B-A10B (244 GB in bf16, a hybrid MoE whose config names no dense MLP width): split over four GPUs
    with the drafter on a fifth it fits; two ranks of three-GPU splits put 81 GB of weights on each and are refused."""
    def plan(groups, drafters):
        return plan_on_80gb("qwen3.5-122b-a10b", 248077, groups, drafters)

    four = plan([[f"cuda:{i}" for i in range(4)]], ["cuda:4"])
    assert four.problem() is None and all(60e9 < p.total < 66e9 for p in four.devices[:4])
    assert any("122,111,526,912 parameters in bfloat16 (244.22 GB)" in line for line in four.facts)
    six = plan([[f"cuda:{i}" for i in range(3)], [f"cuda:{i}" for i in range(3, 6)]], ["cuda:6", "cuda:7"])
    assert (problem := six.problem()) is not None and problem.startswith("memory plan: cuda:0 needs 84.45 GB")


def test_a_target_served_by_vllm_is_not_planned_on_the_trainers_devices():
    fixture = Path(__file__).parent / "fixtures" / "qwen3-235b-a22b"
    plan = memory_plan(load_config(None, {
        "dflash": {"mask_token_id": 151669},
        "placement": {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:7"]},
        "target": {"path": str(fixture), "engine": {"tensor_parallel_size": 8, "enable_expert_parallel": True}},
        "train": {"device_memory_gb": 80, "target_engine": "vllm"}}))
    assert [p.device for p in plan.devices] == ["cuda:7"] and plan.problem() is None
    assert not any(label.startswith("target weights") for label in plan.devices[0].items)
    served = next(line for line in plan.facts if line.startswith("target: served by vllm"))
    weights = re.search(r"about ([\d.]+) GB of weights on each \(its ([\d.]+) GB", served)
    assert "on 8 device(s) (tensor x pipeline x data parallel 8 x 1 x 1, experts spread over them)" in served
    assert weights is not None and abs(float(weights[1]) * 8 - float(weights[2])) < 0.05  # rounding
    assert 400 < float(weights[2]) < 500  # Qwen3-235B-A22B in bfloat16
