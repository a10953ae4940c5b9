"""Which eval an export's model card gives: the one `--eval` names (`open_eval`: an eval of this very checkpoint,
measured against this export's target), else the latest verified eval of the checkpoint in the store (`latest_eval`),
found by reading the store's manifests and verifying the candidate there. What the search found is held (`Held`) and
said once the export is written, so a failing export still says its one error line alone.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, BlockdraftError, ExportError, redact_setting, safe_url
from blockdraft.reporter import Reporter
from blockdraft.stages.export.card import EVAL_KIND, EVAL_REPORT_NAME, EvalSource
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import open_input, recorded_manifest
from blockdraft.store.status import find_artifact_roots


class OtherTargetError(ExportError):
    """An eval of the exported checkpoint measured against another target than the export's: its figures are not this
    target's, and the card would give them under this target's `base_model`."""


def open_eval(
    url: str, checkpoint: InputRef, store_config: StoreConfig | None, dest: Path, target: str | None = None
) -> EvalSource:
    """The verified eval artifact at `url` and its report, refused (ExportError) unless it is an eval of `checkpoint`:
    its lineage pins that checkpoint's manifest by sha256; and with `target` (the export's, as it pins it) refused
    (OtherTargetError) unless the report's target is that one (`same_target`)."""
    found = open_input(url, store_config, kinds=[EVAL_KIND], role="eval")
    evaluated = found.manifest.lineage[0] if found.manifest.lineage else None
    if evaluated is None or evaluated.sha256 != checkpoint.sha256:
        of = (
            f"checkpoint {evaluated.url} (manifest sha256 {(evaluated.sha256 or '')[:12]})"
            if evaluated
            else "no checkpoint"
        )
        raise ExportError(
            f"eval {found.store.url} is of {of}, not of the exported checkpoint {checkpoint.url} (manifest sha256 "
            f"{(checkpoint.sha256 or '')[:12]}); pass an eval of this checkpoint (`blockdraft eval --checkpoint "
            f"{checkpoint.url}`)"
        )
    report = json.loads((found.fetch([EVAL_REPORT_NAME], dest) / EVAL_REPORT_NAME).read_text())
    measured = report.get("target") if isinstance(report, dict) else None
    if target is not None and not (isinstance(measured, str) and same_target(redact_setting(measured), target)):
        raise OtherTargetError(
            f"eval {found.store.url} measured the drafter against target {measured}, not this export's target {target} "
            f"(the card's base_model); pass an eval made with target.path {target}, or export for that target "
            "(--target)"
        )
    return EvalSource(found.store.url, found.ref.sha256 or "", report)


def same_target(a: str, b: str) -> bool:
    """Whether two target names (target.path as pinned) name one target: equal, or one local folder however spelled."""
    if a == b:
        return True
    folders = [Path(name.removeprefix("file://")) for name in (a, b)]
    return all(f.is_dir() for f in folders) and os.path.samefile(*folders)


def latest_eval(
    checkpoint: InputRef, store_config: StoreConfig, dest: Path, reporter: Reporter, target: str | None = None
) -> EvalSource | None:
    """The latest eval of `checkpoint` in the store `store_config.url` that verifies, opened as `open_eval` opens an
    `--eval`, or None; says in one line which eval the card uses, or that there is none.

    A candidate is an artifact there whose recorded manifest is of kind eval, lists `EVAL_REPORT_NAME` and pins in its
    lineage the manifest sha256 of `checkpoint` (the same content, wherever it lies now: an eval of another checkpoint
    at the same path never matches). Latest: the greatest manifest `created_at`, ties broken by the greater URL.
    Candidates are tried latest first; one that does not verify (or whose report cannot be read), or with `target` one
    measured against another target, is passed over and named. An unreachable store is said in the line too: the export
    itself does not need it.
    """
    where = f"{checkpoint.url} (manifest sha256 {(checkpoint.sha256 or '')[:12]})"
    try:
        store = open_store(store_config.url, store_config)
        candidates = _eval_candidates(store, checkpoint)
    except (BlockdraftError, OSError) as exc:  # an unreachable store: the export itself does not need it
        reporter.say(f"card: could not look for an eval of {where} in {safe_url(store_config.url)} ({exc}); the card "
                     "gives none: pass --eval EVAL")
        return None
    passed: list[str] = []
    others: list[str] = []  # evals of this checkpoint against another target
    for index, (_, url) in enumerate(candidates):
        try:
            found = open_eval(url, checkpoint, store_config, dest / str(index), target)
        except OtherTargetError:
            others.append(url)
            continue
        except (BlockdraftError, OSError, ValueError) as exc:  # not verified, changed since listed, unreadable report
            passed.append(f"{url} ({type(exc).__name__})")
            continue
        skipped = f"; passed over newer evals that do not verify: {', '.join(passed)}" if passed else ""
        skipped += f"; passed over newer evals against another target: {', '.join(others)}" if others else ""
        reporter.say(f"card: figures from eval {found.url}, the latest verified eval of {where} in {store.url} "
                     f"(--eval EVAL names another){skipped}")
        return found
    skipped = f" ({len(passed)} that do not verify: {', '.join(passed)})" if passed else ""
    skipped += f" ({len(others)} against another target: {', '.join(others)})" if others else ""
    reporter.say(f"card: no verified eval of {where} in {store.url}{skipped}; the card gives none: run "
                 f"`blockdraft eval --checkpoint {checkpoint.url}` first or pass --eval EVAL")
    return None


def _eval_candidates(store: Store, checkpoint: InputRef) -> list[tuple[datetime, str]]:
    """(created_at, URL) of every committed eval artifact in `store` whose recorded (not yet verified) manifest pins
    `checkpoint` by sha256, latest first. Only artifacts listing a report are read: one manifest read each."""
    keys = [info.key for info in store.list()]
    listed = set(keys)
    committed, _ = find_artifact_roots(keys)
    found = []
    for root in committed:
        if (f"{root}/{EVAL_REPORT_NAME}" if root else EVAL_REPORT_NAME) not in listed:
            continue
        child = store.child(root) if root else store
        try:
            manifest = recorded_manifest(child)
        except ArtifactError:  # a torn or foreign manifest is no eval
            continue
        if manifest is None or manifest.kind != EVAL_KIND or not manifest.lineage:
            continue
        if manifest.lineage[0].sha256 != checkpoint.sha256:  # an eval pins the checkpoint it decoded first
            continue
        found.append((_created(manifest.created_at), child.url))
    return sorted(found, reverse=True)


def _created(stamp: str) -> datetime:
    """A manifest's `created_at` as a UTC time; one that does not parse counts as the oldest."""
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


class Held(Reporter):
    """Keeps the lines it is told, neither shown nor logged, until `replay` says them: what the card's eval search found
    is said once the export is written, so an export that fails says its one error line alone."""

    def say(self, line: str) -> None:
        self.lines.append(line)

    def replay(self, reporter: Reporter) -> None:
        for line in self.lines:
            reporter.say(line)
        self.lines.clear()


__all__ = ["Held", "OtherTargetError", "latest_eval", "open_eval", "same_target"]
