"""The target's features read from a vLLM engine that serves it, instead of the trainer's own forward: the way to a
target that an inference engine spreads over devices and nodes (tensor, pipeline, data and expert parallelism).

vLLM serves the target with its `extract_hidden_states` method and blockdraft's connector (`blockdraft.vllm_connector`):
a prompt sent for prefill (one new token) leaves the hidden states of the requested layers in a safetensors file whose
path comes back with the answer. Layer id i here (the output of decoder layer i) is vLLM's id i + 1 (its 0 is the
embeddings). Every file is checked (what its metadata says the engine serves, the row's own token ids, its shape, dtype
and finite values) and deleted once read. Train starts the engine itself (`feature_server`), or uses one started with
`blockdraft features-server` at target.engine.url.
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

from blockdraft.config import BlockdraftConfig, EvalConfig, TargetConfig, TrainConfig
from blockdraft.engine_process import SERVED_NAME, Endpoint, server_argv, server_env
from blockdraft.errors import EngineError, redact
from blockdraft.model.spec import DrafterSpec, TargetShape
from blockdraft.model.target import load_target_config, target_dtype
from blockdraft.reporter import Reporter

CONNECTOR = "BlockdraftFeaturesConnector"
CONNECTOR_MODULE = "blockdraft_features"
FEATURES_FORMAT = "blockdraft-features/1"  # what the connector writes in each file's metadata
POLL_S = 0.005


def connector_dir() -> Path:
    """The folder the engine's Python imports the connector module from (it does not have blockdraft installed)."""
    from blockdraft import vllm_connector

    return Path(vllm_connector.__file__).parent


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's ids of the outputs of decoder layers `layer_ids`: its id 0 is the embeddings, so layer i is id i + 1."""
    return [i + 1 for i in layer_ids]


def feature_server_argv(python: Path, target: str, port: int, dtype: str, max_len: int | None,
                        layer_ids: Sequence[int], features_dir: Path, extra: Sequence[str] = (),
                        host: str = "127.0.0.1") -> list[str]:
    """The command line that serves `target` on `host`:`port` writing the hidden states of `layer_ids` for each request
    into `features_dir`; prefix caching is off, so every prompt's every token is computed (and saved)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layer_ids)}}}
    connector = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(features_dir)}}
    return server_argv(python, "vllm", target, port, dtype, max_len, spec,
                       ["--kv-transfer-config", json.dumps(connector), "--no-enable-prefix-caching", *extra], host)


def feature_server_env() -> dict[str, str]:
    """`server_env()` with the connector's folder first on the engine's PYTHONPATH."""
    env = server_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(connector_dir()), env.get("PYTHONPATH"))))
    return env


def served_rows_limit(target: TargetConfig, max_length: int) -> int:
    """The engine's --max-model-len: room for the longest row and the one token a prefill-only request makes, within
    the target's own positions."""
    assert target.path is not None
    limit = getattr(load_target_config(target.path).get_text_config(), "max_position_embeddings", None)
    return min(max_length + 1, int(limit)) if limit else max_length + 1


