"""A stage's output: whether it is already done, and whether this run may write it. Every stage writes through here.

    out = StageOutput(url, kind, key, store_config)     # key: what the output depends on (`stage_key`)
    if (report := out.done()) is not None:              # already there, made for this key, verified, nothing failed
        return report
    out.begin()                                         # this run's to write: lease, ownership, old manifest taken down
    for piece in work:                                   # optional: resumable pieces (shards)
        if out.finished_piece(name, piece_key) is None:
            ... write files ...; out.put_piece(name, piece_key, files, counts)
    out.commit(files, config=..., lineage=[inp.ref], counts=...)   # every file checked at the destination,
                                                                   # manifest last

**Done** is decided from the destination's manifest alone, by `StageOutput.done`; no stage reads its own manifest to
decide. An output is done when its manifest was made for this run (its kind; the config values the stage names in
`made_with`, compared before the key, which may read the inputs; then the key itself) and its files verify, and its
commit recorded nothing under the counts field the stage names in `failures` (a run that left inputs out is redone for
them). A torn or foreign manifest, or files that no longer verify, is not done: the output is made again. A copy (push,
pull) is done when it holds its source's manifest byte for byte and verifies. `finished_piece` decides the same for one
piece of a long stage: a sub-manifest in the same model under `.blockdraft-pieces/`, written after its files verified.

**Who may write** is decided by `begin` (and `claim`, its first half), before the first byte:

- one writer per output: its lease (`Lease` in `store/lease.py`), held until the commit; a lease this process holds
  above an output (train's on its whole output, `writer_lease`) does not refuse the outputs inside it;
- a writer touches only its own: the output must be empty, an artifact of its kind whose manifest lists every file
  there, or marked (`WRITING_NAME`, or piece records) as being made into its kind by an earlier run that stopped.
  Anything else is refused with one line naming a file; nothing is deleted or overwritten. Folders below that are other
  artifacts' roots belong to those, and a live writer above or below the output is refused, naming it;
- `refuse_nested`: no stage writes where it reads.

The lease itself (its record, takeovers, heartbeat, re-entry) is `store/lease.py`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, ConfigError, StoreError, redact_settings
from blockdraft.reporter import Reporter
from blockdraft.store import Store, open_store
from blockdraft.store.artifact import (
    MANIFEST_NAME,
    PIECES_DIR,
    FileEntry,
    InputRef,
    Manifest,
    State,
    VerifyReport,
    check_files,
    commit_artifact,
    commit_manifest,
    entry_for_local_file,
    manifest_sha256,
    read_manifest,
    uncommit,
    verify_artifact,
)
from blockdraft.store.base import ROOT_MARKERS, WRITING_NAME, is_bookkeeping
from blockdraft.store.inputs import StageInput
from blockdraft.store.lease import Lease, refuse_live_leases

STAGE_KEY = "stage_key"  # the manifest's config field that names what the output was made from
_PIECE_SUFFIX = "-piece"  # a piece sub-manifest's kind: the output's kind and this


def stage_key(config_slice: Any, lineage: Iterable[InputRef] = ()) -> str:
    """sha256 of what an output depends on: the part of the config that changes its bytes, and its inputs by content."""
    data = {"config": config_slice, "lineage": [ref.model_dump(mode="json") for ref in lineage]}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _config_value(config: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted `path` ("tokenize_run.config_digest") of a manifest's config; None when absent."""
    value: Any = config
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


