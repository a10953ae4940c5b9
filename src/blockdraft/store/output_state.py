"""What the destination of a stage's output holds, decided from its manifest alone: the one decision of "done".

`StageOutput.state` (`stage_io`) asks `output_state`; no stage reads its output's manifest to decide for itself. A
manifest that is not this output (another kind, config or key) is redone; one made for this key that verifies is `DONE`,
or `PARTIAL` when its commit recorded failures (the counts field the stage names as `failures`): a rerun retries them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from blockdraft.errors import ArtifactError
from blockdraft.store.artifact import Manifest, State, VerifyReport, manifest_sha256, read_manifest, verify_artifact
from blockdraft.store.base import Store

STAGE_KEY = "stage_key"  # the manifest's config field that names what the output was made from


class Holds(str, Enum):
    """What the destination holds for one stage output."""

    NOTHING = "nothing"  # no manifest, a torn one, or one whose files do not verify
    OTHER = "other"  # another kind, or made for another key (other inputs)
    OTHER_CONFIG = "other config"  # this kind, recorded with another config (`made_with`); its key is never computed
    PARTIAL = "partial"  # this output, verified, committed with failures: a rerun retries what failed
    DONE = "done"  # this output, verified, nothing failed: nothing to do


@dataclass(frozen=True)
class OutputState:
    """`holds`; for PARTIAL and DONE the destination's `report`; for PARTIAL what `failed` (as its counts record it)."""

    holds: Holds
    report: VerifyReport | None = None
    failed: Any = None


def config_value(config: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted `path` ("tokenize_run.config_digest") of a manifest's config; None when absent."""
    value: Any = config
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


@dataclass(frozen=True)
class Expected:
    """What an output made for this run records: its `kind`; the config values `made_with` (dotted path -> value), compared
    before the key; its `key` (computed only then, as it may read the inputs); the counts field that names what `failures`
    its commit had. A copy (push, pull) expects its source's manifest bytes, `copy_of`, instead."""

    kind: str
    key: Callable[[], str]
    made_with: Mapping[str, Any]
    failures: str | None
    copy_of: bytes | None


def _made_for(expected: Expected, manifest: Manifest, sha256: str) -> Holds | None:
    """None when the manifest (whose bytes hash to `sha256`) was made for `expected`, else what it holds instead."""
    if expected.copy_of is not None:
        return None if sha256 == manifest_sha256(expected.copy_of) else Holds.OTHER
    if manifest.kind != expected.kind:
        return Holds.OTHER
    if any(config_value(manifest.config, path) != value for path, value in expected.made_with.items()):
        return Holds.OTHER_CONFIG
    return None if manifest.config.get(STAGE_KEY) == expected.key() else Holds.OTHER


def output_state(store: Store, expected: Expected, verified: VerifyReport | None = None) -> OutputState:
    """What `store` holds for the output `expected` describes (see `Holds`). `verified`: the destination's report when the
    caller has just verified it (resume picking the newest verified checkpoint), so it is not read and verified again."""
    if verified is not None and verified.state is State.VERIFIED and verified.manifest is not None and verified.manifest_sha256:
        manifest, sha256, report = verified.manifest, verified.manifest_sha256, verified
    else:
        try:
            found = read_manifest(store)
        except ArtifactError:  # a torn or foreign manifest: not this output; it is rewritten
            return OutputState(Holds.NOTHING)
        if found is None:
            return OutputState(Holds.NOTHING)
        manifest, sha256, report = found[0], manifest_sha256(found[1]), None
    other = _made_for(expected, manifest, sha256)
    if other is not None:
        return OutputState(other)
    if report is None:
        report = verify_artifact(store)
        if report.state is not State.VERIFIED or report.manifest_sha256 != sha256:
            return OutputState(Holds.NOTHING)
    failed = manifest.counts.get(expected.failures) if expected.failures else None
    return OutputState(Holds.PARTIAL, report, failed) if failed else OutputState(Holds.DONE, report)


def recorded_manifest(store: Store) -> Manifest | None:
    """The manifest at `store` as recorded, not verified (for naming an artifact's kind, or an input's provenance), or
    None when there is none; ArtifactError for one that does not parse. Whether an output is done is `output_state`'s."""
    found = read_manifest(store)
    return None if found is None else found[0]


__all__ = ["STAGE_KEY", "Expected", "Holds", "OutputState", "config_value", "output_state", "recorded_manifest"]
