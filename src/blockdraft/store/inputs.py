"""A stage's input, read only once it verified: an artifact (`open_input`) or a plain object someone uploaded
(`open_raw_input`), each pinned by content for lineage (`ref`) and fetched with its checksums compared. A stage never
downloads by hand, and never reads a manifest itself: `recorded_manifest` names an artifact's kind or an input's
provenance, unverified.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.store import ObjectInfo, Store, open_store
from blockdraft.store.artifact import (
    FileEntry,
    InputRef,
    Manifest,
    State,
    VerifyReport,
    check_files,
    raw_input,
    read_manifest,
    read_origin,
    verify_artifact,
)
from blockdraft.store.local import LocalStore


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
        """The input by content. A pulled copy of a store's artifact is pinned at the store it came from, so `status`
        checks it there from any machine, not at a folder that only this machine holds; any other folder pins itself (a
        push from it records nothing in it)."""
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
                    f"{self.store.url.rstrip('/')}/{path} changed while read (received {size} bytes crc64nvme "
                    f"{checksum}, listed {entry.size} bytes {entry.checksum}); rerun when the input is stable"
                )
        return dest

    def _check_local(self, paths: Sequence[str]) -> None:
        entries = [self.entry(path) for path in paths]
        for entry, problem in zip(entries, check_files(self.store, entries)):
            if problem is not None:
                raise ArtifactError(
                    f"{self.store.url.rstrip('/')}/{entry.path} does not match its manifest as read now "
                    f"({problem.detail}); the file changed or rotted on disk: restore it (pull it again) or rerun the "
                    "stage that made it"
                )

    @contextmanager
    def fetched(self, paths: Sequence[str] | None = None) -> Iterator[Path]:
        """`fetch` into a temporary folder that is removed afterwards; all listed files when `paths` is None."""
        names = [e.path for e in self.manifest.files] if paths is None else list(paths)
        with tempfile.TemporaryDirectory(prefix="blockdraft-input-") as tmp:
            yield self.fetch(names, Path(tmp))


def open_input(url: str | Store, store_config: StoreConfig | None = None, kinds: Sequence[str] = (),
               role: str = "input") -> StageInput:
    """The artifact at `url`, verified at its source, else ArtifactError naming its state; `kinds` limits what it may
    be.

    `role` names the input in the error (a config field such as "train.data", or "input").
    """
    store = url if isinstance(url, Store) else open_store(url, store_config)
    report = verify_artifact(store)
    if report.state is State.INCOMPLETE and next(iter(store.list()), None) is None:
        raise ArtifactError(f"{role} {store.url} does not exist (nothing there); check the path or URL")
    if report.state is not State.VERIFIED or report.manifest is None:
        raise ArtifactError(f"{role} {store.url} is {report.state.value}: {report.summary()}; fix or regenerate it "
                            "first")
    if kinds and report.manifest.kind not in kinds:
        raise ArtifactError(
            f"{role} {store.url} is a '{report.manifest.kind}' artifact, not {' or '.join(repr(k) for k in kinds)}; "
            "pass the right artifact"
        )
    return StageInput(store, report)


@dataclass
class RawInput:
    """A plain object without a manifest (prompts or completions someone uploaded), pinned by what the store reports for
    it: its size and CRC64NVME, or its ETag when the store holds no checksum. Reading it back is checked against
    that."""

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
            raise ArtifactError(f"{self.url} changed while read (received {size} bytes, pinned {self.info.size}); "
                                "rerun when it is stable")
        return dest


def open_raw_input(url: str, store_config: StoreConfig | None = None, role: str = "input") -> RawInput:
    """The single object at `url` (a local path, file:// or s3:// URL), pinned by what its store reports; ConfigError
    when absent."""
    parent, _, key = url.rstrip("/").rpartition("/")
    store = open_store(parent or ".", store_config)
    info = store.head(key)
    if info is None:
        raise ConfigError(f"{role} {url} does not exist; pass an existing file or object")
    return RawInput(store, info)


def recorded_manifest(store: Store) -> Manifest | None:
    """The manifest at `store` as recorded, not verified (for naming an artifact's kind, or an input's provenance), or
    None when there is none; ArtifactError for one that does not parse. Whether an output is done is
    `StageOutput.done`'s."""
    found = read_manifest(store)
    return None if found is None else found[0]


__all__ = ["RawInput", "StageInput", "open_input", "open_raw_input", "recorded_manifest"]
