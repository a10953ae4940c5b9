"""Training checkpoints as artifacts: written locally, pushed, verified at the destination, committed last.

Layout under the run's output store: `step-00000500/` per checkpoint, each its own artifact holding the drafter in the
export format (`config.json`, `model.safetensors`), `training-state.pt` (optimizer, scheduler, RNG states, data
position), the resolved config (`blockdraft-config.json`), and the metrics so far. Resume reads only checkpoints that
verify; one whose push never completed (no manifest) or whose files differ is skipped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockdraft.model.formats import CHECKPOINT_KIND, PINNED_CONFIG_NAME, STATE_NAME, STEP_MANIFEST, Resumable, checkpoint_key
from blockdraft.store import Store
from blockdraft.store.artifact import (
    InputRef,
    State,
    VerifyReport,
    publish_artifact,
    uncommit,
    verify_artifact,
)


def save_checkpoint(
    store: Store,
    step: int,
    drafter: torch.nn.Module,
    training_state: dict[str, Any],
    resolved_config: dict[str, Any],
    lineage: Iterable[InputRef],
    counts: dict[str, Any],
    extra_files: Iterable[Path] = (),
) -> VerifyReport:
    """Write, push and commit the checkpoint of `step`; returns the destination's verify report.

    Raises ArtifactError (or the store's error) when the push does not verify: such a checkpoint has no manifest
    and resume never uses it.
    """
    dest = store.child(checkpoint_key(step))
    uncommit(dest)  # a resumed run rewrites checkpoints after its resume point
    with tempfile.TemporaryDirectory(prefix="blockdraft-ckpt-") as tmp:
        root = Path(tmp)
        paths = list(drafter.save_pretrained(root))
        torch.save(training_state, root / STATE_NAME)
        (root / PINNED_CONFIG_NAME).write_text(json.dumps(resolved_config, indent=2, sort_keys=True) + "\n")
        paths += [root / STATE_NAME, root / PINNED_CONFIG_NAME]
        for extra in extra_files:
            if extra.is_file():
                shutil.copyfile(extra, root / extra.name)
                paths.append(root / extra.name)
        return publish_artifact(dest, CHECKPOINT_KIND, root, paths, config=resolved_config, lineage=lineage, counts=counts)


def prune_checkpoints(store: Store, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints that verify; returns the deleted steps.

    Runs only after a new checkpoint verified, so the newest kept one is always resumable. Older checkpoints are
    uncommitted before their files go, so a reader never sees a manifest over missing files.
    """
    steps = sorted({int(m.group(1)) for info in store.list("step-") if (m := STEP_MANIFEST.match(info.key))}, reverse=True)
    kept = 0
    for index, step in enumerate(steps):  # newest first; older than the keep-th verified one goes
        kept += verify_artifact(store.child(checkpoint_key(step))).state is State.VERIFIED
        if kept == keep:
            doomed = steps[index + 1 :]
            break
    else:
        return []
    for step in doomed:
        child = store.child(checkpoint_key(step))
        uncommit(child)
        for info in list(child.list()):
            child.delete(info.key)
    return doomed


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back into memory; `folder` stays valid until `close()`."""

    folder: Path
    drafter_state: dict[str, torch.Tensor]
    training_state: dict[str, Any]
    config: dict[str, Any]
    _tmp: Path | None = None

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def load_checkpoint(found: Resumable, settings: object | None = None) -> LoadedCheckpoint:
    """Read a verified checkpoint, pulling it (checksums recomputed) from a remote store; `settings` is the StoreConfig."""
    from safetensors.torch import load_file

    folder = found.store.local_path()
    tmp = None
    if folder is None:
        from blockdraft.store.transfer import pull

        tmp = Path(tempfile.mkdtemp(prefix="blockdraft-resume-"))
        pull(found.store.url, tmp, settings)
        folder = tmp
    return LoadedCheckpoint(
        folder=folder,
        drafter_state=load_file(str(folder / "model.safetensors")),
        training_state=torch.load(folder / STATE_NAME, weights_only=True),
        config=json.loads((folder / PINNED_CONFIG_NAME).read_text()),
        _tmp=tmp,
    )


__all__ = ["LoadedCheckpoint", "load_checkpoint", "prune_checkpoints", "save_checkpoint"]
