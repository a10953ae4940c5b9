"""The target's features read from vLLM (its CPU build, `make engine`) through blockdraft's hidden-states connector
equal the trainer's own forward, for every layer id the drafter reads; a layer id off by one does not."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers.engine import ENGINE_PYTHON, needs_engine
from helpers.moe import build_moe_target

from blockdraft.config import EvalConfig, load_config
from blockdraft.engine_process import free_port, serving
from blockdraft.errors import EngineError
from blockdraft.fixtures.hybrid import TINY_HYBRID_TARGET_DIR
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model import TargetHead, TargetModel, load_target
from blockdraft.model.target import load_target_head
from blockdraft.reporter import Reporter
from blockdraft.stages import tokenize, train
from blockdraft.stages.train.engine_features import EngineFeatures, feature_server_argv, feature_server_env

LAYER_IDS = [1, 3, 5]  # the tiny target has 8 layers: ids 0..6 are features
TOLERANCE = 1e-4  # measured: at most 5.2e-6 of features up to 6.9 in magnitude (fp32, rows of 17 to 300 tokens)
MASK = json.loads((TINY_TARGET_DIR / "fixture.json").read_text())["mask_token_id"]
LOSS_TOLERANCE = 1e-4  # relative, per step (measured: 2.1e-7)
WEIGHT_TOLERANCE = 1e-4  # the largest difference of a drafter weight after 20 steps (measured: 5.1e-6 of 1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-features")
    argv = feature_server_argv(ENGINE_PYTHON, str(TINY_TARGET_DIR), free_port(), "float32", 512, LAYER_IDS,
                               tmp / "features")
    with serving(argv, tmp, "features", EvalConfig(), feature_server_env()) as server:
        yield EngineFeatures(server, LAYER_IDS, 128, torch.float32), tmp / "features"


def _rows():
    g = torch.Generator().manual_seed(0)
    lengths = (17, 100, 300)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, 440, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, lengths


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
def test_engine_features_equal_the_trainers_own_and_an_off_by_one_layer_does_not(engine):
    served, folder = engine
    ids, mask, lengths = _rows()
    got = served.features(ids, mask)
    whole = load_target(str(TINY_TARGET_DIR), "cpu", torch.float32)
    for i, n in enumerate(lengths):
        want = TargetModel(whole, LAYER_IDS).features(ids[i : i + 1, :n])[0]
        assert (got[i, :n] - want).abs().max().item() <= TOLERANCE
        assert not got[i, n:].any()  # padding stays zero
        for shifted in ([i - 1 for i in LAYER_IDS], [i + 1 for i in LAYER_IDS]):
            wrong = TargetModel(whole, shifted).features(ids[i : i + 1, :n])[0]
            assert (got[i, :n] - wrong).abs().max().item() > 100 * TOLERANCE
    assert not list(folder.iterdir())  # every file read was deleted, its lock too


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
def test_features_of_other_layers_are_refused_in_one_line(engine):
    served, _ = engine
    other = EngineFeatures(served.server, [1, 3], 128, torch.float32)  # the engine serves three layers
    with pytest.raises(EngineError, match=r"have shape \(9, 3, 128\), not \(9, 2, 128\)"):
        other.row(list(range(9)))


def _train_sections(tmp, name, **settings):
    return {
        "target": {"path": str(TINY_TARGET_DIR)},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.1},
        "dflash": {"block_size": 8, "mask_token_id": MASK, "num_draft_layers": 1, "num_anchors": 16},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / f"run-{name}"),
                  "log_dir": str(tmp / f"logs-{name}"), "max_steps": 20, "batch_size": 4, "global_batch_size": 4,
                  "lr": 1e-3, "warmup_ratio": 0.05,
                  "checkpoint_every": 20, "seed": 0, "deterministic": True, "eval_every": 10, "eval_rows": 8,
                  "decode_eval_prompts": 0, "target_agreement_rows": 0,
                  "engine_features_dir": str(tmp / f"features-{name}"), **settings},
        "eval": {"engine_python": str(ENGINE_PYTHON)},
    }


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-train")
    tokenize.run(load_config(None, _train_sections(tmp, "hf")), str(TINY_TARGET_DIR / "completions.jsonl"),
                 str(tmp / "tokenized"))
    return tmp


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
def test_a_drafter_trained_on_engine_features_equals_one_trained_on_the_trainers_own(tokenized):
    tmp = tokenized
    ours = train.run(load_config(None, _train_sections(tmp, "hf"))).details
    reporter = Reporter()
    served = train.run(load_config(None, _train_sections(tmp, "vllm", target_engine="vllm")), reporter=reporter).details
    assert any(line.startswith("starting vLLM to serve the target's features") for line in reporter.lines)
    assert served.steps == ours.steps == 20
    losses = [(a["loss"], b["loss"]) for a, b in zip(ours.metrics, served.metrics, strict=True)]
    assert all(abs(a - b) <= LOSS_TOLERANCE * abs(a) for a, b in losses), losses
    diff = max((p - q).abs().max().item() for p, q in zip(ours.drafter.state_dict().values(),
                                                           served.drafter.state_dict().values(), strict=True))
    assert diff <= WEIGHT_TOLERANCE
    assert not any((tmp / "features-vllm").iterdir())  # every row's file read and deleted


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.fault
def test_an_engine_killed_mid_run_stops_training_in_one_line_and_a_rerun_resumes(tokenized):
    tmp = tokenized
    sections = _train_sections(tmp, "killed", target_engine="vllm", max_steps=12, checkpoint_every=6)
    features = tmp / "features-killed"

    class KillsTheEngine(Reporter):
        """Kills the feature server (found by its feature folder on its command line) once step 8 is done."""

        def progress(self, task, completed, total=None, **fields):
            if task == "train" and completed == 8:
                subprocess.run(["pkill", "-KILL", "-f", str(features)], check=False)

    with pytest.raises(EngineError) as stopped:
        train.run(load_config(None, sections), reporter=KillsTheEngine())
    assert "\n" not in str(stopped.value) and "engine" in str(stopped.value)
    resumed = train.run(load_config(None, sections), reporter=Reporter()).details
    assert resumed.resumed_from == 6 and resumed.steps == 12 and resumed.steps_run == 6


@pytest.mark.parametrize("kind", ["dense", "hybrid", "tied", "biased"])
def test_the_embedding_and_head_read_alone_equal_the_whole_targets(kind, tmp_path):
    """With the target in an engine the trainer reads only these tensors from its files: a composite checkpoint's
    nested text model (the hybrid), a head tied to the embedding (a Llama with tied embeddings) and a head with a bias
    (Phi's) included."""
    from transformers import LlamaConfig, LlamaForCausalLM, PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    if kind == "tied":
        LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True)).save_pretrained(tmp_path)
    if kind == "biased":
        model = PhiForCausalLM(PhiConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4))
        torch.nn.init.normal_(model.lm_head.bias)  # not the zeros it starts at, so a bias left out shows
        model.save_pretrained(tmp_path)
    path = str({"dense": TINY_TARGET_DIR, "hybrid": TINY_HYBRID_TARGET_DIR}.get(kind, tmp_path))
    alone = load_target_head(path, torch.float32, "cpu")
    whole = TargetHead.from_target(load_target(path, "cpu", torch.float32))
    assert torch.equal(alone.embed_weight, whole.embed_weight)
    assert torch.equal(alone.lm_head_weight, whole.lm_head_weight)
    if kind == "biased":
        assert whole.lm_head_bias is not None and alone.lm_head_bias is not None
        assert torch.equal(alone.lm_head_bias, whole.lm_head_bias) and whole.lm_head_bias.abs().max() > 0
    else:
        assert alone.lm_head_bias is None


