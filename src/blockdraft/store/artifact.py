"""Artifacts: the one definition of "done" that every stage and `status` use.

An artifact is a set of files under one store root plus `MANIFEST_NAME` (`manifest.py`), written last. It is done only
when the manifest is at the destination and every file it lists is there with the listed size and CRC64NVME checksum,
as read back from the destination (docs/STORE.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from blockdraft.errors import ArtifactError, OutsideArtifactError, StoreError, first_few
from blockdraft.store import open_store
from blockdraft.store.base import ObjectInfo, Store
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import (
    INCOMING_DIR,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MEASURED,
    ORIGIN_NAME,
    PIECES_DIR,
    FileEntry,
    InputRef,
    Manifest,
    entry_for_local_file,
    entry_path_problem,
    folder_sha256,
    manifest_sha256,
    raw_input,
    read_manifest,
    read_origin,
    record_origin,
)


class State(str, Enum):
    VERIFIED = "verified"
    INCOMPLETE = "incomplete"
    MISSING = "missing"
    CORRUPT = "corrupt"
    STALE = "stale"
    # An input that only another machine holds (a local folder absent here): nothing is known to have changed, but
    # the pin cannot be checked from this machine. Not `stale`, which means an input's content changed.
    UNREACHABLE = "input unreachable here"
    # An input pinned in a way `status` cannot check (rows read through `datasets` from the hub): the artifact's own
    # files verified, but whether that input changed is unknown. Never plain `verified`.
    UNCHECKED = "input unchecked"


@dataclass
class FileProblem:
    path: str
    state: State
    detail: str
    # Whether it makes what is made from this artifact stale (or unreachable) too: False for a problem of an input this
    # artifact only measured (`MEASURED`), which changes its figures but nothing made from it.
    passed_on: bool = True


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
        return first_few([f"{p.path}: {p.detail}" for p in self.problems])


def check_file(
    store: Store, entry: FileEntry, deep: bool = False, info: ObjectInfo | None = None, cached: bool = False
) -> FileProblem | None:
    """None when the destination holds `entry` with its size and checksum; else what is wrong.

    A local folder's file is read and its checksum computed from its bytes, unless `cached` (the `status`/`verify`
    listings), where a file unchanged since it was last read keeps the checksum computed then (`checksum_cache`). A
    remote store's checksum comes from its metadata (what the server stored at upload) unless `deep`, which reads every
    byte back and recomputes it. An object that cannot be read back, or a file that resolves outside the artifact, is
    corrupt. `info`: what `head` says, when the caller already has it.
    """
    local = isinstance(store, LocalStore)
    try:
        if info is None:
            info = store.read_head(entry.path) if local and (deep or not cached) else store.head(entry.path)
    except OutsideArtifactError as exc:
        return FileProblem(entry.path, State.CORRUPT, str(exc))
    if info is None:
        return FileProblem(entry.path, State.MISSING, absent_detail(store, entry))
    if info.size != entry.size:
        return FileProblem(entry.path, State.CORRUPT, f"size {info.size} != listed {entry.size}")
    checksum = None if deep and not local else info.checksum
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


def absent_detail(store: Store, entry: FileEntry, side: str = "destination") -> str:
    """Why `store` (the `side` of a check) holds no file `entry`: plainly absent, or, in a local folder, a folder
    standing where the manifest lists a file, which a reader would otherwise take for a lost file."""
    root = store.local_path()
    where = os.path.join(root, entry.path) if root is not None else None
    if where is None or not os.path.isdir(where) or os.path.islink(where):
        return f"absent at the {side}"
    return (f"a folder, not the file of {entry.size} bytes the manifest lists; move that folder away and rerun the "
            "command that wrote the artifact")


VERIFY_WORKERS = 8
BYTES_READ_BACK = "bytes read back"
# pull: each file's CRC64NVME computed on the bytes as they were received and written, not read back from the disk
BYTES_AS_WRITTEN = "bytes checksummed as they were written"
SERVER_CHECKSUMS = "checksums as stored by the server"
LOCAL_CACHED = "checksums cached for unchanged files, bytes read back for the others"

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


def check_files(
    store: Store, entries: list[FileEntry], deep: bool = False, cached: bool = False
) -> list[FileProblem | None]:
    """`check_file` for each entry, in order; in parallel, as each is a round trip (S3 HEAD) or a read. With `cached`
    (the listings), local files unchanged since they were last read answer from the cache at once, which threads would
    slow."""
    local = store if isinstance(store, LocalStore) and cached and not deep and len(entries) > 1 else None
    known = {e.path: i for e in entries if (i := local.cached_head(e.path))} if local is not None else {}
    slow = [e for e in entries if e.path not in known]
    try:
        results = (
            _check_pool().map(lambda e: check_file(store, e, deep, cached=cached), slow) if len(slow) > 1 else None
        )
    except RuntimeError:  # no new work for threads while the interpreter shuts down: check them one by one
        results = None
    done = {} if results is None else dict(zip([e.path for e in slow], results))
    return [done[e.path] if e.path in done else check_file(store, e, deep, known.get(e.path), cached) for e in entries]


def check_method(store: Store, deep: bool, cached: bool = False) -> str:
    """What a file check of `store` compares with the manifest, in words for reports."""
    if store.local_path() is not None:
        return LOCAL_CACHED if cached and not deep else BYTES_READ_BACK
    return BYTES_READ_BACK if deep else SERVER_CHECKSUMS


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
            return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here (no such folder on this "
                                                           "machine)")
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


def _folder_changed(ref: InputRef, open_url: Callable[[str], Store], within: str | None) -> FileProblem | None:
    """A folder without a manifest is pinned by the sha256 of its files (`folder_sha256`): gone, or any file added,
    removed or changed, is stale; a folder whose parent this machine lacks is out of reach, as a raw input's is."""
    try:
        store = open_url(ref.url)
        digest = folder_sha256(store)
    except Exception as exc:  # a location this machine cannot read: the pin can be neither confirmed nor refuted
        return FileProblem(ref.url, State.UNREACHABLE, f"input {ref.url} unreachable here ({type(exc).__name__})")
    if digest is None:
        parent = store.parent()
        if parent is not None and _unreachable(parent, within):
            detail = f"input {ref.url} unreachable here (no such folder on this machine)"
            return FileProblem(ref.url, State.UNREACHABLE, detail)
        return FileProblem(ref.url, State.STALE, f"input {ref.url} is gone")
    if digest != ref.sha256:
        detail = f"input {ref.url} changed since (a file in it added, removed or changed)"
        return FileProblem(ref.url, State.STALE, detail)
    return None


