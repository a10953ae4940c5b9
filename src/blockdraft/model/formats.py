"""What a drafter artifact holds and how a stage finds one: the file names and artifact kinds that training writes and
eval and export read, so that neither reader imports the training stage.

A plain drafter folder (`plain_drafter_folder`: `config.json` + `model.safetensors`, no manifest, e.g. a downloaded
published drafter) is read where it is, by train.init_from and by eval alike.

A checkpoint (`drafter-checkpoint`) and an export (`drafter-export`) both hold the drafter in the z-lab format
(`config.json` + `model.safetensors`); a checkpoint adds the training state and the pinned config, an export its
provenance. A training output holds one checkpoint per `step-NNNNNNNN/` folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from blockdraft.errors import ArtifactError
from blockdraft.model.drafter import CONFIG_NAME, WEIGHTS_NAME
from blockdraft.store import Store
from blockdraft.store.artifact import MANIFEST_NAME, InputRef, Manifest, State, VerifyReport, verify_artifact
from blockdraft.store.inputs import StageInput

CHECKPOINT_KIND = "drafter-checkpoint"
EXPORT_KIND = "drafter-export"
STATE_NAME = "training-state.pt"
PROVENANCE_NAME = "blockdraft-export.json"
PINNED_CONFIG_NAME = "blockdraft-config.json"
# beside an export's drafter: the engines' settings (`export`), what `eval --engine` serves
SERVING_NAME = "serving.json"
STEP_MANIFEST = re.compile(r"^step-(\d{8})/" + re.escape(MANIFEST_NAME) + "$")


def checkpoint_key(step: int) -> str:
    return f"step-{step:08d}"


def trained_on(checkpoint: Manifest) -> list[InputRef]:
    """The training data a checkpoint's manifest pins: its first input (train.data). An input after it is the held-out
    data its figures were measured on (train.eval_data), which the drafter never trained on."""
    return list(checkpoint.lineage[:1])


@dataclass
class Resumable:
    step: int
    store: Store
    report: VerifyReport
    skipped: list[str]

    @property
    def artifact(self) -> StageInput:
        """The checkpoint as a verified input (verified just now: not verified again)."""
        return StageInput(self.store, self.report)


def find_resumable(store: Store) -> Resumable | None:
    """The newest checkpoint under `store` that verifies at the destination, or None; `skipped` names newer ones that
    did not."""
    return search_checkpoints(store)[0]


def checkpoint_steps(store: Store) -> list[int]:
    """The steps of the committed checkpoints under `store` (those with a manifest, verified or not), newest first."""
    return sorted({int(m.group(1)) for info in store.list("step-") if (m := STEP_MANIFEST.match(info.key))},
                  reverse=True)


def search_checkpoints(store: Store) -> tuple[Resumable | None, list[str]]:
    """(the newest checkpoint under `store` that verifies, or None; the committed ones newer than it that did not, each
    with its state and problem). A checkpoint without a manifest (a push that never finished) is neither."""
    skipped = []
    for step in checkpoint_steps(store):
        child = store.child(checkpoint_key(step))
        report = verify_artifact(child)
        if report.state is State.VERIFIED and report.manifest is not None and report.manifest.kind == CHECKPOINT_KIND:
            return Resumable(step, child, report, skipped), skipped
        skipped.append(f"{checkpoint_key(step)} ({report.state.value}: {report.summary()})")
    return None, skipped


def plain_drafter_folder(url: str) -> Path | None:
    """The local folder at `url` when it is a plain export-format drafter (config.json, no blockdraft manifest), else
    None."""
    if "://" in url and not url.startswith("file://"):
        return None
    local = Path(url.removeprefix("file://"))
    if local.is_dir() and (local / CONFIG_NAME).is_file() and not (local / MANIFEST_NAME).exists():
        return local.absolute()
    return None


def open_drafter_artifact(store: Store) -> StageInput:
    """The verified drafter at `store`: a checkpoint or an export there, else the newest verified step-* checkpoint of a
    training output there. Raises ArtifactError naming what was found instead."""
    report = verify_artifact(store)
    if report.state is State.VERIFIED and report.manifest is not None:
        if report.manifest.kind not in (CHECKPOINT_KIND, EXPORT_KIND):
            raise ArtifactError(
                f"{store.url} is a '{report.manifest.kind}' artifact, not a drafter checkpoint or export; pass a "
                "training checkpoint, a training output or an export"
            )
        return StageInput(store, report)
    if report.state is State.INCOMPLETE and not report.problems:
        found = find_resumable(store)
        if found is not None:
            return found.artifact
    raise ArtifactError(
        f"{store.url} is not a verified checkpoint ({report.state.value}: {report.summary()}) and holds no verified "
        "step-* checkpoint; pass a checkpoint, training output or export that `blockdraft verify` reports as verified"
    )


__all__ = [
    "CHECKPOINT_KIND", "CONFIG_NAME", "EXPORT_KIND", "PINNED_CONFIG_NAME", "PROVENANCE_NAME", "SERVING_NAME",
    "STATE_NAME", "WEIGHTS_NAME",
    "Resumable", "checkpoint_key", "checkpoint_steps", "find_resumable", "open_drafter_artifact",
    "plain_drafter_folder", "search_checkpoints", "trained_on",
]
