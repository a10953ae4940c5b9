"""The target's features read from vLLM (its CPU build, `make engine`) through blockdraft's hidden-states connector
equal the trainer's own forward, for every layer id the drafter reads; a layer id off by one does not."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import ENGINE_PYTHON, needs_engine

from blockdraft.config import EvalConfig
from blockdraft.errors import EngineError
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model import TargetModel, load_target
from blockdraft.stages.eval.engine import free_port, serving
from blockdraft.stages.train.engine_features import EngineFeatures, feature_server_argv, feature_server_env

LAYER_IDS = [1, 3, 5]  # the tiny target has 8 layers: ids 0..6 are features
TOLERANCE = 1e-4  # measured: at most 5.2e-6 of features up to 6.9 in magnitude (fp32, rows of 17 to 300 tokens)


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