# The lineage kinds `status` checks; any other (rows read through `datasets` from the hub) is said to be unchecked.
CHECKED_KINDS = ("manifest", MEASURED, "raw", "folder")


def _input_changed(
    ref: InputRef, open_url: Callable[[str], Store], within: str | None, memo: dict[str, VerifyReport],
    deep: bool = False, cached: bool = False,
) -> FileProblem | None:
    """Whether input `ref` still holds what was pinned, judged transitively: an input artifact whose own files no longer
    verify, or whose own inputs changed, makes its dependants stale too. A measured input (`MEASURED`) is judged by its
    pin and its own files only, and its problems are not passed on: an input stale only through what it measured is not
    stale for its dependants (a checkpoint's train.eval_data changes its held-out figures, not its weights)."""
    if ref.kind == "raw":
        return _raw_input_changed(ref, open_url, within)
    if ref.kind == "folder":
        return _folder_changed(ref, open_url, within)
    if ref.kind not in CHECKED_KINDS:
        return FileProblem(ref.url, State.UNCHECKED, f"input {ref.url} is pinned by the {ref.kind} rows read, "
                           "which status cannot read again: whether it changed is not checked")
    passed_on = ref.kind != MEASURED

    def problem(state: State, detail: str) -> FileProblem:
        return FileProblem(ref.url, state, f"input {ref.url} {detail}", passed_on)

    try:
        store = open_url(ref.url)
        report = verify_artifact(store, check_inputs=True, open_url=open_url, within=within, memo=memo, deep=deep,
                                 cached=cached)
    except Exception as exc:  # a location this machine cannot read: the pin can be neither confirmed nor refuted
        return problem(State.UNREACHABLE, f"unreachable here ({type(exc).__name__})")
    if report.manifest_sha256 is None:
        if _unreachable(store, within):
            return problem(State.UNREACHABLE, "unreachable here (no such folder on this machine)")
        return problem(State.STALE, "has no manifest any more")
    if report.manifest_sha256 != ref.sha256:
        return problem(State.STALE, "changed since")
    if report.state in (State.MISSING, State.CORRUPT):
        return problem(State.STALE, f"is {report.state.value} now ({report.summary()})")
    if not passed_on:  # what a measured input was made from is not this artifact's concern
        return None
    inherited = {p.state for p in report.problems if p.passed_on}
    if State.STALE in inherited:
        return problem(State.STALE, f"is stale now ({report.summary()})")
    if State.UNREACHABLE in inherited:
        return problem(State.UNREACHABLE, f"has an input unreachable here ({report.summary()})")
    if State.UNCHECKED in inherited:
        return problem(State.UNCHECKED, f"has an input unchecked ({report.summary()})")
    return None


