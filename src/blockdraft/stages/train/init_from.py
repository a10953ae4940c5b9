"""`train.init_from`: start training from a drafter in the export format (a published drafter, an export, a checkpoint
or a training output) instead of random weights.

The drafter must be one this run would build: its mask id, target layer ids, block size, layer kinds and window, target
layer count and hidden size agree with the config and the target (one ConfigError or SpecError line per disagreement).
Its other shapes (heads, MLP width) and its RoPE are taken from it, unless the config sets them otherwise.

Architectures: a DFlash drafter starts a DFlash or a DFlash2 run. Into DFlash2, its tensors are the DFlash2 drafter's
backbone and the DFlash2 modules keep their own initialisation: the convolutions start as the identity, so the first
forward is the DFlash drafter's, and the selector starts from its codebooks' initialisation. A DFlash2 drafter starts only
a DFlash2 run with its own DFlash2 settings (taps, groups, rank, top-K, scales: one ConfigError line per disagreement).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from blockdraft.config import DFlashConfig, StoreConfig
from blockdraft.errors import ConfigError
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.formats import CONFIG_NAME, WEIGHTS_NAME, open_drafter_artifact
from blockdraft.model.spec import DrafterSpec
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME

# (spec field, what the config calls it): must equal what this run derives from the config and the target.
_PINNED = (
    ("num_layers", "dflash.num_draft_layers"),
    ("mask_token_id", "dflash.mask_token_id"),
    ("target_layer_ids", "dflash.target_layer_ids"),
    ("block_size", "dflash.block_size"),
    ("layer_types", "dflash.layer_types"),
    ("sliding_window", "dflash.sliding_window"),
    ("num_target_layers", "the target's layer count"),
    ("hidden_size", "the target's hidden_size"),
)
# Shapes the config may leave unset (None: take the drafter's); set, they must agree.
_OPTIONAL = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def load_init_drafter(init_from: str, store_config: StoreConfig | None) -> DFlashDrafter:
    """The drafter at `init_from` in fp32: a plain local export-format folder (config.json + model.safetensors, e.g. a
    downloaded published drafter), else a verified drafter artifact at that folder or store URL."""
    local = Path(init_from.removeprefix("file://"))
    if local.is_dir() and (local / CONFIG_NAME).is_file() and not (local / MANIFEST_NAME).exists():
        return DFlashDrafter.from_pretrained(local).float()
    artifact = open_drafter_artifact(open_store(init_from, store_config))
    with tempfile.TemporaryDirectory(prefix="blockdraft-init-") as tmp:
        return DFlashDrafter.from_pretrained(artifact.fetch([CONFIG_NAME, WEIGHTS_NAME], Path(tmp))).float()


def check_init_spec(init: DrafterSpec, derived: DrafterSpec, dflash: DFlashConfig, hf_target_config: Any, source: str) -> DrafterSpec:
    """The spec to train with: `init`'s, with this run's gamma, after checking it against `derived` (what the config and
    the target give) and the target itself. Raises ConfigError naming the first field that disagrees."""
    for name, where in _PINNED:
        ours, theirs = getattr(derived, name), getattr(init, name)
        if ours != theirs:
            raise ConfigError(
                f"train.init_from {source} has {name} {theirs} but {where} gives {ours}; set it to the drafter's value or "
                "start from another drafter"
            )
    for name in _OPTIONAL:
        ours = getattr(dflash, name)
        if ours is not None and ours != getattr(init, name):
            raise ConfigError(
                f"train.init_from {source} has {name} {getattr(init, name)} but dflash.{name} is {ours}; unset it or set "
                "it to the drafter's value"
            )
    if init.dflash2 is not None and derived.dflash2 is None:
        raise ConfigError(
            f"train.init_from {source} is a DFlash2 drafter but dflash.architecture is 'dflash'; set dflash.architecture = "
            '"dflash2" or start from a DFlash drafter'
        )
    if init.dflash2 is not None and derived.dflash2 is not None:
        for name in (f.name for f in dataclasses.fields(init.dflash2)):
            ours, theirs = getattr(derived.dflash2, name), getattr(init.dflash2, name)
            if ours != theirs:
                raise ConfigError(
                    f"train.init_from {source} has {name} {theirs} but dflash.{name} is {ours}; set it to the drafter's value or "
                    "start from another drafter"
                )
    init.check_target(hf_target_config)
    return dataclasses.replace(init, gamma=derived.gamma, dflash2=derived.dflash2)


def load_init_weights(drafter: DFlashDrafter, init: DFlashDrafter) -> None:
    """Copy `init`'s tensors into `drafter` (built from `check_init_spec`'s spec): all of them for the same architecture;
    from a DFlash drafter into a DFlash2 one, every tensor but the convolutions' and the selector's, which stay as
    `drafter` initialised them. Strict otherwise: a missing or extra tensor raises."""
    missing, unexpected = drafter.load_state_dict(init.state_dict(), strict=init.spec.architecture == drafter.spec.architecture)
    own = [name for name in missing if not _dflash2_only(name)]
    if own or unexpected:
        raise ConfigError(f"train.init_from: the drafter's tensors do not fit this run's drafter (missing {own[:3]}, unexpected {unexpected[:3]})")


def _dflash2_only(name: str) -> bool:
    """Whether a tensor is one of DFlash2's modules (a DFlash drafter has none)."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


__all__ = ["check_init_spec", "load_init_drafter", "load_init_weights"]
