"""A stage's output: whether it is already done, and whether this run may write it. Every stage writes through here.

    out = StageOutput(url, kind, key, store_config)     # key: what the output depends on (`stage_key`)
    if (report := out.done()) is not None:              # already there, made for this key, verified, nothing failed
        return report
    out.begin()                                         # this run's to write: lease, ownership, old manifest taken down
    for piece in work:                                   # optional: resumable pieces (shards)
        if out.finished_piece(name, piece_key) is None:
            ... write files ...; out.put_piece(name, piece_key, files, counts)
    out.commit(files, config=..., lineage=[inp.ref], counts=...)   # every file checked at the destination, manifest last

**Done** is decided from the destination's manifest alone, by `StageOutput.done`; no stage reads its own manifest to decide.
An output is done when its manifest was made for this run (its kind; the config values the stage names in `made_with`,
compared before the key, which may read the inputs; then the key itself) and its files verify, and its commit recorded
nothing under the counts field the stage names in `failures` (a run that left inputs out is redone for them). A torn or
foreign manifest, or files that no longer verify, is not done: the output is made again. A copy (push, pull) is done
when it holds its source's manifest byte for byte and verifies. `finished_piece` decides the same for one piece of a
long stage: a sub-manifest in the same model under `.blockdraft-pieces/`, written after its files verified.

**Who may write** is decided by `begin` (and `claim`, its first half), before the first byte:

- one writer per output: its lease (`Lease`, below), held until the commit; a lease this process holds above an output
  (train's on its whole output, `writer_lease`) does not refuse the outputs inside it;
- a writer touches only its own: the output must be empty, an artifact of its kind whose manifest lists every file
  there, or marked (`WRITING_NAME`, or piece records) as being made into its kind by an earlier run that stopped. Anything
  else is refused with one line naming a file; nothing is deleted or overwritten. Folders below that are other
  artifacts' roots belong to those, and a live writer above or below the output is refused, naming it;
- `refuse_nested`: no stage writes where it reads.

**The lease** is an object at the output's root, taken before anything is written and released at the commit:
`LEASE_NAME`, created only if absent (`Store.put_bytes_if_absent`: O_EXCL on a folder,
`If-None-Match: *` on S3), naming its owner (host, pid, a per-process token, the command) and an expiry that a heartbeat
thread pushes forward while the writer lives. A second writer finds it and fails at once with one line naming the owner.
A lease past its expiry, left on this host by a process that no longer exists (kill -9, a crash), or unreadable (not a
record blockdraft writes) is taken over with a warning through the reporter, so a rerun resumes; `force` (`--force`) takes
over a live one of another host whose writer the user knows is dead. A writer alive on this host (its pid running, with
the start time the record names, so a reused pid is not mistaken for it) keeps its lease whatever the clock says: a job
suspended past its expiry, or a clock that jumped, is still writing when it resumes. A writer confirms the lease is its
own right before each object it writes and before its commit (`Lease.check`), so a writer that lost its lease writes no
further object and never a manifest.

Leases are per process and re-entrant: a stage that holds its output's lease may push to it (the push takes the same
lease again); the object is deleted when the last holder releases it, and at exit for any still held.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from blockdraft.config import StoreConfig
from blockdraft.errors import ArtifactError, ConfigError, LeaseError, StoreError, redact, redact_settings
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
from blockdraft.store.base import LEASE_NAME, ROOT_MARKERS, WRITING_NAME, is_bookkeeping
from blockdraft.store.inputs import StageInput

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

    `key` may be a function, called only when needed (by `done` for a manifest of this kind and config, and by `commit`):
    a key that names raw inputs by content may have to read them. `made_with` (dotted config path -> value) names config
    values an output of this run records, compared before the key; `failures` the counts field where a commit records
    what failed (an output committed with failures is not done: a rerun retries them). `force` and `reporter` go to its
    lease: whether a live writer of another host is taken over (`--force`), and who hears of takeovers."""

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
        return cls(current.store, current.kind, current.manifest.config.get(STAGE_KEY, ""), force=force, reporter=reporter)

    # -- done

    def done(self, verified: VerifyReport | None = None) -> VerifyReport | None:
        """The destination's report when it holds this output, made for this run, verified, with nothing failed; else None.
        `verified`: the destination's report when the caller has just verified it (resume picking the newest verified
        checkpoint), so it is not read and verified again."""
        if verified is not None and verified.state is State.VERIFIED and verified.manifest is not None and verified.manifest_sha256:
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
        """Whether the manifest (whose bytes hash to `sha256`) was made for this output. The config values of `made_with`
        are compared before the key, so an output of another config is redone without computing the key."""
        if self.copy_of is not None:
            return sha256 == manifest_sha256(self.copy_of)
        if manifest.kind != self.kind:
            return False
        if any(_config_value(manifest.config, path) != value for path, value in self.made_with.items()):
            return False
        return manifest.config.get(STAGE_KEY) == self.key

    # -- who may write

    def claim(self, mark: bool = True) -> None:
        """Take the output's lease (LeaseError naming the writer that holds it) and check that the output is this writer's
        to write (ArtifactError naming a file it does not own, LeaseError naming a live writer above or below); then mark it
        as being written (`mark` False leaves that to `mark_writing`, right before the output first changes). Nothing at
        the output is changed before both checks pass. Taken once: a second call does nothing."""
        if self.lease is not None:
            return
        self.lease = Lease(self.store, force=self.force, reporter=self.reporter).acquire()
        try:
            _refuse_leases_above(self.store, self.lease.force)
            keys = [info.key for info in self.store.list()]
            others = _other_roots(keys)
            _refuse_leases_below(self.store, keys, self.lease.force)
            problem = _not_ours(self.store, self.kind, [k for k in keys if not any(k.startswith(root + "/") for root in others)])
            if problem is not None:
                raise ArtifactError(problem)
        except BaseException:
            self.release()
            raise
        if mark:
            self.mark_writing()

    def mark_writing(self, amending: Manifest | None = None) -> None:
        """Note at the output's root that a run is making it into this kind (`WRITING_NAME`): from here on its files may
        belong to no manifest, and a rerun of this kind resumes over them. Removed by the commit. `amending`: the manifest
        an `amend` is about to take down, recorded so that an amend that stops is finished by the next (`resume_amend`)."""
        mark: dict[str, Any] = {"kind": self.kind}
        if amending is not None:
            mark["amending"] = amending.model_dump(mode="json")
        self.store.put_bytes(WRITING_NAME, json.dumps(mark).encode() + b"\n")

    def begin(self, amending: Manifest | None = None) -> None:
        """`claim` the output, then remove its manifest (if any) before anything is rewritten, so no reader sees an old
        manifest over new files; `amending` (the manifest an `amend` takes down) is recorded in the writing mark first."""
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
        """Check every file at the destination, then write the manifest (with this output's key) last. The config it pins
        passes `redact_settings` whatever the stage gave: no manifest names a credential a setting carries."""
        assert self.copy_of is None, "a copy commits its source manifest (commit_copy)"
        config, counts = config or {}, counts or {}
        assert all(_config_value(config, path) == value for path, value in self.made_with.items()), "commit what made_with names"
        assert self.failures is None or self.failures in counts, "a commit records what failed under its failures field"
        self.confirm()
        pinned = {**redact_settings(config), STAGE_KEY: self.key}
        report = commit_artifact(self.store, self.kind, files, config=pinned, lineage=lineage, counts=counts)
        self._committed()
        return report

    def commit_copy(self) -> VerifyReport:
        """A copy's commit (push): its source's manifest, byte for byte, after every file verified at the destination."""
        assert self.copy_of is not None, "a stage's own output commits with commit()"
        self.confirm()
        report = commit_manifest(self.store, self.copy_of, if_absent=True)
        self._committed()
        return report

    def commit_checked_copy(self) -> None:
        """A copy's commit when every file was just checked on the very bytes written (pull): the manifest, byte for byte,
        then the manifest and every file's size read back (ArtifactError, and uncommitted, when they differ)."""
        assert self.copy_of is not None
        manifest = Manifest.model_validate_json(self.copy_of)
        self.confirm()
        self.store.put_bytes(MANIFEST_NAME, self.copy_of)
        back = read_manifest(self.store)
        sizes = {info.key: info.size for info in self.store.list()}  # listed, not read: no file is read again
        wrong = [e.path for e in manifest.files if sizes.get(e.path) != e.size]
        if back is None or back[1] != self.copy_of or wrong:
            uncommit(self.store)
            raise ArtifactError(f"the copy in {self.url.rstrip('/')} did not read back as written ({wrong[:3] or 'manifest'}); copy it again")
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
        """Upload local files written under `root`, each with its checksum and after confirming the lease; their entries."""
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

    def put_piece(self, name: str, piece_key: str, files: Iterable[FileEntry], counts: dict[str, Any] | None = None) -> None:
        """Record piece `name` as finished: its files are checked at the destination first, its sub-manifest is written last."""
        files = sorted(files, key=lambda e: e.path)
        self.confirm()
        problems = [p for p in check_files(self.store, files) if p is not None]
        if problems:
            raise ArtifactError(f"{self.url.rstrip('/')}/{problems[0].path} did not verify before its piece was recorded: {problems[0].detail}")
        piece = Manifest(kind=self.kind + _PIECE_SUFFIX, config={STAGE_KEY: piece_key}, files=files, counts=counts or {})
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
        return piece.config.get(STAGE_KEY) == piece_key and piece.kind == self.kind + _PIECE_SUFFIX

    def drop_piece(self, name: str) -> None:
        self.store.delete(self._piece_key(name))


