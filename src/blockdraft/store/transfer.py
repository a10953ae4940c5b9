"""Verified transfer of one artifact between a local folder and a store: `push` and `pull`; and `stage_and_push`, a
stage whose output is a remote store (written in a local staging folder, its finished pieces pushed while it runs).

Both follow the artifact rule (docs/STORE.md): the manifest moves last, byte for byte (so lineage digests
stay valid on every machine), and the report says only what was read back from the destination.
Both resume: files already verified at the destination are skipped; anything else is redone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, StoreError, first_few
from blockdraft.reporter import Reporter
from blockdraft.store import open_store
from blockdraft.store.artifact import (
    BYTES_AS_WRITTEN,
    INCOMING_DIR,
    MANIFEST_NAME,
    FileEntry,
    FileProblem,
    Manifest,
    State,
    VerifyReport,
    absent_detail,
    check_file,
    check_files,
    manifest_sha256,
    read_manifest,
    read_origin,
    record_origin,
    uncommit,
)
from blockdraft.store.base import ABSENT, Store
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import carry_agreement
from blockdraft.store.output import StageOutput, refuse_nested
from blockdraft.store.preflight import preflight
from blockdraft.store.writable import DISK_FULL, free_bytes, require_folder, write_failed


@dataclass
class TransferReport:
    """What one push or pull moved, skipped and verified. Byte counts in bytes, time in seconds."""

    source: str
    destination: str
    moved: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    moved_bytes: int = 0
    aborted_uploads: int = 0
    seconds: float = 0.0
    verify: VerifyReport | None = None

    @property
    def kind(self) -> str:
        """The artifact kind the destination's manifest names ("-" before it verified)."""
        return self.verify.manifest.kind if self.verify is not None and self.verify.manifest is not None else "-"

    def summary(self) -> str:
        verified = self.verify.summary() if self.verify else "not verified"
        rate = self.moved_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"{self.destination}: {len(self.moved)} files moved ({self.moved_bytes} bytes, {rate:.0f} MB/s), "
            f"{len(self.skipped)} already verified and skipped; {verified}"
        )


def _run_all(fn: Callable[[FileEntry], None], entries: list[FileEntry], workers: int) -> None:
    """Run fn over entries on `workers` threads; the first failure is raised after the others finish."""
    if not entries:
        return
    with ThreadPoolExecutor(max(1, min(workers, len(entries))), thread_name_prefix="transfer") as pool:
        for future in [pool.submit(fn, e) for e in entries]:
            future.result()


def _already_there(copy: StageOutput, report: TransferReport, start: float) -> bool:
    """True (and `report` filled, every file skipped) when the destination already holds the copy's manifest, byte for
    byte, and verifies (`StageOutput.done`, the one place that decides it)."""
    done = copy.done()
    if done is None:
        return False
    assert done.manifest is not None
    report.skipped = [e.path for e in done.manifest.files]
    report.verify, report.seconds = done, time.monotonic() - start
    return True


