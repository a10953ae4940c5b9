"""train.log_dir: the local folder of one run's metrics log, curves, trackers' files and pulled-data cache.

It is checked before anything loads, like train.output: it must be a folder this process can write, and lie neither in
the run's input or output nor inside any artifact (its files would change an artifact that verified, or be read as
data). A log folder belongs to one run: the first run to write it records who it is in `blockdraft-log.json` (the
run identity's digest and its train.output), a rerun of that run (a resume, `--force`) continues it, and any other run
is refused with one line naming the run that owns it, so no run replaces another's metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from blockdraft.errors import ConfigError, safe_url
from blockdraft.stages.train.metrics import METRICS_NAME
from blockdraft.store import Store
from blockdraft.store.manifest import MANIFEST_NAME

OWNER_NAME = "blockdraft-log.json"
OWNER_FORMAT = "blockdraft-log/1"
_FIX = "set train.log_dir to a folder of this run's own"


def check_log_dir(log_dir: str, places: dict[str, Store]) -> Path:
    """The log folder `log_dir` (absolute), created when missing; ConfigError (one line) when it is a file, cannot be
    written, lies inside one of `places` ({"train.data": store, "train.output": store}: where the run reads and writes)
    or inside an artifact."""
    folder = Path(log_dir).expanduser().absolute()
    real = folder.resolve()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"train.log_dir {folder} is a file, not a folder; {_FIX}")
    for role, store in places.items():
        local = store.local_path()
        if local is not None and real.is_relative_to(root := local.resolve()):
            where = f"is {role}" if real == root else f"lies inside {role} {root}"
            raise ConfigError(f"train.log_dir {folder} {where}: the run's metrics and curves would be written into it; {_FIX}")
    if (artifact := _artifact_holding(real)) is not None:
        raise ConfigError(f"train.log_dir {folder} lies inside the artifact at {artifact}: writing there would change files "
                          f"that verified; {_FIX}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"train.log_dir {folder} cannot be written ({exc.strerror or exc}); {_FIX}, one this user may "
                          "write") from None
    return folder


def _artifact_holding(path: Path) -> Path | None:
    """The nearest folder at or above `path` that holds an artifact's manifest, or None."""
    return next((p for p in (path, *path.parents) if (p / MANIFEST_NAME).is_file()), None)


def log_owner(identity: dict[str, Any], output_url: str) -> dict[str, str]:
    """What a log folder records about the run that writes it: the digest of its run identity and its train.output."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return {"format": OWNER_FORMAT, "run": digest, "output": safe_url(output_url)}


def claim_log_dir(folder: Path, identity: dict[str, Any], output_url: str) -> Path:
    """Make `folder` this run's log folder (rank 0, before the first entry is written): record the owner when there is
    none yet; ConfigError when another run owns it, or when it holds a metrics log that records no owner. Returns the
    metrics log's path (absolute), which the run names at start."""
    folder = folder.absolute()
    owner, mine = folder / OWNER_NAME, log_owner(identity, output_url)
    if owner.is_file():
        try:
            recorded = json.loads(owner.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"train.log_dir {folder}: {OWNER_NAME} is unreadable ({exc}); {_FIX}, or delete {folder}") from None
        if recorded == mine:
            return folder / METRICS_NAME
        if not isinstance(recorded, dict) or recorded.get("format") != OWNER_FORMAT:
            raise ConfigError(f"train.log_dir {folder} is a log folder of format {recorded.get('format') if isinstance(recorded, dict) else None}, "
                              f"this blockdraft writes {OWNER_FORMAT}; {_FIX}, or delete {folder}")
        other = "the same train.output with another run identity (settings, data or target)" if (
            recorded.get("output") == mine["output"]) else f"train.output {recorded.get('output')}"
        raise ConfigError(f"train.log_dir {folder} holds the metrics of another run ({other}); a log folder belongs to one "
                          f"run: {_FIX}, or delete {folder} to reuse it")
    if (folder / METRICS_NAME).exists():
        raise ConfigError(f"train.log_dir {folder} holds a {METRICS_NAME} that no run recorded as its own ({OWNER_NAME} is "
                          f"missing); {_FIX}, or delete {folder} to reuse it")
    partial = owner.with_name(owner.name + ".partial")
    partial.write_text(json.dumps(mine, indent=2) + "\n")
    os.replace(partial, owner)
    return folder / METRICS_NAME


__all__ = ["OWNER_FORMAT", "OWNER_NAME", "check_log_dir", "claim_log_dir", "log_owner"]