def resume_amend(store: Store, kind: str, replaced: Collection[str]) -> StageInput | None:
    """The output at `store` as an `amend` of a `kind` artifact left it when it stopped after taking the manifest down and
    before writing the new one: the manifest it was amending (recorded in the writing mark), with every file but
    `replaced` (what that amend was replacing, and the next one replaces) checked against it, for `amend` to finish; None
    when the output holds a manifest or no such record. ArtifactError when a file that was to be kept no longer matches."""
    try:
        if read_manifest(store) is not None:
            return None
        recorded = Manifest.model_validate(json.loads(store.read_bytes(WRITING_NAME))["amending"])
    except (ArtifactError, FileNotFoundError, ValueError, TypeError, KeyError):  # a torn or foreign mark is no such record
        return None
    if recorded.kind != kind:
        return None
    kept = [entry for entry in recorded.files if entry.path not in replaced]
    problem = next((p for p in check_files(store, kept) if p is not None), None)
    if problem is not None:
        raise ArtifactError(
            f"{store.url.rstrip('/')} has no manifest: a rewrite of its {', '.join(sorted(replaced))} stopped before writing "
            f"it, and {problem.path} no longer matches the manifest it was amending ({problem.detail}); make it again"
        )
    return StageInput(store, VerifyReport(store.url, State.INCOMPLETE, manifest=recorded))