def verify_artifact(
    store: Store,
    check_inputs: bool = False,
    open_url: Callable[[str], Store] | None = None,
    within: str | None = None,
    memo: dict[str, VerifyReport] | None = None,
    deep: bool = False,
    cached: bool = False,
) -> VerifyReport:
    """Read the manifest and every listed file back from the destination; report one of the seven states.

    Precedence: no manifest -> incomplete; any absent file -> missing; any size/checksum mismatch -> corrupt;
    with `check_inputs`, an input whose content changed (transitively) -> stale; an input this machine cannot reach ->
    unreachable; an input pinned in a way no check reaches -> unchecked; else verified. `within` is the surveyed prefix
    (an absent local input inside it is gone, outside it is out of reach); `memo` shares reports by URL across one
    survey, so each artifact is read once and a cycle ends.
    `deep` reads every byte of a remote store back instead of trusting the checksums its server stored; `cached` lets a
    listing (`status`, `verify`) take a local file's checksum from the cache when the file is unchanged (`check_file`).
    A manifest that does not parse is `corrupt`; a store that cannot be reached raises StoreError (one line, not a
    state).
    """
    memo = {} if memo is None else memo
    key = store.url.rstrip("/")
    if check_inputs and key in memo:
        return memo[key]
    method = check_method(store, deep, cached)
    try:
        found = read_manifest(store)
    except ArtifactError as exc:
        # bytes that are not a manifest; a store that cannot be reached raises StoreError instead
        return VerifyReport(url=store.url, state=State.CORRUPT,
                            problems=[FileProblem(MANIFEST_NAME, State.CORRUPT, str(exc))], method=method)
    if found is None:
        return VerifyReport(url=store.url, state=State.INCOMPLETE, method=method)
    manifest, raw = found
    report = _files_report(store, manifest, raw, check_files(store, manifest.files, deep, cached))
    report.method = method
    states = {p.state for p in report.problems}
    if State.MISSING in states:
        report.state = State.MISSING
    elif State.CORRUPT in states:
        report.state = State.CORRUPT
    elif check_inputs:
        memo[key] = report  # seen: an input cycle ends here
        for ref in manifest.lineage:
            problem = _input_changed(ref, open_url or open_store, within, memo, deep, cached)
            if problem is not None:
                report.problems.append(problem)
        states = {p.state for p in report.problems}
        if State.STALE in states:
            report.state = State.STALE
        elif State.UNREACHABLE in states:
            report.state = State.UNREACHABLE
        elif State.UNCHECKED in states:
            report.state = State.UNCHECKED
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


def commit_manifest(store: Store, raw: bytes, if_absent: bool = False) -> VerifyReport:
    """Commit an existing manifest byte for byte (a pushed or pulled artifact keeps its lineage digest).

    Every listed file is checked at the destination first (each is read or HEADed once, not twice: on a
    folder store a check reads the whole file), then the manifest is written last and read back byte for byte.
    `if_absent`: written only where no manifest is (a copy whose writer took the old one down first), so a writer that
    lost its lease while suspended never replaces the manifest the new writer committed.
    """
    manifest = Manifest.model_validate_json(raw)
    problems = check_files(store, manifest.files)
    for entry, problem in zip(manifest.files, problems):
        if problem is not None:
            raise ArtifactError(f"{store.url.rstrip('/')}/{entry.path} did not verify before commit: {problem.detail}")
    if not if_absent:
        store.put_bytes(MANIFEST_NAME, raw)
    elif not store.put_bytes_if_absent(MANIFEST_NAME, raw):
        raise ArtifactError(f"{store.url.rstrip('/')}/{MANIFEST_NAME} appeared while this run wrote there (another "
                            "writer committed); this copy was not committed")
    back = read_manifest(store)
    if back is None or back[1] != raw:
        raise ArtifactError(f"{store.url}/{MANIFEST_NAME} did not read back as written; rerun the stage")
    report = _files_report(store, manifest, raw, problems)
    report.method = check_method(store, deep=False)  # what the checks before the commit compared, for the report's line
    return report


__all__ = [
    "BYTES_AS_WRITTEN", "BYTES_READ_BACK", "CHECKED_KINDS", "INCOMING_DIR", "LOCAL_CACHED", "MANIFEST_FORMAT",
    "MANIFEST_NAME", "MEASURED", "ORIGIN_NAME", "PIECES_DIR",
    "SERVER_CHECKSUMS", "FileEntry", "FileProblem", "InputRef", "Manifest", "State", "VerifyReport",
    "check_file", "check_files", "check_method", "commit_artifact", "commit_manifest", "entry_for_local_file",
    "entry_path_problem", "manifest_sha256", "raw_input", "read_manifest", "read_origin", "record_origin", "uncommit",
    "verify_artifact",
]
