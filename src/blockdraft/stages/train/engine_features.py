"""The target's features read from a vLLM engine that serves it, instead of the trainer's own forward: the way to a
target that an inference engine spreads over devices and nodes (tensor, pipeline, expert parallelism).

vLLM serves the target with its `extract_hidden_states` method and blockdraft's connector (`blockdraft.vllm_connector`):
a prompt sent for prefill (one new token) leaves the hidden states of the requested layers in a safetensors file whose
path comes back with the answer. Layer id i here (the output of decoder layer i) is vLLM's id i + 1 (its 0 is the
embeddings). Every file is checked (the row's own token ids, its shape, dtype and finite values) and deleted once read.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from blockdraft.config import EvalConfig, TargetConfig, TrainConfig
from blockdraft.engine_process import SERVED_NAME, Server, server_argv, server_env
from blockdraft.errors import EngineError
from blockdraft.model.spec import TargetShape
from blockdraft.model.target import load_target_config
from blockdraft.reporter import Reporter

CONNECTOR = "BlockdraftFeaturesConnector"
CONNECTOR_MODULE = "blockdraft_features"
POLL_S = 0.005


def connector_dir() -> Path:
    """The folder the engine's Python imports the connector module from (it does not have blockdraft installed)."""
    from blockdraft import vllm_connector

    return Path(vllm_connector.__file__).parent


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's ids of the outputs of decoder layers `layer_ids`: its id 0 is the embeddings, so layer i is id i + 1."""
    return [i + 1 for i in layer_ids]


def feature_server_argv(python: Path, target: str, port: int, dtype: str, max_len: int | None,
                        layer_ids: Sequence[int], features_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command line that serves `target` writing the hidden states of `layer_ids` for each request into
    `features_dir`; prefix caching is off, so every prompt's every token is computed (and saved)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layer_ids)}}}
    connector = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(features_dir)}}
    return server_argv(python, "vllm", target, port, dtype, max_len, spec,
                       ["--kv-transfer-config", json.dumps(connector), "--no-enable-prefix-caching", *extra])


def feature_server_env() -> dict[str, str]:
    """`server_env()` with the connector's folder first on the engine's PYTHONPATH."""
    env = server_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(connector_dir()), env.get("PYTHONPATH"))))
    return env


