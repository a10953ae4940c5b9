"""The DFlash drafter, its spec (defaults from the target's config) and the frozen-target wrappers."""

from blockdraft.errors import SpecError
from blockdraft.model.drafter import DFlashDrafter, DraftCache, draft_step
from blockdraft.model.spec import DrafterSpec, default_gamma, default_layer_ids
from blockdraft.model.target import TargetHead, TargetModel, load_target

__all__ = [
    "DFlashDrafter",
    "DraftCache",
    "DrafterSpec",
    "SpecError",
    "TargetHead",
    "TargetModel",
    "default_gamma",
    "default_layer_ids",
    "draft_step",
    "load_target",
]