def push(
    local_dir: str | Path, url: str, store_config: StoreConfig | None = None, *, force: bool = False,
    reporter: Reporter | None = None
) -> TransferReport:
    """Upload the committed artifact in `local_dir` to `url`, verify every file there, then commit its manifest.

    Raises ArtifactError when the local folder holds no manifest or a file that does not match it, or the destination
    holds files that are not this artifact's kind's (`StageOutput.claim`); StoreError (after a preflight that takes
    seconds) when the destination cannot be written; LeaseError when another writer holds the destination, or one above
    or below it (one writer per output: the push takes its lease before the first byte). `force` and `reporter` go to
    that lease (`StageOutput`). Only this artifact's own unfinished uploads at the destination are aborted.
    The local folder is left as it was, its origin record included: a copy made elsewhere does not change what a stage
    reading the folder pins, so deleting that copy never turns the stage's output stale.
    """
    start = time.monotonic()
    source = LocalStore(local_dir)
    found = read_manifest(source)
    if found is None:
        raise ArtifactError(f"{source.root} has no {MANIFEST_NAME}: only committed artifacts are pushed; run the stage "
                            "that makes it first")
    manifest, raw = found
    for entry in manifest.files:
        path = source.root / entry.path
        if not path.is_file() or path.stat().st_size != entry.size:
            raise ArtifactError(f"local artifact {source.root} is not intact: {entry.path} is absent or has the wrong "
                                "size; run `blockdraft verify` on it")

    dest = open_store(url, store_config)
    refuse_nested(source, dest, "the local artifact")
    preflight(dest)
    report = TransferReport(source=source.url, destination=dest.url)
    copy = StageOutput.copy(dest, raw, force=force, reporter=reporter)
    if _already_there(copy, report, start):
        carry_agreement(source, dest, manifest_sha256(raw))  # measured since the last push, perhaps
        return report
    copy.begin()  # the lease first, then the old manifest goes: no reader sees it over new files
    try:
        report.aborted_uploads = dest.abort_partial_uploads([e.path for e in manifest.files])
        problems = check_files(dest, manifest.files)
        todo = [e for e, p in zip(manifest.files, problems) if p is not None]
        report.skipped = [e.path for e, p in zip(manifest.files, problems) if p is None]

        def upload(entry: FileEntry) -> None:
            # What the key holds, then the lease, then a write conditional on that: a push suspended anywhere in
            # between, whose lease another writer took meanwhile, replaces nothing that writer committed.
            there = dest.head(entry.path)
            copy.confirm()
            try:
                dest.put_file(entry.path, source.root / entry.path, entry.checksum,
                              over=ABSENT if there is None else there.etag)
            except OSError as exc:  # a file:// destination whose disk filled: its temp file is already removed
                full = write_failed(exc, dest.url, "rerun the push (files verified there are skipped)", entry.path,
                                    disk_only=True)
                if full is None:
                    raise
                raise full from None
            problem = check_file(dest, entry)
            if problem is not None:
                raise ArtifactError(f"{dest.url.rstrip('/')}/{entry.path} did not verify after upload: "
                                    f"{problem.detail}; rerun the push")

        try:
            _run_all(upload, todo, (store_config or StoreConfig()).concurrency)
            report.verify = copy.commit_copy()
        except (StoreError, ArtifactError, OSError):
            copy.raise_if_lost()
            raise
        carry_agreement(source, dest, manifest_sha256(raw))  # after the commit, still under the lease
        report.moved = [e.path for e in todo]
        report.moved_bytes = sum(e.size for e in todo)
    finally:
        copy.release()
    report.seconds = time.monotonic() - start
    return report


def _local_matches(dest: LocalStore, key: str, entry: FileEntry) -> bool:
    """Whether `key` in `dest` holds `entry`'s bytes, read now (`LocalStore.read_checksum`: no link followed)."""
    return dest.read_checksum(key) == (entry.size, entry.checksum)


def _refuse(url: str, problems: list[FileProblem]) -> ArtifactError:
    listed = first_few([f"{p.path} ({p.state.value}: {p.detail})" for p in problems], f"`blockdraft verify {url}` "
                                                                                      "lists them all")
    return ArtifactError(f"refusing to pull {url}: {len(problems):,} file(s) do not verify: {listed}")


def pull(
    url: str, local_dir: str | Path, store_config: StoreConfig | None = None, *, force: bool = False,
    reporter: Reporter | None = None
) -> TransferReport:
    """Download the artifact at `url` into `local_dir`, recomputing every checksum, and write its manifest last.

    Refuses (ArtifactError listing the bad files) an artifact with no manifest or with files that do not match it, and
    a local folder holding files that are not this artifact kind's (`StageOutput.claim`); a full disk is one
    StoreError line. A refused pull leaves the local folder as it was: new bytes land in an incoming folder first, and
    only when every one verified is the old local copy uncommitted and the files moved into place. `force` and
    `reporter` go to the folder's lease.
    """
    start = time.monotonic()
    workers = (store_config or StoreConfig()).concurrency
    source = open_store(url, store_config)
    found = read_manifest(source)
    if found is None:
        raise ArtifactError(f"refusing to pull {source.url}: no manifest there, so it is incomplete (nothing was "
                            "verified)")
    manifest, raw = found
    dest = LocalStore(local_dir)
    require_folder(dest, "pull destination", "pull into a folder")
    refuse_nested(source, dest, "the pulled artifact")
    report = TransferReport(source=source.url, destination=dest.url)
    copy = StageOutput.copy(dest, raw, force=force, reporter=reporter)
    if _already_there(copy, report, start):
        _note_pulled_copy(source, dest, raw)
        return report

    bad = _source_problems(source, manifest.files, workers)
    if bad:
        raise _refuse(source.url, bad)
    try:
        _pull_into(source, copy, manifest, report, workers)
    except OSError as exc:  # a folder this process may not write (read-only even for root), a full disk
        failed = write_failed(exc, dest.root, "rerun the pull")
        if failed is None:
            raise
        raise failed from None
    report.verify = VerifyReport(
        url=dest.url,
        state=State.VERIFIED,
        manifest=manifest,
        manifest_sha256=manifest_sha256(raw),
        verified_files=len(manifest.files),
        verified_bytes=sum(e.size for e in manifest.files),
        method=BYTES_AS_WRITTEN,
    )
    _note_pulled_copy(source, dest, raw)
    report.seconds = time.monotonic() - start
    return report