def recorded_pieces(store: Store) -> dict[str, Manifest]:
    """Every piece sub-manifest under `store`, by name, as recorded and not checked (for listing what to push while a stage
    runs, or choosing a cut; whether a piece is finished is `StageOutput.finished_piece`'s to say)."""
    pieces = {}
    for info in store.list(f"{PIECES_DIR}/"):
        name = info.key.removeprefix(f"{PIECES_DIR}/").removesuffix(".json")
        try:
            pieces[name] = Manifest.model_validate_json(store.read_bytes(info.key))
        except (FileNotFoundError, ValueError):
            continue  # being written right now, or torn: not finished
    return pieces


def writer_lease(store: Store, *, force: bool = False, reporter: Reporter | None = None) -> Lease:
    """The lease alone, for a folder of outputs that a run writes one by one (train's output, its checkpoints inside):
    held for the whole run, so no second run writes between two of this run's outputs. A context manager."""
    return Lease(store, force=force, reporter=reporter)


# ---------------------------------------------------------------------------------------------- the lease


LEASE_TTL_S = 600.0  # a dead writer blocks its output for at most this long; a live one renews every third of it
_PROCESS_TOKEN = uuid.uuid4().hex[:12]

@dataclass
class LeaseRecord:
    """What the lease object says: who writes the output, since when, and until when unless renewed (epoch seconds)."""

    owner: str
    host: str
    pid: int
    command: str
    acquired_at: float
    expires_at: float
    started: int = 0  # the writer process's start time (clock ticks since boot, Linux); 0 where it cannot be read

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes) -> LeaseRecord | None:
        """The record, or None for bytes blockdraft never writes (not JSON, other fields, a time that is not a finite
        number of seconds a date can hold, a pid that is not an integer): such a lease is treated as expired."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(cls)}:
            return None
        texts_ok = all(isinstance(raw[name], str) for name in ("owner", "host", "command"))
        ints_ok = all(isinstance(raw[n], int) and not isinstance(raw[n], bool) and 0 <= raw[n] < 2**63 for n in ("pid", "started"))
        if not (texts_ok and ints_ok and raw["pid"] < 2**31 and all(_is_time(raw[name]) for name in ("acquired_at", "expires_at"))):
            return None
        return cls(**raw)

    @classmethod
    def unreadable(cls) -> LeaseRecord:
        """What an unreadable lease object stands for: no known writer, expired."""
        return cls(UNREADABLE, "unknown", 0, "unreadable lease", 0.0, 0.0)

    def describe(self) -> str:
        if self.owner == UNREADABLE:
            return "an unreadable lease record (not one blockdraft writes)"
        until = _dt.datetime.fromtimestamp(self.expires_at, _dt.UTC).isoformat(timespec="seconds")
        return f"pid {self.pid} on {self.host} ({self.command}; lease until {until})"


UNREADABLE = "unreadable"
_LATEST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last second a date can name


def _is_time(value: object) -> bool:
    """Epoch seconds as a lease holds them: a finite int or float that a date can name."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and 0 <= value <= _LATEST_TIME