class EngineFeatures:
    """Features of token rows from a running feature server (`feature_server_argv`): what `TargetModel.features`
    returns, [b, S, K*H] in `dtype`, zero at padding. Rows go to the engine `workers` at a time, so it batches them."""

    def __init__(self, server: Server, layer_ids: Sequence[int], hidden_size: int, dtype: torch.dtype,
                 timeout_s: float = 120.0, workers: int = 4) -> None:
        self.server, self.layer_ids, self.hidden_size, self.dtype = server, list(layer_ids), hidden_size, dtype
        self.timeout_s, self.workers = timeout_s, workers

    def row(self, ids: Sequence[int]) -> torch.Tensor:
        """One row's features [n, K*H], read from the file the engine wrote and checked; the file is deleted."""
        from safetensors.torch import load_file

        answer = self.server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(ids), "max_tokens": 1,
                                                      "temperature": 0.0})
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError("the engine answered without a hidden-states path: it is not serving with blockdraft's "
                              "feature connector (start it with feature_server_argv)")
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(path):
            if self.server.proc.poll() is not None:
                raise EngineError(f"the engine exited with status {self.server.proc.returncode} before writing the "
                                  f"features of a {len(ids)}-token row; {self.server.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"the engine wrote no features for a {len(ids)}-token row within "
                                  f"{self.timeout_s:.0f} s; {self.server.log_tail()}")
            time.sleep(POLL_S)
        try:
            data = load_file(path)
        finally:
            for leftover in (path, path + ".lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        hidden, tokens = data.get("hidden_states"), data.get("token_ids")
        k, h = len(self.layer_ids), self.hidden_size
        if hidden is None or tokens is None or tuple(hidden.shape) != (len(ids), k, h):
            shape = None if hidden is None else tuple(hidden.shape)
            raise EngineError(f"the engine's features for a {len(ids)}-token row have shape {shape}, not "
                              f"{(len(ids), k, h)} (tokens x layers {self.layer_ids} x hidden): it serves other "
                              "layers or another model")
        if tokens.tolist() != list(ids):
            raise EngineError(f"the engine's features are of other tokens than the row's ({len(ids)} tokens): the "
                              "files of two requests were mixed up")
        if hidden.dtype != self.dtype:
            raise EngineError(f"the engine's features are {hidden.dtype}, the target runs in {self.dtype}: serve it "
                              "with --dtype matching target.dtype")
        if not torch.isfinite(hidden).all():
            raise EngineError(f"the engine's features of a {len(ids)}-token row hold NaN or infinite values")
        return hidden.reshape(len(ids), k * h)

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, S] (right-padded, `attention_mask` marking the real tokens) -> [b, S, K*H]."""
        b, s = input_ids.shape
        lengths = attention_mask.sum(dim=1).tolist() if attention_mask is not None else [s] * b
        rows = [input_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]
        out = torch.zeros(b, s, len(self.layer_ids) * self.hidden_size, dtype=self.dtype)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for i, feats in enumerate(pool.map(self.row, rows)):
                out[i, : feats.shape[0]] = feats
        return out.to(input_ids.device)


class EngineTarget:
    """What the trainer asks of its target (`TargetModel`'s `features`, `shape`, `layer_ids`), answered by a feature
    server: the target's weights never load in the trainer. Its final hidden states (distillation) and packed rows are
    refused by the config; `model` is None, so the checks that run the target themselves (target agreement, decoded
    checkpoints) are skipped and said so."""

    model = None
    packs_in_one_forward = False

    def __init__(self, features: EngineFeatures, shape: TargetShape) -> None:
        self.engine, self.shape, self.layer_ids = features, shape, features.layer_ids

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert position_ids is None, "train.packing is refused with train.target_engine = 'vllm'"
        return self.engine.features(input_ids, attention_mask)

    def features_and_final(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("train.distill_weight is refused with train.target_engine = 'vllm'")


@contextlib.contextmanager
def features_dir(configured: str | None) -> Iterator[Path]:
    """A folder for the engine's feature files for the duration of the block: `configured`, else a new one in /dev/shm
    (memory, on Linux) or the temporary folder, removed at the end. Files are deleted as they are read, so it holds the
    rows in flight only."""
    import tempfile

    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        yield Path(configured)
        return
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="blockdraft-features-", dir=shm if shm.is_dir() else None) as made:
        yield Path(made)


@contextlib.contextmanager
def feature_server(tc: TrainConfig, target: TargetConfig, eval_cfg: EvalConfig, layer_ids: Sequence[int],
                   hidden_size: int, dtype: str, workdir: Path, reporter: Reporter) -> Iterator[EngineFeatures]:
    """The engine's features for the duration of the block: a server started here in eval.engine_python's environment
    with train.engine_args, stopped however the block ends."""
    from blockdraft.engine_process import engine_python, free_port, serving

    torch_dtype = getattr(torch, dtype)
    assert target.path is not None
    python = engine_python(eval_cfg.model_copy(update={"engine": "vllm"}))  # eval.engine says what eval serves
    # room for the longest row and the one token a prefill-only request makes, within the target's own positions
    text = load_target_config(target.path).get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    max_len = min(tc.max_length + 1, int(limit)) if limit else tc.max_length + 1
    with features_dir(tc.engine_features_dir) as folder:
        argv = feature_server_argv(python, target.path, free_port(), dtype, max_len, layer_ids, folder,
                                   tc.engine_args)
        reporter.say(f"starting vLLM to serve the target's features (layers {list(layer_ids)}) into {folder}")
        with serving(argv, workdir, "features", eval_cfg, feature_server_env()) as server:
            yield EngineFeatures(server, layer_ids, hidden_size, torch_dtype, tc.engine_timeout_s)


__all__ = [
    "EngineFeatures", "EngineTarget", "connector_dir", "engine_layer_ids", "feature_server", "feature_server_argv",
    "feature_server_env", "features_dir",
]