def _pull_into(source: Store, copy: StageOutput, manifest: Manifest, report: TransferReport, workers: int) -> None:
    """Under the folder's lease: claim it, download and swap in the files, then commit the manifest, read back with
    every file's size."""
    assert isinstance(copy.store, LocalStore)
    copy.claim(mark=False)  # marked at the swap: a refused pull leaves the folder as it was
    try:
        _download_and_swap(source, copy, manifest.files, report, workers)
        # Every file was just checksummed locally: downloaded ones on the very bytes written, kept ones by reading them
        # from disk; re-reading them all would only re-read the page cache.
        copy.commit_checked_copy()
    finally:
        copy.release()


def _download_and_swap(source: Store, copy: StageOutput, files: list[FileEntry], report: TransferReport,
                       workers: int) -> None:
    """Download what the local folder lacks into its incoming folder, each file's checksum recomputed on the bytes
    written; refuse (nothing local touched) if any differs; then uncommit the local copy and move the new files in."""
    dest = copy.store
    assert isinstance(dest, LocalStore)
    # Every working path goes through `dest` (`LocalStore.writing`, `read_checksum`, `move`): opened one name at a time
    # without following a link, so a link planted at the incoming folder (or below it) is refused, never written
    # through.
    dest.abort_partial_uploads([f"{INCOMING_DIR}/{e.path}" for e in files])  # temp files of an interrupted pull
    present = [_local_matches(dest, e.path, e) or _local_matches(dest, f"{INCOMING_DIR}/{e.path}", e) for e in files]
    todo = [e for e, ok in zip(files, present) if not ok]
    report.skipped = [e.path for e, ok in zip(files, present) if ok]
    need = sum(e.size for e in todo)
    free = free_bytes(dest.root)
    if need > free:
        raise StoreError(f"not enough local disk space in {dest.root}: the pull needs {need} bytes, {free} are free; "
                         "free space or pull elsewhere")
    bad: list[FileProblem] = []
    arrived: list[FileEntry] = []

    def download(entry: FileEntry) -> None:
        try:
            size, checksum = source.get_file(entry.path, dest, f"{INCOMING_DIR}/{entry.path}")
        except OSError as exc:
            if exc.errno in DISK_FULL:
                kept = sum(e.size for e in arrived)
                raise StoreError(
                    f"local disk full writing {Path(entry.path).name} into {dest.root} ({exc.strerror}; the pull needs "
                    f"{need:,} bytes); the local copy is as it was, and the {len(arrived)} file(s) ({kept:,} bytes) "
                    f"downloaded and verified so far stay in {dest.root / INCOMING_DIR}: free space, then rerun the "
                    "pull, which resumes from them (or delete that folder)"
                ) from None
            raise
        if size == entry.size and checksum == entry.checksum:
            arrived.append(entry)
        else:
            dest.delete(f"{INCOMING_DIR}/{entry.path}")
            bad.append(FileProblem(entry.path, State.CORRUPT, f"received {size} bytes crc64nvme {checksum} != listed "
                                                              f"{entry.size} bytes {entry.checksum}"))

    _run_all(download, todo, workers)
    if bad:
        raise _refuse(source.url, sorted(bad, key=lambda p: p.path))
    copy.mark_writing()  # from here on, files in place may belong to no manifest: a rerun resumes over them
    uncommit(dest)
    for entry in files:
        try:
            dest.move(f"{INCOMING_DIR}/{entry.path}", entry.path)
        except FileNotFoundError:
            pass  # already in place (verified there)
    dest.remove_folder(INCOMING_DIR)
    report.moved = [e.path for e in todo]
    report.moved_bytes = need


def _note_pulled_copy(source: Store, dest: LocalStore, raw: bytes) -> None:
    """A pulled copy names where it came from (that store's own origin when the source is itself a local copy of one)
    and carries the source's target agreement record."""
    sha = manifest_sha256(raw)
    record_origin(dest, read_origin(source, sha) or source.url, sha)
    carry_agreement(source, dest, sha)