def features_server_command(config: BlockdraftConfig, host: str, port: int,
                            features_dir: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a feature server for `config`'s target and drafter, as train starts one, on `host`:`port`
    with its parallel sizes and args from [target.engine]: what `blockdraft features-server` runs, for an engine that
    train reaches at target.engine.url."""
    from blockdraft.engine_process import engine_python

    if config.target.path is None:
        raise EngineError("target.path is not set: the feature server serves the target; set it in the config")
    target_config = load_target_config(config.target.path)
    spec = DrafterSpec.from_target_config(target_config, config.dflash)
    python = engine_python(config.eval.model_copy(update={"engine": "vllm"}))  # eval.engine says what eval serves
    engine = config.target.engine.model_copy(update={"url": None})
    argv = feature_server_argv(python, config.target.path, port, target_dtype(config.target.dtype, target_config),
                               served_rows_limit(config.target, config.train.max_length), spec.target_layer_ids,
                               features_dir, engine.launch_args(), host)
    return argv, feature_server_env()


class EngineFeatures:
    """Features of token rows from a running feature server (`feature_server_argv`) serving `model`: what
    `TargetModel.features` returns, [b, S, K*H] in `dtype`, zero at padding. Rows go to the engine `workers` at a time,
    so it batches them. `read_from`: the folder where this machine sees the engine's files (each file's name taken from
    the path the engine answers); None: that path as it is."""

    def __init__(self, server: Endpoint, layer_ids: Sequence[int], hidden_size: int, dtype: torch.dtype,
                 timeout_s: float = 120.0, workers: int = 4, model: str = SERVED_NAME,
                 read_from: Path | None = None) -> None:
        self.server, self.layer_ids, self.hidden_size, self.dtype = server, list(layer_ids), hidden_size, dtype
        self.timeout_s, self.workers, self.model, self.read_from = timeout_s, workers, model, read_from

    def row(self, ids: Sequence[int]) -> torch.Tensor:
        """One row's features [n, K*H], read from the file the engine wrote and checked; the file is deleted."""
        answer = self.server.post("/v1/completions", {"model": self.model, "prompt": list(ids), "max_tokens": 1,
                                                      "temperature": 0.0})
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError("the engine answered without a hidden-states path: it is not serving with blockdraft's "
                              "feature connector (start it with `blockdraft features-server`)")
        if self.read_from is not None:
            path = str(self.read_from / os.path.basename(path))
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(path):
            if (status := self.server.exit_status()) is not None:
                raise EngineError(f"the engine exited with status {status} before writing the features of a "
                                  f"{len(ids)}-token row; {self.server.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"the engine wrote no features for a {len(ids)}-token row at {path} within "
                                  f"{self.timeout_s:.0f} s (target.engine.timeout_s): it stalled, or this machine "
                                  "does not see its features folder (target.engine.features_dir: where this machine "
                                  f"sees the folder the engine writes to); {self.server.log_tail()}")
            time.sleep(POLL_S)
        try:
            hidden, tokens, metadata = read_features(path)
        finally:
            for leftover in (path, path + ".lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        self.check_served(metadata)
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

    def check_served(self, metadata: dict[str, str]) -> None:
        """EngineError when a file's metadata says the engine serves other layers, with prefix caching, or is not
        blockdraft's connector: an engine started by hand with other settings."""
        fix = "start it with `blockdraft features-server` and this config"
        if metadata.get("format") != FEATURES_FORMAT:
            raise EngineError(f"the engine's feature file says format {metadata.get('format')!r}, not "
                              f"{FEATURES_FORMAT!r}: it is not written by this version's feature connector; {fix}")
        served = json.loads(metadata.get("layer_ids", "[]"))
        if served != engine_layer_ids(self.layer_ids):
            raise EngineError(f"the engine captures vLLM layers {served} and the drafter reads the target's layers "
                              f"{self.layer_ids} (vLLM's {engine_layer_ids(self.layer_ids)}): its features would be "
                              f"of other layers; {fix}")
        if json.loads(metadata.get("prefix_caching", "false")):
            raise EngineError(f"the engine serves with prefix caching on, which blockdraft's features are not checked "
                              f"with; {fix} (it passes --no-enable-prefix-caching)")
        if metadata.get("hidden_size") not in (None, "", str(self.hidden_size)):
            raise EngineError(f"the engine serves a model of hidden size {metadata['hidden_size']}, and the target at "
                              f"target.path has {self.hidden_size}: it serves another model; {fix}")

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


def read_features(path: str) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, str]]:
    """(hidden_states, token_ids, metadata) of a feature file; EngineError naming it when it is not readable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            get = {name: f.get_tensor(name) for name in ("hidden_states", "token_ids") if name in names}
            return get.get("hidden_states"), get.get("token_ids"), dict(f.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise EngineError(f"the engine's feature file {path} is not a readable safetensors file ({exc})") from None


def served_model(endpoint: Endpoint) -> str:
    """The one model an engine started elsewhere serves (its /v1/models)."""
    try:
        models = [m["id"] for m in json.loads(endpoint.get_text("/v1/models"))["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"the engine at {redact(endpoint.url)} answered /v1/models with no model list ({exc!r}): "
                          "target.engine.url must name a vLLM server") from None
    if len(models) != 1:
        raise EngineError(f"the engine at {redact(endpoint.url)} serves {len(models)} models ({models}); serve the "
                          "target alone with `blockdraft features-server`")
    return models[0]


@contextlib.contextmanager
def feature_server(tc: TrainConfig, target: TargetConfig, eval_cfg: EvalConfig, layer_ids: Sequence[int],
                   hidden_size: int, dtype: str, workdir: Path, reporter: Reporter) -> Iterator[EngineFeatures]:
    """The engine's features for the duration of the block: from the engine at target.engine.url, or from a server
    started here in eval.engine_python's environment as [target.engine] says, stopped however the block ends."""
    from blockdraft.engine_process import engine_python, free_port, serving

    engine, torch_dtype = target.engine, getattr(torch, dtype)
    if engine.url is not None:
        endpoint = Endpoint(engine.url)
        endpoint.wait_healthy(engine.timeout_s, "target.engine.timeout_s")
        model = served_model(endpoint)
        read_from = Path(engine.features_dir) if engine.features_dir else None
        reporter.say(f"reading the target's features (layers {list(layer_ids)}) from the engine at "
                     f"{redact(engine.url)}, serving {model!r}")
        yield EngineFeatures(endpoint, layer_ids, hidden_size, torch_dtype, engine.timeout_s, model=model,
                             read_from=read_from)
        return
    assert target.path is not None
    python = engine_python(eval_cfg.model_copy(update={"engine": "vllm"}))  # eval.engine says what eval serves
    with features_dir(engine.features_dir) as folder:
        argv = feature_server_argv(python, target.path, free_port(), dtype, served_rows_limit(target, tc.max_length),
                                   layer_ids, folder, engine.launch_args())
        reporter.say(f"starting vLLM to serve the target's features (layers {list(layer_ids)}) into {folder}")
        with serving(argv, workdir, "features", eval_cfg, feature_server_env()) as server:
            yield EngineFeatures(server, layer_ids, hidden_size, torch_dtype, engine.timeout_s)


__all__ = [
    "FEATURES_FORMAT", "EngineFeatures", "EngineTarget", "connector_dir", "engine_layer_ids", "feature_server",
    "feature_server_argv", "feature_server_env", "features_dir", "features_server_command", "read_features",
    "served_model", "served_rows_limit",
]
