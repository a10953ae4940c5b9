"""The target's features read from vLLM (its CPU build, `make engine`) through blockdraft's hidden-states connector
equal the trainer's own forward, for every layer id the drafter reads; a layer id off by one does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
@pytest.mark.parametrize("layer_ids", [[1, 3], [0, 2, 4]])
def test_features_of_other_layers_are_refused_in_one_line_by_what_the_file_says(engine, layer_ids):
    """Fewer layers, or as many other ones (which the features' shape cannot tell apart): each file's metadata names
    the layers the engine captures."""
    served, folder = engine
    other = EngineFeatures(served.server, layer_ids, 128, torch.float32)
    with pytest.raises(EngineError) as refused:
        other.row(list(range(9)))
    assert str(refused.value) == (
        f"the engine captures vLLM layers [2, 4, 6] and the drafter reads the target's layers {layer_ids} (vLLM's "
        f"{[i + 1 for i in layer_ids]}): its features would be of other layers; start it with `blockdraft "
        "features-server` and this config")
    assert not list(folder.iterdir())  # the refused file is deleted too


def _train_sections(tmp, name, **settings):
    engine = {"engine": {"features_dir": str(tmp / f"features-{name}")}} if settings.get("target_engine") else {}
    return {
        "target": {"path": str(TINY_TARGET_DIR), **engine},
        "store": {"url": str(tmp / "store")},
        "tokenize": {"held_out_fraction": 0.1},
        "dflash": {"block_size": 8, "mask_token_id": MASK, "num_draft_layers": 1, "num_anchors": 16},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / f"run-{name}"),
                  "log_dir": str(tmp / f"logs-{name}"), "max_steps": 20, "batch_size": 4, "global_batch_size": 4,
                  "lr": 1e-3, "warmup_ratio": 0.05,
                  "checkpoint_every": 20, "seed": 0, "deterministic": True, "eval_every": 10, "eval_rows": 8,
                  "decode_eval_prompts": 0, "target_agreement_rows": 0, **settings},
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


@needs_engine
@pytest.mark.engine
@pytest.mark.slow
def test_training_reads_an_engine_started_elsewhere_at_its_url_through_its_own_view_of_the_folder(tokenized):
    """`blockdraft features-server` with the trainers' config serves the features; train, given target.engine.url
    and target.engine.features_dir (here a link to the engine's folder, as a shared filesystem mounted elsewhere),
    starts no engine and trains on them."""
    from blockdraft.engine_process import Server

    tmp = tokenized
    written, seen = tmp / "url-engine-writes", tmp / "url-trainer-sees"
    written.mkdir()
    seen.symlink_to(written)
    port = free_port()
    sections = _train_sections(tmp, "url", target_engine="vllm", max_steps=4, checkpoint_every=4)
    sections["target"]["engine"] = {"url": f"http://127.0.0.1:{port}", "features_dir": str(seen)}
    config = tmp / "url.toml"
    config.write_text(toml_of(sections))
    cli = [str(Path(sys.executable).parent / "blockdraft"), "features-server", "--config", str(config), "--port",
           str(port), "--features-dir", str(written)]
    printed = subprocess.run([*cli, "--print"], capture_output=True, text=True, check=True).stdout
    assert "--kv-transfer-config" in printed and '"eagle_aux_hidden_state_layer_ids": [' in printed
    server = Server(cli, port, tmp / "engine-url.log", dict(os.environ))
    try:
        reporter = Reporter()
        result = train.run(load_config(config), reporter=reporter).details
    finally:
        server.stop()
    assert result.steps == result.steps_run == 4
    assert any(line.startswith(f"reading the target's features (layers {list(result.drafter.spec.target_layer_ids)}) "
                                f"from the engine at http://127.0.0.1:{port}") for line in reporter.lines)
    assert not any(line.startswith("starting vLLM") for line in reporter.lines)
    assert not any(written.iterdir())  # every row's file read through the link and deleted


def toml_of(sections: dict) -> str:
    """`sections` as a TOML file, a table inside a section (target.engine) as its own header."""
    def value(v: object) -> str:
        return json.dumps(v) if isinstance(v, (str, list)) else str(v).lower() if isinstance(v, bool) else repr(v)

    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {value(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for table, inner in ((k, v) for k, v in values.items() if isinstance(v, dict)):
            out += [f"[{name}.{table}]", *(f"{k} = {value(v)}" for k, v in inner.items())]
    return "\n".join(out) + "\n"


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


def test_the_connector_writes_the_format_the_reader_accepts():
    """The connector runs in the engine's Python without blockdraft, so it names the format itself."""
    from blockdraft.stages.train.engine_features import FEATURES_FORMAT, connector_dir

    assert f'FORMAT = "{FEATURES_FORMAT}"' in (connector_dir() / "blockdraft_features.py").read_text()


@pytest.mark.parametrize(("metadata", "said"), [
    ({}, "the engine's feature file says format None, not 'blockdraft-features/1'"),
    ({"prefix_caching": "true"}, "the engine serves with prefix caching on"),
    ({"hidden_size": "256"}, "the engine serves a model of hidden size 256, and the target at target.path has 128"),
])
def test_a_feature_file_from_an_engine_started_otherwise_is_refused_by_its_metadata(metadata, said):
    from blockdraft.engine_process import Endpoint
    from blockdraft.stages.train.engine_features import FEATURES_FORMAT

    served = EngineFeatures(Endpoint("http://127.0.0.1:9"), LAYER_IDS, 128, torch.float32)
    good = {"format": FEATURES_FORMAT, "layer_ids": "[2, 4, 6]", "prefix_caching": "false", "hidden_size": "128"}
    served.check_served(good)
    with pytest.raises(EngineError, match="start it with `blockdraft features-server`") as refused:
        served.check_served({**good, **metadata} if metadata else {})
    assert str(refused.value).startswith(said)


def test_an_engine_url_that_does_not_answer_stops_training_in_one_line_naming_it(tmp_path):
    from blockdraft.stages.train.engine_features import feature_server

    port = free_port()  # nothing listens there
    cfg = load_config(None, {"target": {"path": str(TINY_TARGET_DIR),
                                        "engine": {"url": f"http://127.0.0.1:{port}", "timeout_s": 1}},
                             "train": {"target_engine": "vllm"}})
    with pytest.raises(EngineError) as stopped:
        with feature_server(cfg.train, cfg.target, cfg.eval, LAYER_IDS, 128, "float32", tmp_path, Reporter()):
            pass
    assert str(stopped.value).startswith(f"the engine at http://127.0.0.1:{port} did not answer /health within 1 s "
                                         "(target.engine.timeout_s)")


def test_evals_are_keyed_without_the_engine_settings_that_only_training_reads():
    """A drafter's eval does not depend on how training read the target's features: another engine URL or size finds
    the same eval folder; another target dtype does not."""
    from blockdraft.stages.eval.stage import eval_settings_digest, target_settings

    plain = load_config(None, {"target": {"path": str(TINY_TARGET_DIR)}})
    served = load_config(None, {"target": {"path": str(TINY_TARGET_DIR),
                                           "engine": {"url": "http://127.0.0.1:9", "timeout_s": 5}},
                                "train": {"target_engine": "vllm"}})
    assert eval_settings_digest(plain) == eval_settings_digest(served)
    assert target_settings(plain.resolved()) == target_settings(served.resolved())
    other = load_config(None, {"target": {"path": str(TINY_TARGET_DIR), "dtype": "bfloat16"}})
    assert eval_settings_digest(other) != eval_settings_digest(plain)