def _source_problems(source: Store, files: list[FileEntry], workers: int) -> list[FileProblem]:
    """What the source's metadata already proves wrong, found before any byte moves.

    Presence and sizes come from one listing; a remote store's HEAD checksums add a cheap early check.
    Objects without a metadata checksum (and local folders) are judged by the recomputation while downloading.
    """
    sizes = {info.key: info.size for info in source.list()}
    heads = [None] * len(files)
    if source.local_path() is None:
        with ThreadPoolExecutor(max(1, min(workers, len(files) or 1))) as pool:
            heads = list(pool.map(lambda e: source.head(e.path) if e.path in sizes else None, files))
    bad = []
    for entry, info in zip(files, heads):
        if entry.path not in sizes:
            bad.append(FileProblem(entry.path, State.MISSING, absent_detail(source, entry, "source")))
        elif sizes[entry.path] != entry.size:
            bad.append(FileProblem(entry.path, State.CORRUPT, f"size {sizes[entry.path]} != listed {entry.size}"))
        elif info is not None and info.checksum is not None and info.checksum != entry.checksum:
            bad.append(FileProblem(entry.path, State.CORRUPT, f"crc64nvme {info.checksum} != listed {entry.checksum}"))
    return bad


def staging_folder(url: str, store_config: StoreConfig | None) -> Path:
    """Local folder where a stage writes an output bound for `url` (s3://bucket/prefix -> STAGING/bucket/prefix)."""
    base = Path((store_config or StoreConfig()).staging_dir)
    return base.joinpath(*[part for part in url.split("://", 1)[1].split("/") if part])


class _FinishedPiecePusher:
    """Uploads the pieces a running stage reports finished, so the push at the end finds them verified.

    Best effort: an upload that fails here is simply redone by the final `push`, which checks every file.
    """

    def __init__(self, local: Path, remote: Store, finished: Callable[[Path], list[FileEntry]], poll_s: float) -> None:
        self.local, self.remote, self.finished, self.poll_s = local, remote, finished, poll_s
        self.pushed: set[str] = set()
        self.uncommitted = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="push-finished", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._push_new()

    def _push_new(self) -> None:
        try:
            entries = self.finished(self.local)
        except (OSError, ValueError):
            return  # a record being written right now; the next poll reads it
        for entry in entries:
            if self._stop.is_set() or entry.path in self.pushed:
                continue
            try:
                if check_file(self.remote, entry) is None:  # already there, as a rerun finds it: nothing changes
                    self.pushed.add(entry.path)
                    continue
                if not self.uncommitted:  # the first byte that replaces the remote's content uncommits it first
                    uncommit(self.remote)
                    self.uncommitted = True
                self.remote.put_file(entry.path, self.local / entry.path, entry.checksum)
                if check_file(self.remote, entry) is None:
                    self.pushed.add(entry.path)
            except (StoreError, OSError):
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def stage_and_push(
    url: str,
    store_config: StoreConfig | None,
    kind: str,
    run_stage: Callable[[Path], object],
    finished: Callable[[Path], list[FileEntry]],
    poll_s: float = 0.5,
    reporter: Reporter | None = None,
    force: bool = False,
) -> tuple[object, TransferReport]:
    """Run a stage whose output is the remote `url`: preflight, stage locally, push finished pieces meanwhile, then
    push.

    `run_stage(local_dir)` writes and commits the artifact locally; `finished(local_dir)` lists the files it has
    completed so far (with their checksums). The remote must be this writer's to write (`StageOutput.claim` for an
    artifact of `kind`) before the first piece goes up. The remote's old manifest is removed before the first upload
    that changes anything there (so a rerun over a committed output that uploads nothing leaves it committed), and no
    reader sees it over new files; the final `push` verifies everything and writes the manifest last.
    `force` (`--force`) goes to the remote's lease: a dead writer's is taken over. Returns (what run_stage returned,
    the push report).
    """
    remote = open_store(url, store_config)
    preflight(remote)
    local = staging_folder(url, store_config)
    local.mkdir(parents=True, exist_ok=True)
    # One writer from the first piece pushed to the commit; the final push takes the lease again (re-entrant). The key
    # is never asked: this writer only claims the output, and the push commits the staged artifact's own manifest.
    out = StageOutput(remote, kind, "", force=force, reporter=reporter)
    out.claim()
    try:
        pusher = _FinishedPiecePusher(local, remote, finished, poll_s)
        try:
            result = run_stage(local)
        finally:
            pusher.stop()
        report = push(local, url, store_config, force=force, reporter=reporter)
    finally:
        out.release()
    return result, report