@pytest.mark.parametrize("setting", [{"packing": True, "batch_size": 4}, {"distill_weight": 0.5}])
def test_what_needs_the_targets_own_forward_is_refused_with_the_engine(setting):
    from blockdraft.errors import ConfigError

    name = next(iter(setting))
    with pytest.raises(ConfigError, match=f"train.{name} needs the target's forward in the trainer"):
        load_config(None, {"train": {"target_engine": "vllm", **setting}})


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
def test_a_moe_target_served_by_vllm_trains_end_to_end(tmp_path):
    moe = build_moe_target(tmp_path / "moe-target")
    sections = _train_sections(tmp_path, "moe", target_engine="vllm", max_steps=6, checkpoint_every=6)
    sections["target"]["path"] = str(moe)
    cfg = load_config(None, sections)
    tokenize.run(cfg, str(TINY_TARGET_DIR / "completions.jsonl"), str(tmp_path / "tokenized"))
    result = train.run(cfg, reporter=Reporter())
    assert result.details.steps == result.details.steps_run == 6  # the final checkpoint verified at the destination
    assert not any((tmp_path / "features-moe").iterdir())


def test_the_default_feature_folder_is_made_for_the_run_and_removed_after_it(tmp_path):
    from blockdraft.stages.train.engine_features import features_dir

    with features_dir(None) as made:
        assert made.is_dir() and made.name.startswith("blockdraft-features-")
    assert not made.exists()
    with features_dir(str(tmp_path / "mine")) as given:  # a folder the config names is the user's: it stays
        assert given == tmp_path / "mine"
    assert given.is_dir()
