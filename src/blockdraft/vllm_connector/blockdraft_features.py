"""A vLLM KV connector that saves each finished request's target hidden states to a safetensors file, on any device.

vLLM's `extract_hidden_states` speculative method writes the hidden states of the layers named in
`eagle_aux_hidden_state_layer_ids` into a cache of their own as the prompt is prefilled; its example connector then
copies them out through CUDA streams, events and pinned memory, which vLLM's CPU build has none of. This connector keeps
that connector's protocol (a file per request, `<storage>/<request id>.safetensors`, its path returned in the request's
`kv_transfer_params["hidden_states_path"]`, a `.lock` beside it held until the file is whole) and copies the rows with
plain indexing, synchronously, when vLLM reports the request finished. The file appears under its final name only once
written (`.part`, then a rename), so a reader may also wait for the name.

Each file's safetensors metadata says what the engine serves (`file_metadata`): the format, the layer ids it
captures (vLLM's, 0 the embeddings), whether prefix caching is on, and the served model's layer count and hidden size,
so a reader refuses an engine started with other settings than it needs, even one it did not start.

Runs inside vLLM's process only: it imports vLLM, torch and safetensors, never blockdraft (the engine's Python does not
have it). blockdraft puts this folder on the engine's PYTHONPATH and names the class by `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

log = logging.getLogger(__name__)
FORMAT = "blockdraft-features/1"  # what the reader (blockdraft.stages.train.engine_features) accepts


class BlockdraftFeaturesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector's files, written without CUDA: see the module's docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._saved: set[str] = set()  # requests whose file is written (or failed), not yet reported finished
        self._metadata = file_metadata(self._vllm_config)

    def _rows(self, pending: PendingSave) -> torch.Tensor:
        """The request's rows of the hidden-state cache, in token order: [tokens, layers, hidden]."""
        assert self._kv_cache is not None, "register_kv_caches runs before any request"
        size = self._block_size
        tokens = int(pending.token_ids.shape[0])
        blocks = torch.as_tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * size + torch.arange(size, dtype=torch.long)[None, :]).flatten()[:tokens]
        if slots.numel() < tokens:
            raise RuntimeError(f"{tokens} prompt tokens but {slots.numel()} cached slots")
        slots = slots.to(self._kv_cache.device)
        return self._kv_cache[slots // size, :, slots % size].to("cpu").contiguous()

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        lock = self._lock_fds.pop(pending.req_id, None)
        if lock is None and self.use_lock:
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            lock = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            tensors = {"hidden_states": self._rows(pending), "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            save_file(tensors, pending.filename + ".part", metadata=self._metadata)
            os.replace(pending.filename + ".part", pending.filename)
        except Exception:  # the request's cache blocks are freed either way; the reader finds no file and says so
            log.exception("hidden states of request %s not written to %s", pending.req_id, pending.filename)
        finally:
            if lock is not None:
                os.close(lock)  # releases the lock a reader waits on
            self._saved.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._accumulated_finished_req_ids):
            self._accumulated_finished_req_ids.discard(req_id)
            if req_id in self._saved:
                self._saved.discard(req_id)
                done.add(req_id)
            lock = self._lock_fds.pop(req_id, None)  # a request aborted before its save
            if lock is not None:
                os.close(lock)
        return done or None, None


def file_metadata(vllm_config) -> dict[str, str]:
    """What every file says of the engine that wrote it (string values: safetensors metadata is text)."""
    spec = vllm_config.speculative_config.draft_model_config.hf_config
    text = vllm_config.model_config.hf_text_config
    return {
        "format": FORMAT,
        "layer_ids": json.dumps(list(getattr(spec, "eagle_aux_hidden_state_layer_ids", []))),
        "prefix_caching": json.dumps(bool(vllm_config.cache_config.enable_prefix_caching)),
        "num_hidden_layers": str(getattr(text, "num_hidden_layers", "")),
        "hidden_size": str(getattr(text, "hidden_size", "")),
    }