class StageOutput:
    """The output artifact of one stage run: `kind` at `url`, made from what `key` names (see `stage_key`).

    `key` may be a function, called only when needed (by `done` for a manifest of this kind and config, and by
    `commit`): a key that names raw inputs by content may have to read them. `made_with` (dotted config path -> value)
    names config values an output of this run records, compared before the key; `failures` the counts field where a
    commit records what failed (an output committed with failures is not done: a rerun retries them). `force` and
    `reporter` go to its lease: whether a live writer of another host is taken over (`--force`), and who hears of
    takeovers."""

    def __init__(
        self, url: str | Store, kind: str, key: str | Callable[[], str], store_config: StoreConfig | None = None, *,
        made_with: Mapping[str, Any] | None = None, failures: str | None = None, force: bool = False,
        reporter: Reporter | None = None,
    ) -> None:
        self.store = url if isinstance(url, Store) else open_store(url, store_config)
        self.kind = kind
        self._key = key
        self.made_with = dict(made_with or {})
        self.failures = failures
        self.copy_of: bytes | None = None
        self.lease: Lease | None = None
        self.force, self.reporter = force, reporter

    @property
    def key(self) -> str:
        return self._key() if callable(self._key) else self._key

    @property
    def url(self) -> str:
        return self.store.url

    @classmethod
    def copy(
        cls, url: str | Store, raw_manifest: bytes, store_config: StoreConfig | None = None, *,
        force: bool = False, reporter: Reporter | None = None,
    ) -> StageOutput:
        """The destination of a copy (push, pull): it keeps the source's manifest byte for byte, so lineage digests stay
        valid, and it is done when it holds that very manifest and verifies."""
        manifest = Manifest.model_validate_json(raw_manifest)
        out = cls(url, manifest.kind, manifest_sha256(raw_manifest), store_config, force=force, reporter=reporter)
        out.copy_of = raw_manifest
        return out

    @classmethod
    def amending(cls, current: StageInput, *, force: bool = False, reporter: Reporter | None = None) -> StageOutput:
        """The output `current` (a verified artifact) as a writer that replaces some of its files (`amend`), keeping the
        key it was made for, so the stage that made it still finds it done afterwards."""
        return cls(current.store, current.kind, current.manifest.config.get(STAGE_KEY, ""), force=force,
                   reporter=reporter)

    # -- done

    def done(self, verified: VerifyReport | None = None) -> VerifyReport | None:
        """The destination's report when it holds this output, made for this run, verified, with nothing failed; else
        None. `verified`: the destination's report when the caller has just verified it (resume picking the newest
        verified checkpoint), so it is not read and verified again."""
        if (
            verified is not None
            and verified.state is State.VERIFIED
            and verified.manifest is not None
            and verified.manifest_sha256
        ):
            manifest, sha256, report = verified.manifest, verified.manifest_sha256, verified
        else:
            try:
                found = read_manifest(self.store)
            except ArtifactError:  # a torn or foreign manifest: not this output; it is rewritten
                return None
            if found is None:
                return None
            manifest, sha256, report = found[0], manifest_sha256(found[1]), None
        if not self._made_for(manifest, sha256):
            return None
        if report is None:
            report = verify_artifact(self.store)
            if report.state is not State.VERIFIED or report.manifest_sha256 != sha256:
                return None
        if self.failures and manifest.counts.get(self.failures):
            return None  # committed with failures: a rerun retries what failed
        return report

    def _made_for(self, manifest: Manifest, sha256: str) -> bool:
        """Whether the manifest (whose bytes hash to `sha256`) was made for this output. The config values of
        `made_with` are compared before the key, so an output of another config is redone without computing the key."""
        if self.copy_of is not None:
            return sha256 == manifest_sha256(self.copy_of)
        if manifest.kind != self.kind:
            return False
        if any(_config_value(manifest.config, path) != value for path, value in self.made_with.items()):
            return False
        return manifest.config.get(STAGE_KEY) == self.key

    # -- who may write

    def claim(self, mark: bool = True) -> None:
        """Take the output's lease (LeaseError naming the writer that holds it) and check that the output is this
        writer's to write (ArtifactError naming a file it does not own, LeaseError naming a live writer above or below);
        then mark it as being written (`mark` False leaves that to `mark_writing`, right before the output first
        changes). Nothing at the output is changed before both checks pass. Taken once: a second call does nothing."""
        if self.lease is not None:
            return
        self.lease = Lease(self.store, force=self.force, reporter=self.reporter).acquire()
        try:
            keys = [info.key for info in self.store.list()]
            refuse_live_leases(self.store, keys, self.lease.force)
            others = _other_roots(keys)
            problem = _not_ours(self.store, self.kind,
                                [k for k in keys if not any(k.startswith(root + "/") for root in others)])
            if problem is not None:
                raise ArtifactError(problem)
        except BaseException:
            self.release()
            raise
        if mark:
            self.mark_writing()

    def mark_writing(self, amending: Manifest | None = None) -> None:
        """Note at the output's root that a run is making it into this kind (`WRITING_NAME`): from here on its files may
        belong to no manifest, and a rerun of this kind resumes over them. Removed by the commit. `amending`: the
        manifest an `amend` is about to take down, recorded so that an amend that stops is finished by the next
        (`resume_amend`)."""
        mark: dict[str, Any] = {"kind": self.kind}
        if amending is not None:
            mark["amending"] = amending.model_dump(mode="json")
        self.store.put_bytes(WRITING_NAME, json.dumps(mark).encode() + b"\n")

    def begin(self, amending: Manifest | None = None) -> None:
        """`claim` the output, then remove its manifest (if any) before anything is rewritten, so no reader sees an old
        manifest over new files; `amending` (the manifest an `amend` takes down) is recorded in the writing mark
        first."""
        self.claim(mark=amending is None)
        if amending is not None:
            self.mark_writing(amending)
        uncommit(self.store)

    def confirm(self) -> None:
        """Right before an object or a manifest is written: this run must still be the output's one writer (LeaseError
        naming who holds it now otherwise), so a writer that lost its lease while suspended writes nothing more."""
        if self.lease is not None:
            self.lease.check()

    def raise_if_lost(self) -> None:
        """After a write failed: the LeaseError naming the new owner when another writer took the output meanwhile (its
        takeover can abort this run's uploads), so the run ends with that one line and not the store's complaint."""
        if self.lease is not None and (who := self.lease.lost_to()) is not None:
            raise self.lease.lost_error(who) from None

    def release(self) -> None:
        """Give back this output's lease (also done by every commit); nothing happens when none is held."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    # -- commit

    def commit(
        self,
        files: Iterable[FileEntry],
        config: dict[str, Any] | None = None,
        lineage: Iterable[InputRef] = (),
        counts: dict[str, Any] | None = None,
    ) -> VerifyReport:
        """Check every file at the destination, then write the manifest (with this output's key) last. The config it
        pins passes `redact_settings` whatever the stage gave: no manifest names a credential a setting carries."""
        assert self.copy_of is None, "a copy commits its source manifest (commit_copy)"
        config, counts = config or {}, counts or {}
        assert all(_config_value(config, path) == value for path, value in self.made_with.items()), (
            "commit what made_with names"
        )
        assert self.failures is None or self.failures in counts, "a commit records what failed under its failures field"
        self.confirm()
        pinned = {**redact_settings(config), STAGE_KEY: self.key}
        report = commit_artifact(self.store, self.kind, files, config=pinned, lineage=lineage, counts=counts)
        self._committed()
        return report

    def commit_copy(self) -> VerifyReport:
        """A copy's commit (push): its source's manifest, byte for byte, after every file verified at the
        destination."""
        assert self.copy_of is not None, "a stage's own output commits with commit()"
        self.confirm()
        report = commit_manifest(self.store, self.copy_of, if_absent=True)
        self._committed()
        return report

    def commit_checked_copy(self) -> None:
        """A copy's commit when every file was just checked on the very bytes written (pull): the manifest, byte for
        byte, then the manifest and every file's size read back (ArtifactError, and uncommitted, when they differ)."""
        assert self.copy_of is not None
        manifest = Manifest.model_validate_json(self.copy_of)
        self.confirm()
        self.store.put_bytes(MANIFEST_NAME, self.copy_of)
        back = read_manifest(self.store)
        sizes = {info.key: info.size for info in self.store.list()}  # listed, not read: no file is read again
        wrong = [e.path for e in manifest.files if sizes.get(e.path) != e.size]
        if back is None or back[1] != self.copy_of or wrong:
            uncommit(self.store)
            raise ArtifactError(f"the copy in {self.url.rstrip('/')} did not read back as written "
                                f"({wrong[:3] or 'manifest'}); copy it again")
        self._committed()

    def _committed(self) -> None:
        self.store.delete(WRITING_NAME)
        self.release()

    def publish(
        self,
        root: Path,
        paths: Iterable[Path],
        config: dict[str, Any] | None = None,
        lineage: Iterable[InputRef] = (),
        counts: dict[str, Any] | None = None,
    ) -> VerifyReport:
        """Upload local files written under `root` (each with its checksum), then `commit` them."""
        return self.commit(self._upload(root, paths), config=config, lineage=lineage, counts=counts)

    def _upload(self, root: Path, paths: Iterable[Path]) -> list[FileEntry]:
        """Upload local files written under `root`, each with its checksum and after confirming the lease; their
        entries."""
        entries = []
        for path in paths:
            entry = entry_for_local_file(root, path)
            self.confirm()
            try:
                self.store.put_file(entry.path, path, checksum=entry.checksum)
            except (StoreError, OSError):
                self.raise_if_lost()
                raise
            entries.append(entry)
        return entries

    def amend(
        self, current: StageInput, root: Path, paths: Iterable[Path], lineage: Iterable[InputRef] | None = None
    ) -> VerifyReport:
        """Replace or add the local files `paths` (under `root`) in the committed output `current`: its other files stay
        as listed, its config, lineage (unless `lineage` gives what the new files were made from) and counts as
        recorded; the manifest is taken down first (`begin`), every file is checked at the destination, and the new
        manifest is written last."""
        recorded = current.manifest
        self.begin(amending=recorded)  # an amend stopped from here on is finished by the next one (`resume_amend`)
        try:
            added = self._upload(root, paths)
            replaced = {e.path for e in added}
            kept = [e for e in recorded.files if e.path not in replaced]
            config = {k: v for k, v in recorded.config.items() if k != STAGE_KEY}
            inputs = recorded.lineage if lineage is None else list(lineage)
            return self.commit([*kept, *added], config=config, lineage=inputs, counts=recorded.counts)
        finally:
            self.release()

    # -- pieces: the resumable parts of a long stage (tokenize shards, generate shards)

    def _piece_key(self, name: str) -> str:
        return f"{PIECES_DIR}/{name}.json"

    def put_piece(self, name: str, piece_key: str, files: Iterable[FileEntry],
                  counts: dict[str, Any] | None = None) -> None:
        """Record piece `name` as finished: its files are checked at the destination first, its sub-manifest is written
        last."""
        files = sorted(files, key=lambda e: e.path)
        self.confirm()
        problems = [p for p in check_files(self.store, files) if p is not None]
        if problems:
            raise ArtifactError(f"{self.url.rstrip('/')}/{problems[0].path} did not verify before its piece was "
                                f"recorded: {problems[0].detail}")
        piece = Manifest(kind=self.kind + _PIECE_SUFFIX, config={STAGE_KEY: piece_key}, files=files,
                         counts=counts or {})
        self.store.put_bytes(self._piece_key(name), piece.to_bytes())

    def finished_piece(self, name: str, piece_key: str) -> Manifest | None:
        """Piece `name`'s sub-manifest when it was recorded for `piece_key` and every file it lists reads back as
        listed."""
        try:
            piece = Manifest.model_validate_json(self.store.read_bytes(self._piece_key(name)))
        except (FileNotFoundError, ValueError):
            return None
        if not self._recorded_for(piece, piece_key):
            return None
        if any(p is not None for p in check_files(self.store, piece.files)):
            return None
        return piece

    def piece_names(self, piece_key: str) -> tuple[list[str], list[str]]:
        """The names of the pieces recorded for `piece_key` (finished or not: `finished_piece` says) and of those
        recorded for another key or kind, each sorted; from the sub-manifests alone, no file is read."""
        recorded = recorded_pieces(self.store)
        ours = sorted(name for name, piece in recorded.items() if self._recorded_for(piece, piece_key))
        return ours, sorted(name for name in recorded if name not in ours)

    def _recorded_for(self, piece: Manifest, piece_key: str) -> bool:
        return piece.config.get(STAGE_KEY) == piece_key and piece.kind == self.kind + _PIECE_SUFFIX

    def drop_piece(self, name: str) -> None:
        self.store.delete(self._piece_key(name))


def resume_amend(store: Store, kind: str, replaced: Collection[str]) -> StageInput | None:
    """The output at `store` as an `amend` of a `kind` artifact left it when it stopped after taking the manifest down
    and before writing the new one: the manifest it was amending (recorded in the writing mark), with every file but
    `replaced` (what that amend was replacing, and the next one replaces) checked against it, for `amend` to finish;
    None when the output holds a manifest or no such record. ArtifactError when a file that was to be kept no longer
    matches."""
    try:
        if read_manifest(store) is not None:
            return None
        recorded = Manifest.model_validate(json.loads(store.read_bytes(WRITING_NAME))["amending"])
    except (ArtifactError, FileNotFoundError, ValueError, TypeError, KeyError):
        # a torn or foreign mark is no such record
        return None
    if recorded.kind != kind:
        return None
    kept = [entry for entry in recorded.files if entry.path not in replaced]
    problem = next((p for p in check_files(store, kept) if p is not None), None)
    if problem is not None:
        raise ArtifactError(
            f"{store.url.rstrip('/')} has no manifest: a rewrite of its {', '.join(sorted(replaced))} stopped before "
            f"writing it, and {problem.path} no longer matches the manifest it was amending ({problem.detail}); make "
            "it again"
        )
    return StageInput(store, VerifyReport(store.url, State.INCOMPLETE, manifest=recorded))


def recorded_pieces(store: Store) -> dict[str, Manifest]:
    """Every piece sub-manifest under `store`, by name, as recorded and not checked (for listing what to push while a
    stage runs, or choosing a cut; whether a piece is finished is `StageOutput.finished_piece`'s to say)."""
    pieces = {}
    for info in store.list(f"{PIECES_DIR}/"):
        name = info.key.removeprefix(f"{PIECES_DIR}/").removesuffix(".json")
        try:
            pieces[name] = Manifest.model_validate_json(store.read_bytes(info.key))
        except (FileNotFoundError, ValueError):
            continue  # being written right now, or torn: not finished
    return pieces


# ---------------------------------------------------------------------------------------------- what a writer owns


def _other_roots(keys: list[str]) -> set[str]:
    """The folders below the output's root that are other artifacts' roots (a manifest, a lease or a writing mark)."""
    roots = {key.rpartition("/")[0] for key in keys if key.rpartition("/")[2] in ROOT_MARKERS}
    roots.discard("")
    return {root for root in roots if not any(root.startswith(other + "/") for other in roots)}


def _not_ours(store: Store, kind: str, keys: list[str]) -> str | None:
    """Why this output is not the writer's to write (naming a file), or None when it is."""
    url = store.url.rstrip("/")
    files = [k for k in keys if not is_bookkeeping(k) and k != MANIFEST_NAME]
    if MANIFEST_NAME in keys:
        try:
            found = read_manifest(store)
        except ArtifactError:
            return (
                f"{url}/{MANIFEST_NAME} is not a valid blockdraft manifest, so the files there are not known to be an "
                "artifact's; pass another output or remove them first"
            )
        if found is not None and found[0].kind != kind:
            return (f"{url} holds a '{found[0].kind}' artifact, not '{kind}'; pass another output or remove that "
                    "artifact first")
        listed = {entry.path for entry in found[0].files} if found is not None else set()
        stray = [k for k in files if k not in listed]
    else:
        writing = _writing_kind(store) or _pieces_kind(store, keys)
        if writing is not None and writing != kind:
            return f"{url} is being made into a '{writing}' artifact, not '{kind}'; pass another output"
        stray = [] if writing == kind else files
    if not stray:
        return None
    return (
        f"{url}/{stray[0]} is not a file of a blockdraft '{kind}' artifact there, and blockdraft never overwrites or "
        "deletes files it does not own; pass an empty or new output, or move that file away"
    )


def _writing_kind(store: Store) -> str | None:
    """The kind an earlier run marked the output as being made into, or None (no mark, or not one blockdraft wrote)."""
    try:
        mark = json.loads(store.read_bytes(WRITING_NAME))
    except (FileNotFoundError, ValueError):
        return None
    return mark.get("kind") if isinstance(mark, dict) and isinstance(mark.get("kind"), str) else None


def _pieces_kind(store: Store, keys: list[str]) -> str | None:
    """The kind whose piece records (`PIECES_DIR`) an earlier run left at the output, or None: such records mark an
    interrupted run of that kind as surely as the writing mark does."""
    record = next((k for k in keys if k.startswith(PIECES_DIR + "/") and k.endswith(".json")), None)
    if record is None:
        return None
    try:
        kind = json.loads(store.read_bytes(record)).get("kind")
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    return kind.removesuffix(_PIECE_SUFFIX) if isinstance(kind, str) and kind.endswith(_PIECE_SUFFIX) else None


def _location(store: Store) -> str:
    """Where `store` is, comparable across spellings: a local folder's real path (symlinks resolved), else its URL."""
    local = store.local_path()
    return "file://" + os.path.realpath(local) if local is not None else store.url.rstrip("/")


def refuse_nested(input: Store, output: Store, role: str = "input") -> None:
    """ConfigError (one line) when the input is the output, lies inside it, or contains it: a stage would read what it
    writes, or overwrite what it reads."""
    src, dst = _location(input), _location(output)
    if src == dst:
        relation = "is the output itself"
    elif src.startswith(dst + "/"):
        relation = f"lies inside the output {output.url.rstrip('/')}"
    elif dst.startswith(src + "/"):
        relation = f"contains the output {output.url.rstrip('/')}"
    else:
        return
    raise ConfigError(f"{role} {input.url.rstrip('/')} {relation}; a stage never reads what it writes: pass another "
                      "output")


__all__ = ["STAGE_KEY", "StageOutput", "recorded_pieces", "refuse_nested", "resume_amend", "stage_key"]
