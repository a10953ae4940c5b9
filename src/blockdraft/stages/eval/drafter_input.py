"""The drafter eval runs: a verified checkpoint, training output or export, opened through the one input reader, and
refused when what it was trained with (DFlash settings, chat template) contradicts the config given; or a plain local
folder in the export format (a published DFlash or DFlash2 drafter), pinned as a folder (every file in it, by content:
`status` checks it again) and checked against the target only, as `eval.baseline` is."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.config import BlockdraftConfig, DFlashConfig, StoreConfig, TargetConfig
from blockdraft.data.tokenizer import resolve_tokenizer
from blockdraft.errors import ArtifactError, ConfigError, EvalError
from blockdraft.model.formats import (
    CHECKPOINT_KIND,
    CONFIG_NAME,
    EXPORT_KIND,
    PINNED_CONFIG_NAME,
    PROVENANCE_NAME,
    WEIGHTS_NAME,
    open_drafter_artifact,
    plain_drafter_folder,
)
from blockdraft.model.spec import TargetShape, default_layer_ids
from blockdraft.store import open_store
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import StageInput
from blockdraft.store.manifest import folder_input


@dataclass
class Checkpoint:
    """A verified checkpoint or export: its small files read, its weights fetched only when `fetch_weights` is called.
    Or (`artifact` None) a plain export-format folder at `workdir`, which has no pinned config and no training data."""

    artifact: StageInput | None
    workdir: Path  # where a remote drafter's files are fetched to; a plain folder's own path
    pinned: dict[str, Any]  # the resolved config the drafter was trained with
    export_config: dict[str, Any]  # the drafter's config.json
    template_sha256: str | None  # of the chat template its training rows were rendered with, from the data's manifest
    plain_ref: InputRef | None = None  # a plain folder's pin: every file in it, by content (`folder_input`)

    @property
    def is_plain(self) -> bool:
        return self.artifact is None

    @property
    def url(self) -> str:
        return str(self.workdir) if self.artifact is None else self.artifact.store.url

    @property
    def ref(self) -> InputRef:
        if self.artifact is None:
            assert self.plain_ref is not None, "a plain folder is pinned when opened"
            return self.plain_ref
        return self.artifact.ref

    def fetch_weights(self) -> Path:
        """The folder that holds the drafter (config.json + weights), its weights fetched with checksums when remote."""
        if self.artifact is None:
            return self.workdir
        return self.artifact.fetch([WEIGHTS_NAME], self.workdir)  # config.json is there since `open_checkpoint`


def drafter_folder_sha256(folder: str | Path, role: str) -> str:
    """sha256 over a drafter folder's config.json and weights, so a changed one is a new eval; ArtifactError when one is
    missing."""
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        path = Path(folder) / name
        if not path.is_file():
            raise ArtifactError(f"{role} {folder} has no {name}; give a drafter folder in the export format")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def open_checkpoint(url: str, store: StoreConfig, workdir: Path) -> Checkpoint:
    """The verified drafter at `url` (folder, file:// or s3://): a training checkpoint, a training run's output (its
    newest verified step-* checkpoint) or an export. Only its config files are fetched here. Raises ArtifactError for
    anything else, EvalError when it lacks a drafter file. A plain export-format folder is read where it is."""
    plain = plain_drafter_folder(url)
    if plain is not None:
        try:
            export_config = json.loads((plain / CONFIG_NAME).read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{plain / CONFIG_NAME} is not readable ({exc}); give a drafter folder in the export "
                                "format") from None
        if not (plain / WEIGHTS_NAME).is_file():
            raise ArtifactError(f"checkpoint {plain} has no {WEIGHTS_NAME}; give a drafter folder in the export format")
        return Checkpoint(None, plain, {}, export_config, None, folder_input(open_store(plain)))
    artifact = open_drafter_artifact(open_store(url, store))
    kind = artifact.kind
    pinned_name = {CHECKPOINT_KIND: PINNED_CONFIG_NAME, EXPORT_KIND: PROVENANCE_NAME}[kind]
    listed = {e.path for e in artifact.manifest.files}
    absent = [n for n in (CONFIG_NAME, WEIGHTS_NAME, pinned_name) if n not in listed]
    if absent:
        raise EvalError(f"{artifact.store.url} lacks {absent[0]}; re-save it with `blockdraft train` or `blockdraft "
                        "export`")
    folder = artifact.fetch([CONFIG_NAME, pinned_name], workdir)
    pinned = json.loads((folder / pinned_name).read_text())
    if kind == EXPORT_KIND:
        pinned = pinned.get("config") or {}
    return Checkpoint(
        artifact=artifact,
        workdir=workdir,
        pinned=pinned,
        export_config=json.loads((folder / CONFIG_NAME).read_text()),
        template_sha256=(pinned.get("data") or {}).get("template_sha256"),
    )


def chat_template_sha256(target: TargetConfig) -> str | None:
    """sha256 of the chat template the [target] section resolves to, computed as the tokenize stage does; None when
    there is none."""
    try:
        source, _ = resolve_tokenizer(target)
    except (ConfigError, OSError, ValueError):
        return None
    return source.template.sha256


def check_checkpoint_matches(cfg: BlockdraftConfig, checkpoint: Checkpoint, hf_config: Any) -> None:
    """Refuse a checkpoint whose pinned DFlash settings or chat template contradict the config given, naming the field.

    Compared: what the given config resolves to for this target (explicit values, else docs/DFLASH.md's defaults)
    against what the drafter was trained with (its config.json, and the resolved config pinned beside it). A field the
    given config leaves unset without a default (mask id) is taken from the checkpoint. Raises EvalError (SpecError when
    the config's own layer ids cannot be derived for this target). A plain folder was not trained with this config: it
    is checked against the target when it loads, as `eval.baseline` is.
    """
    if checkpoint.is_plain:
        return
    trained = _trained_dflash(checkpoint)
    given = {
        "dflash.mask_token_id": cfg.dflash.mask_token_id,
        "dflash.target_layer_ids": _given_layer_ids(cfg.dflash, hf_config),
        "dflash.block_size": cfg.dflash.block_size,
    }
    for field, value in given.items():
        if value is not None and trained[field] is not None and value != trained[field]:
            raise EvalError(
                f"checkpoint {checkpoint.url} was trained with {field} = {trained[field]}, but the config given "
                f"resolves it to {value}; set {field} = {trained[field]} in the config (or evaluate a checkpoint "
                "trained with this config)"
            )
    if checkpoint.template_sha256 is not None:
        given_hash = chat_template_sha256(cfg.target)
        if given_hash is not None and given_hash != checkpoint.template_sha256:
            raise EvalError(
                f"checkpoint {checkpoint.url} was trained on rows rendered with chat template sha256 "
                f"{checkpoint.template_sha256[:12]}, but the config given resolves the template (target.chat_template) "
                f"to sha256 {given_hash[:12]}; set target.chat_template to the template the drafter was trained with"
            )


def _trained_dflash(checkpoint: Checkpoint) -> dict[str, Any]:
    """The DFlash fields the drafter's config.json holds, checked against the config pinned beside it."""
    dflash = checkpoint.export_config.get("dflash_config") or {}
    pinned_dflash = checkpoint.pinned.get("dflash") or {}
    trained = {
        "dflash.mask_token_id": dflash.get("mask_token_id"),
        "dflash.target_layer_ids": dflash.get("target_layer_ids"),
        "dflash.block_size": dflash.get("block_size", checkpoint.export_config.get("block_size")),
    }
    for field, value in trained.items():
        pinned_value = pinned_dflash.get(field.split(".", 1)[1])
        if pinned_value is not None and value is not None and pinned_value != value:
            raise EvalError(
                f"checkpoint {checkpoint.url} is inconsistent: {field} is {pinned_value} in {PINNED_CONFIG_NAME} but "
                f"{value} in the drafter's config.json; re-export the checkpoint"
            )
    return trained


def _given_layer_ids(dflash: DFlashConfig, hf_config: Any) -> list[int]:
    """dflash.target_layer_ids as the config gives them, else the default spread for this target (docs/DFLASH.md)."""
    if dflash.target_layer_ids is not None:
        return list(dflash.target_layer_ids)
    shape = TargetShape.from_config(hf_config)
    return list(default_layer_ids(shape.num_layers, dflash.num_draft_layers))


__all__ = [
    "Checkpoint", "chat_template_sha256", "check_checkpoint_matches", "drafter_folder_sha256", "open_checkpoint",
]
