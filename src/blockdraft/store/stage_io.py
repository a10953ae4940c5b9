"""The one artifact writer and the one input reader that every stage uses.

A stage reads its input through `open_input` (verified at its source or refused, pinned by content as an `InputRef`,
files fetched with their checksums compared) and writes its output through a `StageOutput`:

    out = StageOutput(url, kind, key, store_config)     # key: what the output depends on (config slice + inputs)
    if (report := out.done()) is not None:              # already there, for this key, verified, nothing failed
        return report
    out.begin()                                         # uncommit, so no reader sees an old manifest over new files
    for piece in work:                                   # optional: resumable pieces (shards, checkpoints)
        if out.finished_piece(name, piece_key) is None:
            ... write files ...; out.put_piece(name, piece_key, files, counts)
    out.commit(files, config=..., lineage=[inp.ref], counts=...)   # every file checked at the destination, manifest last

`StageOutput.state` is the only place that decides whether an output is already done (`done` is its report when it is),
and `finished_piece` the only place that decides whether one piece of it is. A piece is recorded as a sub-manifest in
the same `Manifest` model under `.blockdraft-pieces/` (not listed in the artifact's manifest), written after its files
verified at the destination.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, ConfigError, StoreError
from blockdraft.reporter import Reporter
from blockdraft.store import ObjectInfo, Store, open_store
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
    raw_input,
    read_origin,
    uncommit,
    verify_artifact,
)
from blockdraft.store.lease import Lease
from blockdraft.store.local import LocalStore
from blockdraft.store.output_state import STAGE_KEY, Expected, Holds, OutputState, config_value, output_state, recorded_manifest
from blockdraft.store.ownership import PIECE_SUFFIX, claim_output, refuse_nested, release_claim


def stage_key(config_slice: Any, lineage: Iterable[InputRef] = ()) -> str:
    """sha256 of what an output depends on: the part of the config that changes its bytes, and its inputs by content."""
    data = {"config": config_slice, "lineage": [ref.model_dump(mode="json") for ref in lineage]}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- reading an input


@dataclass
class StageInput:
    """A verified input artifact: its store, the report read from its source, and its lineage entry (by content).

    Made by `open_input`; a caller that has just verified an artifact itself (resume picking the newest verified
    checkpoint) may wrap that report directly instead of verifying it twice.
    """

    store: Store
    report: VerifyReport

    @property
    def manifest(self) -> Manifest:
        assert self.report.manifest is not None
        return self.report.manifest

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @cached_property
    def ref(self) -> InputRef:
        """The input by content. A pulled copy of a store's artifact is pinned at the store it came from, so `status` checks
        it there from any machine, not at a folder that only this machine holds; any other folder pins itself (a push
        from it records nothing in it)."""
        sha = self.report.manifest_sha256
        return InputRef(kind="manifest", url=read_origin(self.store, sha) or self.store.url, sha256=sha)

    def entry(self, path: str) -> FileEntry:
        for entry in self.manifest.files:
            if entry.path == path:
                return entry
        raise ArtifactError(f"{self.store.url} lists no {path}; pass an artifact that holds it")

    def fetch(self, paths: Sequence[str], dest: Path) -> Path:
        """Make the listed files readable under a local folder and return it.

        A local input is read where it is, each file's checksum first computed from its bytes (never from a cache); a
        remote one is downloaded into `dest`, each file's size and checksum compared with the manifest on the bytes
        received. Raises ArtifactError naming the file on a mismatch.
        """
        local = self.store.local_path()
        if local is not None:
            self._check_local(paths)
            return local
        for path in paths:
            entry = self.entry(path)
            size, checksum = self.store.get_file(path, LocalStore(dest), path)
            if size != entry.size or checksum != entry.checksum:
                (dest / path).unlink(missing_ok=True)
                raise ArtifactError(
                    f"{self.store.url.rstrip('/')}/{path} changed while read (received {size} bytes crc64nvme {checksum}, "
                    f"listed {entry.size} bytes {entry.checksum}); rerun when the input is stable"
                )
        return dest

    def _check_local(self, paths: Sequence[str]) -> None:
        entries = [self.entry(path) for path in paths]
        for entry, problem in zip(entries, check_files(self.store, entries)):
            if problem is not None:
                raise ArtifactError(
                    f"{self.store.url.rstrip('/')}/{entry.path} does not match its manifest as read now ({problem.detail}); "
                    "the file changed or rotted on disk: restore it (pull it again) or rerun the stage that made it"
                )

    @contextmanager
    def fetched(self, paths: Sequence[str] | None = None) -> Iterator[Path]:
        """`fetch` into a temporary folder that is removed afterwards; all listed files when `paths` is None."""
        names = [e.path for e in self.manifest.files] if paths is None else list(paths)
        with tempfile.TemporaryDirectory(prefix="blockdraft-input-") as tmp:
            yield self.fetch(names, Path(tmp))


def open_input(url: str | Store, store_config: StoreConfig | None = None, kinds: Sequence[str] = (), role: str = "input") -> StageInput:
    """The artifact at `url`, verified at its source, else ArtifactError naming its state; `kinds` limits what it may be.

    `role` names the input in the error (a config field such as "train.data", or "input").
    """
    store = url if isinstance(url, Store) else open_store(url, store_config)
    report = verify_artifact(store)
    if report.state is State.INCOMPLETE and next(iter(store.list()), None) is None:
        raise ArtifactError(f"{role} {store.url} does not exist (nothing there); check the path or URL")
    if report.state is not State.VERIFIED or report.manifest is None:
        raise ArtifactError(f"{role} {store.url} is {report.state.value}: {report.summary()}; fix or regenerate it first")
    if kinds and report.manifest.kind not in kinds:
        raise ArtifactError(
            f"{role} {store.url} is a '{report.manifest.kind}' artifact, not {' or '.join(repr(k) for k in kinds)}; pass the right artifact"
        )
    return StageInput(store, report)


@dataclass
class RawInput:
    """A plain object without a manifest (prompts or completions someone uploaded), pinned by what the store reports for it:
    its size and CRC64NVME, or its ETag when the store holds no checksum. Reading it back is checked against that."""

    store: Store
    info: ObjectInfo

    @property
    def url(self) -> str:
        return f"{self.store.url.rstrip('/')}/{self.info.key}"

    @property
    def ref(self) -> InputRef:
        return raw_input(self.store, self.info)

    def fetch(self, dest: Path) -> Path:
        """The object as a local file: where it is for a local store, else downloaded to `dest` with the bytes received
        compared with the pinned size (and checksum, when there is one); ArtifactError when they differ."""
        local = self.store.local_path()
        if local is not None:
            return local / self.info.key
        size, checksum = self.store.get_file(self.info.key, LocalStore(dest.parent), dest.name)
        if size != self.info.size or (self.info.checksum is not None and checksum != self.info.checksum):
            dest.unlink(missing_ok=True)
            raise ArtifactError(f"{self.url} changed while read (received {size} bytes, pinned {self.info.size}); rerun when it is stable")
        return dest


def recorded_pieces(store: Store) -> dict[str, Manifest]:
    """Every piece sub-manifest under `store`, by name, as recorded and not checked (for listing what to push while a stage
    runs; whether a piece is finished is `StageOutput.finished_piece`'s to say)."""
    pieces = {}
    for info in store.list(f"{PIECES_DIR}/"):
        name = info.key.removeprefix(f"{PIECES_DIR}/").removesuffix(".json")
        try:
            pieces[name] = Manifest.model_validate_json(store.read_bytes(info.key))
        except (FileNotFoundError, ValueError):
            continue  # being written right now, or torn: not finished
    return pieces


def open_raw_input(url: str, store_config: StoreConfig | None = None, role: str = "input") -> RawInput:
    """The single object at `url` (a local path, file:// or s3:// URL), pinned by what its store reports; ConfigError when absent."""
    parent, _, key = url.rstrip("/").rpartition("/")
    store = open_store(parent or ".", store_config)
    info = store.head(key)
    if info is None:
        raise ConfigError(f"{role} {url} does not exist; pass an existing file or object")
    return RawInput(store, info)


# ---------------------------------------------------------------------------------------------- writing an output


class StageOutput:
    """The output artifact of one stage run: `kind` at `url`, made from what `key` names (see `stage_key`).

    `key` may be a function, called only when needed (by `state` for a manifest of this kind and config, and by `commit`):
    a key that names raw inputs by content may have to read them. `made_with` (dotted config path -> value) names config
    values an output of this run records, compared before the key; `failures` the counts field where a commit records
    what failed (a run that committed with failures is `Holds.PARTIAL`, not done). `force` and `reporter` go to its
    lease (`store.lease.Lease`): whether a live writer of another host is taken over (`--force`), and who hears of
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

    def release(self) -> None:
        """Give back this output's lease (also done by `commit`); nothing happens when none is held."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def confirm(self) -> None:
        """Right before an object or a manifest is written: this run must still be the output's one writer (LeaseError
        naming who holds it now otherwise), so a writer that lost its lease while suspended writes nothing more."""
        if self.lease is not None:
            self.lease.check()

    def raise_if_lost(self) -> None:
        """After a write failed: the LeaseError naming the new owner when another writer took the output meanwhile (its
        takeover can abort this run's uploads), so the run ends with that one line and not the store's complaint."""
        if self.lease is not None and self.lease.lost_to() is not None:
            raise self.lease.lost_error() from None

    @property
    def url(self) -> str:
        return self.store.url

    def state(self, verified: VerifyReport | None = None) -> OutputState:
        """What the destination holds for this output (`output_state.Holds`): the only place that decides whether a
        stage's output is done, done but for what failed (partial), or to be made. `verified`: the destination's report
        when the caller has just verified it, so it is not verified twice."""
        expected = Expected(self.kind, lambda: self.key, self.made_with, self.failures, self.copy_of)
        return output_state(self.store, expected, verified)

    def done(self) -> VerifyReport | None:
        """The destination's report when `state` says done; else None."""
        state = self.state()
        return state.report if state.holds is Holds.DONE else None

    def begin(self) -> None:
        """Take the output's lease (one writer per output, `store.lease`: LeaseError naming the writer that holds it), check
        that the output is this writer's to write (`ownership.claim_output`: ArtifactError naming a file it does not own,
        LeaseError naming a live writer above or below), then remove the manifest (if any) before anything is rewritten,
        so no reader sees an old manifest over new files."""
        if self.lease is None:
            self.lease = Lease(self.store, force=self.force, reporter=self.reporter).acquire()
            try:
                claim_output(self.store, self.kind, self.lease.force)
            except BaseException:
                self.release()
                raise
        uncommit(self.store)

    def commit(
        self,
        files: Iterable[FileEntry],
        config: dict[str, Any] | None = None,
        lineage: Iterable[InputRef] = (),
        counts: dict[str, Any] | None = None,
    ) -> VerifyReport:
        """Check every file at the destination, then write the manifest (with this output's key) last."""
        assert self.copy_of is None, "a copy commits its source manifest (commit_copy)"
        config, counts = config or {}, counts or {}
        assert all(config_value(config, path) == value for path, value in self.made_with.items()), "commit what made_with names"
        assert self.failures is None or self.failures in counts, "a commit records what failed under its failures field"
        self.confirm()
        report = commit_artifact(self.store, self.kind, files, config={**config, STAGE_KEY: self.key}, lineage=lineage, counts=counts)
        release_claim(self.store)
        self.release()
        return report

    def commit_copy(self) -> VerifyReport:
        """A copy's commit (push): its source's manifest, byte for byte, after every file verified at the destination."""
        assert self.copy_of is not None, "a stage's own output commits with commit()"
        self.confirm()
        report = commit_manifest(self.store, self.copy_of, if_absent=True)
        release_claim(self.store)
        self.release()
        return report

    def publish(
        self,
        root: Path,
        paths: Iterable[Path],
        config: dict[str, Any] | None = None,
        lineage: Iterable[InputRef] = (),
        counts: dict[str, Any] | None = None,
    ) -> VerifyReport:
        """Upload local files written under `root` (each with its checksum), then `commit` them."""
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
        return self.commit(entries, config=config, lineage=lineage, counts=counts)

    @classmethod
    def amending(cls, current: StageInput, *, force: bool = False, reporter: Reporter | None = None) -> StageOutput:
        """The output `current` (a verified artifact) as a writer that replaces some of its files (`amend`), keeping the
        key it was made for, so the stage that made it still finds it done afterwards."""
        return cls(current.store, current.kind, current.manifest.config.get(STAGE_KEY, ""), force=force, reporter=reporter)

    def amend(self, current: StageInput, root: Path, paths: Iterable[Path]) -> VerifyReport:
        """Replace or add the local files `paths` (under `root`) in the committed output `current`: its other files stay
        as listed, its config, lineage and counts as recorded; the manifest is taken down first (`begin`), every file is
        checked at the destination, and the new manifest is written last."""
        recorded = current.manifest
        self.begin()
        try:
            added = []
            for path in paths:
                entry = entry_for_local_file(root, path)
                self.confirm()
                self.store.put_file(entry.path, path, checksum=entry.checksum)
                added.append(entry)
            replaced = {e.path for e in added}
            kept = [e for e in recorded.files if e.path not in replaced]
            config = {k: v for k, v in recorded.config.items() if k != STAGE_KEY}
            return self.commit([*kept, *added], config=config, lineage=recorded.lineage, counts=recorded.counts)
        finally:
            self.release()

    # -- pieces: the resumable parts of a long stage (tokenize shards, generate shards)

    def _piece_key(self, name: str) -> str:
        return f"{PIECES_DIR}/{name}.json"

    def put_piece(self, name: str, piece_key: str, files: Iterable[FileEntry], counts: dict[str, Any] | None = None) -> None:
        """Record piece `name` as finished: its files are checked at the destination first, its sub-manifest is written last."""
        files = sorted(files, key=lambda e: e.path)
        self.confirm()
        problems = [p for p in check_files(self.store, files) if p is not None]
        if problems:
            raise ArtifactError(f"{self.url.rstrip('/')}/{problems[0].path} did not verify before its piece was recorded: {problems[0].detail}")
        piece = Manifest(kind=self.kind + PIECE_SUFFIX, config={STAGE_KEY: piece_key}, files=files, counts=counts or {})
        self.store.put_bytes(self._piece_key(name), piece.to_bytes())

    def finished_piece(self, name: str, piece_key: str) -> Manifest | None:
        """Piece `name`'s sub-manifest when it was recorded for `piece_key` and every file it lists reads back as listed."""
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
        """The names of the pieces recorded for `piece_key` (finished or not: `finished_piece` says) and of those recorded
        for another key or kind, each sorted; from the sub-manifests alone, no file is read."""
        recorded = recorded_pieces(self.store)
        ours = sorted(name for name, piece in recorded.items() if self._recorded_for(piece, piece_key))
        return ours, sorted(name for name in recorded if name not in ours)

    def _recorded_for(self, piece: Manifest, piece_key: str) -> bool:
        return piece.config.get(STAGE_KEY) == piece_key and piece.kind == self.kind + PIECE_SUFFIX

    def drop_piece(self, name: str) -> None:
        self.store.delete(self._piece_key(name))


__all__ = [
    "MANIFEST_NAME", "PIECES_DIR", "STAGE_KEY", "Holds", "OutputState", "RawInput", "StageInput", "StageOutput", "open_input",
    "open_raw_input", "recorded_manifest", "recorded_pieces", "refuse_nested", "stage_key",
]
