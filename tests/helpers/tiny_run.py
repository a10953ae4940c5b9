"""A tiny-target training output for the eval and export tests that need text prompts: an untrained drafter's checkpoint
whose data lineage is a real tokenize output."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from blockdraft.config import load_config
from blockdraft.fixtures.tiny import TINY_TARGET_DIR
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.model.spec import DrafterSpec
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages.train import resolved_training_config, save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import verify_artifact
from blockdraft.store.inputs import open_input

MASK = json.loads((TINY_TARGET_DIR / "fixture.json").read_text())["mask_token_id"]


def tiny_config(tmp: Path, **sections) -> dict:
    data = {"target": {"path": str(TINY_TARGET_DIR)}, "store": {"url": str(tmp / "store")},
            "dflash": {"architecture": "dflash", "block_size": 4, "mask_token_id": MASK, "num_draft_layers": 1,
                       "gamma": 4.0},
            "tokenize": {"held_out_fraction": 0.0}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def make_tiny_run(tmp: Path, seed: int = 0) -> Path:
    """A training output holding one checkpoint of an untrained drafter for the tiny target, its data a real tokenize
    output of a few of the tiny target's completions (what the model card's lineage reads)."""
    completions = tmp / "completions.jsonl"
    completions.write_text("".join((TINY_TARGET_DIR / "completions.jsonl").read_text().splitlines(keepends=True)[:12]))
    cfg = load_config(None, tiny_config(tmp, train={"data": str(tmp / "tokenized")}))
    tokenize_stage.run(cfg, str(completions), str(tmp / "tokenized"))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DrafterSpec.from_target_config(AutoConfig.from_pretrained(TINY_TARGET_DIR), cfg.dflash))
    data = verify_artifact(open_store(tmp / "tokenized")).manifest.config["tokenize_run"]
    resolved = resolved_training_config(cfg, drafter.spec, str(tmp / "run"), data)
    save_checkpoint(open_store(tmp / "run"), 5, drafter, {}, resolved, [open_input(open_store(tmp / "tokenized")).ref],
                    {"step": 5})
    return tmp / "run"


def write_config(tmp: Path, data: dict) -> Path:
    from blockdraft.pipeline import write_toml

    path = tmp / "blockdraft.toml"
    write_toml(path, data)
    return path