def _process_start(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat); 0 where that cannot be read
    (another OS, the process gone). With the pid it names one process: a pid reused after a crash has another start."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # after "pid (comm)": state is field 3, starttime field 22
    except (OSError, ValueError, IndexError):
        return 0


def _process_here(record: LeaseRecord) -> bool | None:
    """Whether the lease's writer process is alive, when it ran on this host; None for another host's writer (or no pid),
    which is judged by the expiry alone. A running pid whose start time differs from the record's is another process."""
    if record.host != socket.gethostname() or record.pid <= 0:
        return None
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    started = _process_start(record.pid)
    return not (record.started and started and started != record.started)


def _holds_live(record: LeaseRecord, force: bool) -> bool:
    """Whether `record` still stops another writer: its writer alive on this host, whatever the expiry says (suspended,
    or the clock moved); else unexpired, and its writer neither gone from this host (a kill -9, a crash: a rerun on the
    same machine resumes at once) nor, with `force`, on another host. `force` never overrides a writer whose process is
    alive on this host."""
    if record.owner == UNREADABLE:
        return False
    here = _process_here(record)
    if here is True:
        return True
    return record.expires_at > time.time() and here is None and not force


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


class _Held:
    """A lease this process holds on one output root: its record, how many holders share it, its heartbeat."""

    def __init__(self, store: Store, record: LeaseRecord, ttl_s: float, reporter: Reporter) -> None:
        self.store, self.record, self.ttl_s, self.reporter = store, record, ttl_s, reporter
        self.count = 1
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="blockdraft-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = _read_lease(self.store)
                if current is None or current.owner != self.record.owner:
                    self.lost = f"now held by {current.describe()}" if current else "deleted by someone else"
                    self.reporter.warn(f"lost the lease on {self.store.url}: {self.lost}; this run will not commit its output")
                    return
                self.record.expires_at = time.time() + self.ttl_s
                self.store.put_bytes(LEASE_NAME, self.record.to_bytes())
            except Exception as exc:  # the store is unreachable for now: the commit's check will tell
                self.reporter.warn(f"could not renew the lease on {self.store.url} ({type(exc).__name__}); retrying")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


