"""Artifacts and their manifests: the one definition of "done" that every stage and `status` use.

An artifact is a set of files under one store root plus `MANIFEST_NAME`, written last. It is done only when the
manifest is at the destination and every file it lists is there with the listed size and CRC64NVME checksum,
as read back from the destination (docs/STORE.md).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from blockdraft import __version__
from blockdraft.errors import ArtifactError, StoreError
from blockdraft.store import open_store
from blockdraft.store.base import ObjectInfo, Store
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.local import LocalStore

MANIFEST_NAME = "blockdraft-manifest.json"
MANIFEST_FORMAT = "blockdraft-manifest/1"
# Beside the manifest of a local copy (pulled, or pushed from here): where the same manifest, byte for byte, lives in a
# store. Not listed in the manifest: it says where this copy came from or went, not what the artifact is.
ORIGIN_NAME = ".blockdraft-origin.json"


class State(str, Enum):
    VERIFIED = "verified"
    INCOMPLETE = "incomplete"
    MISSING = "missing"
    CORRUPT = "corrupt"
    STALE = "stale"
    # An input that only another machine holds (a local folder absent here): nothing is known to have changed, but
    # the pin cannot be checked from this machine. Not `stale`, which means an input's content changed.
    UNREACHABLE = "input unreachable here"


class FileEntry(BaseModel):
    path: str
    size: int
    checksum: str  # base64 CRC64NVME


class InputRef(BaseModel):
    """One input of an artifact, by content.

    kind "manifest": another artifact, pinned by the sha256 of its manifest bytes.
    kind "raw": a file without a manifest (completions someone else uploaded), pinned by size and checksum/ETag.
    """

    kind: str
    url: str
    sha256: str | None = None
    size: int | None = None
    checksum: str | None = None
    etag: str | None = None


class Manifest(BaseModel):
    format: str = MANIFEST_FORMAT
    kind: str
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    tool_version: str = __version__
    config: dict[str, Any] = Field(default_factory=dict)
    lineage: list[InputRef] = Field(default_factory=list)
    files: list[FileEntry] = Field(default_factory=list)
    counts: dict[str, Any] = Field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(store: Store) -> tuple[Manifest, bytes] | None:
    """The artifact's manifest as read from the destination, or None if there is none; ArtifactError for bytes that are
    not a blockdraft manifest (torn, edited, another tool's file)."""
    try:
        data = store.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    try:
        return Manifest.model_validate_json(data), data
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise ArtifactError(
            f"{store.url.rstrip('/')}/{MANIFEST_NAME} is not a valid blockdraft manifest ({where}: {first['msg']}); "
            "re-run the stage (or push/pull) that wrote it"
        ) from None


def record_origin(local: Store, url: str, sha256: str) -> None:
    """Note in the local copy `local` that the artifact with manifest digest `sha256` is also at `url` (a store)."""
    local.put_bytes(ORIGIN_NAME, json.dumps({"url": url, "manifest_sha256": sha256}, sort_keys=True).encode() + b"\n")


def read_origin(store: Store, sha256: str | None) -> str | None:
    """The store URL that a local copy names as its origin, when it names one for this very manifest; else None
    (a record for another manifest is an old copy's, and a remote store is its own origin)."""
    if store.local_path() is None or sha256 is None:
        return None
    try:
        origin = json.loads(store.read_bytes(ORIGIN_NAME))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(origin, dict) or origin.get("manifest_sha256") != sha256 or not isinstance(origin.get("url"), str):
        return None
    return origin["url"]


def raw_input(store: Store, info: ObjectInfo) -> InputRef:
    return InputRef(kind="raw", url=f"{store.url.rstrip('/')}/{info.key}", size=info.size, checksum=info.checksum, etag=info.etag)


@dataclass
class FileProblem:
    path: str
    state: State
    detail: str


@dataclass
class VerifyReport:
    url: str
    state: State
    manifest: Manifest | None = None
    manifest_sha256: str | None = None
    problems: list[FileProblem] = field(default_factory=list)
    verified_files: int = 0
    verified_bytes: int = 0
    method: str = ""  # what the file checks compared with the manifest (`check_method`)

    def summary(self) -> str:
        if self.state is State.VERIFIED:
            how = f" ({self.method})" if self.method else ""
            return f"{self.verified_files} files, {self.verified_bytes} bytes verified at the destination{how}"
        if not self.problems:
            return "no manifest at the destination" if self.state is State.INCOMPLETE else self.state.value
        head = "; ".join(f"{p.path}: {p.detail}" for p in self.problems[:5])
        more = f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        return head + more


def check_file(store: Store, entry: FileEntry, deep: bool = False, info: ObjectInfo | None = None) -> FileProblem | None:
    """None when the destination holds `entry` with its size and checksum; else what is wrong.

    A remote store's checksum comes from its metadata (what the server stored at upload) unless `deep`, which reads every
    byte back and recomputes it; a local folder is always read. An object that cannot be read back is corrupt. `info`:
    what `head` says, when the caller already has it.
    """
    info = info or store.head(entry.path)
    if info is None:
        return FileProblem(entry.path, State.MISSING, "absent at the destination")
    if info.size != entry.size:
        return FileProblem(entry.path, State.CORRUPT, f"size {info.size} != listed {entry.size}")
    checksum = None if deep else info.checksum
    if checksum is None:
        # No checksum in the metadata proves nothing (and `deep` trusts none): read the object back and recompute.
        try:
            size, checksum = store.checksum_by_reading(entry.path)
        except (StoreError, OSError) as exc:
            return FileProblem(entry.path, State.CORRUPT, f"unreadable: {exc}")
        if size != entry.size:
            return FileProblem(entry.path, State.CORRUPT, f"size {size} != listed {entry.size}")
    if checksum != entry.checksum:
        return FileProblem(entry.path, State.CORRUPT, f"crc64nvme {checksum} != listed {entry.checksum}")
    return None


VERIFY_WORKERS = 8
BYTES_READ_BACK = "bytes read back"
SERVER_CHECKSUMS = "checksums as stored by the server"
LOCAL_CACHED = "bytes read back, or the checksum cached when an unchanged file was last read"

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _check_pool() -> ThreadPoolExecutor:
    """This process's file-check threads, started once and reused (a pool per artifact, and on a local store a new cache
    connection per thread, cost more than the checks of thousands of small artifacts); a forked child starts its own."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="blockdraft-check"))
        return _pool[1]


def check_files(store: Store, entries: list[FileEntry], deep: bool = False) -> list[FileProblem | None]:
    """`check_file` for each entry, in order; in parallel, as each is a round trip (S3 HEAD) or a read, except the local files
    unchanged since they were last read: their cached checksums answer at once, which handing them to threads would slow."""
    local = store if isinstance(store, LocalStore) and not deep and len(entries) > 1 else None
    known = {e.path: i for e in entries if (i := local.cached_head(e.path))} if local is not None else {}
    slow = [e for e in entries if e.path not in known]
    try:
        results = _check_pool().map(lambda e: check_file(store, e, deep), slow) if len(slow) > 1 else None
    except RuntimeError:  # no new work for threads while the interpreter shuts down: check them one by one
        results = None
    done = {} if results is None else dict(zip([e.path for e in slow], results))
    return [done[e.path] if e.path in done else check_file(store, e, deep, known.get(e.path)) for e in entries]


def check_method(store: Store, deep: bool) -> str:
    """What a file check of `store` compares with the manifest, in words for reports."""
    if deep:
        return BYTES_READ_BACK
    return LOCAL_CACHED if store.local_path() is not None else SERVER_CHECKSUMS


def _unreachable(store: Store, within: str | None) -> bool:
    """An input location that this machine cannot see: a local folder that does not exist here and lies outside the
    surveyed prefix (inside it, an absent input is gone, not out of reach)."""
    local = store.local_path()
    if local is None or local.exists():
        return False
    return within is None or not _under(store.url, within)


def _under(url: str, prefix: str) -> bool:
    url, prefix = url.rstrip("/"), prefix.rstrip("/")
    return url == prefix or url.startswith(prefix + "/")


def _raw_input_changed(ref: InputRef, open_url: Callable[[str], Store], within: str | None) -> FileProblem | None:
    """A raw input (no manifest) is pinned by size and its checksum, or its ETag when it had no checksum."""
    parent, _, key = ref.url.rpartition("/")
    try:
        store = open_url(parent)
        info = store.head(key)
    except Exception as exc:  # a location this machine cannot read: the pin can be neither confirmed nor refuted
        return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here ({type(exc).__name__})")
    if info is None:
        if _unreachable(store, within):
            return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here (no such folder on this machine)")
        return FileProblem(ref.url, State.STALE, f"input {ref.url} is gone")
    reason = None
    if info.size != ref.size:
        reason = f"input {ref.url} changed since (size {info.size} != {ref.size})"
    elif ref.checksum is not None:
        current = info.checksum if info.checksum is not None else store.checksum_by_reading(key)[1]
        if current != ref.checksum:
            reason = f"input {ref.url} changed since (crc64nvme differs)"
    elif ref.etag is not None and info.etag != ref.etag:
        reason = f"input {ref.url} changed since (ETag differs)"
    return FileProblem(ref.url, State.STALE, reason) if reason else None


def _input_changed(
    ref: InputRef, open_url: Callable[[str], Store], within: str | None, memo: dict[str, VerifyReport], deep: bool = False
) -> FileProblem | None:
    """Whether input `ref` still holds what was pinned, judged transitively: an input artifact whose own files no longer
    verify, or whose own inputs changed, makes its dependants stale too."""
    if ref.kind == "raw":
        return _raw_input_changed(ref, open_url, within)
    if ref.kind != "manifest":
        return None
    try:
        store = open_url(ref.url)
        report = verify_artifact(store, check_inputs=True, open_url=open_url, within=within, memo=memo, deep=deep)
    except Exception as exc:  # a location this machine cannot read: the pin can be neither confirmed nor refuted
        return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here ({type(exc).__name__})")
    if report.manifest_sha256 is None:
        if _unreachable(store, within):
            return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here (no such folder on this machine)")
        return FileProblem(ref.url, State.STALE, f"input {ref.url} has no manifest any more")
    if report.manifest_sha256 != ref.sha256:
        return FileProblem(ref.url, State.STALE, f"input {ref.url} changed since")
    if report.state in (State.MISSING, State.CORRUPT, State.STALE):
        return FileProblem(ref.url, State.STALE, f"input {ref.url} is {report.state.value} now ({report.summary()})")
    if report.state is State.UNREACHABLE:
        return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} has an input unreachable here ({report.summary()})")
    return None


def verify_artifact(
    store: Store,
    check_inputs: bool = False,
    open_url: Callable[[str], Store] | None = None,
    within: str | None = None,
    memo: dict[str, VerifyReport] | None = None,
    deep: bool = False,
) -> VerifyReport:
    """Read the manifest and every listed file back from the destination; report one of the six states.

    Precedence: no manifest -> incomplete; any absent file -> missing; any size/checksum mismatch -> corrupt;
    with `check_inputs`, an input whose content changed (transitively) -> stale; an input this machine cannot reach ->
    unreachable; else verified. `within` is the surveyed prefix (an absent local input inside it is gone, outside it is
    out of reach); `memo` shares reports by URL across one survey, so each artifact is read once and a cycle ends.
    `deep` reads every byte of a remote store back instead of trusting the checksums its server stored (`check_file`).
    A manifest that does not parse is `corrupt`; a store that cannot be reached raises StoreError (one line, not a state).
    """
    memo = {} if memo is None else memo
    key = store.url.rstrip("/")
    if check_inputs and key in memo:
        return memo[key]
    method = check_method(store, deep)
    try:
        found = read_manifest(store)
    except ArtifactError as exc:  # bytes that are not a manifest; a store that cannot be reached raises StoreError instead
        return VerifyReport(url=store.url, state=State.CORRUPT, problems=[FileProblem(MANIFEST_NAME, State.CORRUPT, str(exc))], method=method)
    if found is None:
        return VerifyReport(url=store.url, state=State.INCOMPLETE, method=method)
    manifest, raw = found
    report = _files_report(store, manifest, raw, check_files(store, manifest.files, deep))
    report.method = method
    states = {p.state for p in report.problems}
    if State.MISSING in states:
        report.state = State.MISSING
    elif State.CORRUPT in states:
        report.state = State.CORRUPT
    elif check_inputs:
        memo[key] = report  # seen: an input cycle ends here
        for ref in manifest.lineage:
            problem = _input_changed(ref, open_url or open_store, within, memo, deep)
            if problem is not None:
                report.problems.append(problem)
        states = {p.state for p in report.problems}
        if State.STALE in states:
            report.state = State.STALE
        elif State.UNREACHABLE in states:
            report.state = State.UNREACHABLE
    if check_inputs:
        memo[key] = report
    return report


def _files_report(store: Store, manifest: Manifest, raw: bytes, problems: list[FileProblem | None]) -> VerifyReport:
    """A report of `manifest`'s files from their destination checks (one per file, None = verified)."""
    report = VerifyReport(url=store.url, state=State.VERIFIED, manifest=manifest, manifest_sha256=manifest_sha256(raw))
    for entry, problem in zip(manifest.files, problems):
        if problem is None:
            report.verified_files += 1
            report.verified_bytes += entry.size
        else:
            report.problems.append(problem)
    return report


def uncommit(store: Store) -> None:
    """Remove the manifest before rewriting an artifact, so no reader sees an old manifest over new files."""
    store.delete(MANIFEST_NAME)


def commit_artifact(
    store: Store,
    kind: str,
    files: Iterable[FileEntry],
    config: dict[str, Any] | None = None,
    lineage: Iterable[InputRef] = (),
    counts: dict[str, Any] | None = None,
) -> VerifyReport:
    """Write the manifest last, after every file verified at the destination (see `commit_manifest`).

    `files` carry the checksums computed while the writer produced them; each is compared with what the
    destination holds, so the report returned is read from the destination, never assumed.
    """
    files = sorted(files, key=lambda e: e.path)
    manifest = Manifest(kind=kind, config=config or {}, lineage=list(lineage), files=files, counts=counts or {})
    return commit_manifest(store, manifest.to_bytes())


def commit_manifest(store: Store, raw: bytes) -> VerifyReport:
    """Commit an existing manifest byte for byte (a pushed or pulled artifact keeps its lineage digest).

    Every listed file is checked at the destination first (each is read or HEADed once, not twice: on a
    folder store a check reads the whole file), then the manifest is written last and read back byte for byte.
    """
    manifest = Manifest.model_validate_json(raw)
    problems = check_files(store, manifest.files)
    for entry, problem in zip(manifest.files, problems):
        if problem is not None:
            raise ArtifactError(f"{store.url.rstrip('/')}/{entry.path} did not verify before commit: {problem.detail}")
    store.put_bytes(MANIFEST_NAME, raw)
    back = read_manifest(store)
    if back is None or back[1] != raw:
        raise ArtifactError(f"{store.url}/{MANIFEST_NAME} did not read back as written; rerun the stage")
    report = _files_report(store, manifest, raw, problems)
    report.method = check_method(store, deep=False)  # what the checks before the commit compared, for the report's line
    return report


def entry_for_local_file(root: Path, path: Path) -> FileEntry:
    """The manifest entry of local file `path` under `root`: its '/'-separated relative path, size and checksum."""
    size, checksum = crc64nvme_file(path)
    return FileEntry(path=path.relative_to(root).as_posix(), size=size, checksum=checksum)