_held: dict[str, _Held] = {}
_lock = threading.Lock()


def _read_lease(store: Store) -> LeaseRecord | None:
    """The lease at `store`'s root as recorded (an unreadable one as `LeaseRecord.unreadable`), or None when there is none.
    LeaseError for a folder standing at the lease's name: no writer can take the lease there, and it is not ours to remove."""
    try:
        data = store.read_bytes(LEASE_NAME)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LeaseError(
            f"{store.url.rstrip('/')}/{LEASE_NAME} is a folder, where blockdraft keeps the lease file of the output's one "
            "writer; move that folder away (blockdraft never deletes what it did not write) and rerun"
        ) from None
    return LeaseRecord.parse(data) or LeaseRecord.unreadable()


def _held_here(store: Store) -> bool:
    """Whether this process holds the lease on `store`'s root."""
    return store.url.rstrip("/") in _held


class Lease:
    """The lease on the output at `store` for this process; `acquire` (or `with`) takes it, `release` gives it back.

    `force` (`--force`): take over a live lease of another host's writer. `reporter` hears of
    takeovers and of renewals that failed (a `Reporter()` that only logs when None)."""

    def __init__(self, store: Store, ttl_s: float = LEASE_TTL_S, *, force: bool = False, reporter: Reporter | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.key = store.url.rstrip("/")
        self.taken_over: LeaseRecord | None = None
        self.force = force
        self.reporter = reporter or Reporter()

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> Lease:
        """Take the lease, or raise LeaseError naming the writer that holds it."""
        with _lock:
            held = _held.get(self.key)
            if held is not None:
                held.count += 1
                return self
            now = time.time()
            record = LeaseRecord(_me(), socket.gethostname(), os.getpid(), redact(" ".join(sys.argv[:3]))[:200], now, now + self.ttl_s,
                                 _process_start(os.getpid()))
            for _ in range(5):
                if self.store.put_bytes_if_absent(LEASE_NAME, record.to_bytes()):
                    _held[self.key] = _Held(self.store, record, self.ttl_s, self.reporter)
                    return self
                current = _read_lease(self.store)
                if current is None:
                    continue  # released between our create and our read: try again
                if current.owner == record.owner:  # left by this very process (an earlier holder that crashed mid-way)
                    self.store.delete(LEASE_NAME)
                    continue
                if _holds_live(current, self.force):
                    raise _busy_error(self.store.url, current)
                self.taken_over = current
                self.reporter.warn(f"taking over the lease on {self.store.url} from {current.describe()}")
                self.store.delete(LEASE_NAME)
            raise LeaseError(f"could not take the lease on {self.store.url}: other writers keep taking it; rerun when they are done")

    def _holder_now(self) -> str | None:
        """Who holds the lease, as the store says now, when this process does not; None while it is ours."""
        held = _held.get(self.key)
        current = _read_lease(self.store)
        if held is not None and current is not None and current.owner == held.record.owner:
            return None
        return current.describe() if current else "nobody (the lease was deleted)"

    def lost_to(self) -> str | None:
        """Who holds the lease now when this process no longer does (a takeover, a deletion); None while it is ours, or
        when the store cannot say now (not known to be lost)."""
        try:
            return self._holder_now()
        except Exception:
            return None

    def lost_error(self, who: str) -> LeaseError:
        """The one line for a writer that lost its lease to `who` (as `lost_to` names it)."""
        return LeaseError(f"lost the lease on {self.store.url} to {who}; this run's output was not committed; rerun it")

    def check(self) -> None:
        """Raise LeaseError unless this process still holds the lease, as the store says now (called right before each
        object a writer writes, and before its commit)."""
        if (who := self._holder_now()) is not None:
            raise self.lost_error(who)

    def release(self) -> None:
        """Give the lease back; the object is deleted when the last holder in this process releases it."""
        with _lock:
            held = _held.get(self.key)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del _held[self.key]
            held.stop()
            try:
                current = _read_lease(self.store)
                if current is not None and current.owner == held.record.owner:
                    self.store.delete(LEASE_NAME)
            except Exception:  # best effort: an unreleased lease expires on its own
                pass


def _busy_error(url: str, record: LeaseRecord) -> LeaseError:
    """The one line for an output that `record`'s live writer holds."""
    if _process_here(record):
        return LeaseError(
            f"{url} is being written by {record.describe()}, and pid {record.pid} is alive on this host; wait for it to "
            "finish or stop it (--force takes over only a writer that is dead)"
        )
    return LeaseError(f"{url} is being written by {record.describe()}; wait for that run to finish, or rerun with --force if it is dead")


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        held = _held[key]
        held.count = 1
        Lease(held.store).release()


# ---------------------------------------------------------------------------------------------- what a writer owns


def _lease_at(store: Store) -> LeaseRecord | None:
    try:
        return _read_lease(store)
    except (OSError, StoreError):  # a folder or prefix this user cannot read holds no lease of ours
        return None


def _refuse_leases_above(store: Store, force: bool) -> None:
    up = store.parent()
    while up is not None:
        record = _lease_at(up)
        if record is not None and not _held_here(up) and _holds_live(record, force):
            raise LeaseError(
                f"{up.url.rstrip('/')}, which contains {store.url.rstrip('/')}, is being written by {record.describe()}; "
                "wait for that run to finish, or write somewhere outside it"
            )
        up = up.parent()


def _other_roots(keys: list[str]) -> set[str]:
    """The folders below the output's root that are other artifacts' roots (a manifest, a lease or a writing mark)."""
    roots = {key.rpartition("/")[0] for key in keys if key.rpartition("/")[2] in ROOT_MARKERS}
    roots.discard("")
    return {root for root in roots if not any(root.startswith(other + "/") for other in roots)}


def _refuse_leases_below(store: Store, keys: list[str], force: bool) -> None:
    for key in keys:
        root, _, name = key.rpartition("/")
        if name != LEASE_NAME or not root:
            continue
        below = store.child(root)
        record = _lease_at(below)
        if record is not None and not _held_here(below) and _holds_live(record, force):
            raise LeaseError(
                f"{below.url.rstrip('/')}, inside {store.url.rstrip('/')}, is being written by {record.describe()}; "
                "wait for that run to finish, or write somewhere else"
            )


def _not_ours(store: Store, kind: str, keys: list[str]) -> str | None:
    """Why this output is not the writer's to write (naming a file), or None when it is."""
    url = store.url.rstrip("/")
    files = [k for k in keys if not is_bookkeeping(k) and k != MANIFEST_NAME]
    if MANIFEST_NAME in keys:
        try:
            found = read_manifest(store)
        except ArtifactError:
            return f"{url}/{MANIFEST_NAME} is not a valid blockdraft manifest, so the files there are not known to be an artifact's; " \
                   "pass another output or remove them first"
        if found is not None and found[0].kind != kind:
            return f"{url} holds a '{found[0].kind}' artifact, not '{kind}'; pass another output or remove that artifact first"
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
        f"{url}/{stray[0]} is not a file of a blockdraft '{kind}' artifact there, and blockdraft never overwrites or deletes "
        "files it does not own; pass an empty or new output, or move that file away"
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
    raise ConfigError(f"{role} {input.url.rstrip('/')} {relation}; a stage never reads what it writes: pass another output")


__all__ = ["STAGE_KEY", "StageOutput", "recorded_pieces", "refuse_nested", "resume_amend", "stage_key", "writer_lease"]
