"""The writer lease: one writer per output, taken before its first byte and given back at its commit.

`StageOutput.claim` (`store/output.py`) takes it for every output; `writer_lease` takes it alone, for a folder of
outputs that a run writes one by one (train's output around its checkpoints); `refuse_live_leases` refuses a live writer
above or below an output, except one whose lease this process holds (train's on its whole output does not refuse the
checkpoints inside it).

**The lease** is an object at the output's root, taken before anything is written and released at the commit:
`LEASE_NAME`, created only if absent (`Store.put_bytes_if_absent`: O_EXCL on a folder,
`If-None-Match: *` on S3), naming its owner (host, pid, a per-process token, the command) and an expiry that a heartbeat
thread pushes forward while the writer lives. A second writer finds it and fails at once with one line naming the owner.
A lease past its expiry, left on this host by a process that no longer exists (kill -9, a crash), or unreadable (not a
record blockdraft writes) is taken over with a warning through the reporter, so a rerun resumes; `force` (`--force`)
takes over a live one of another host whose writer the user knows is dead. A writer alive on this host (its pid running,
with the start time the record names, so a reused pid is not mistaken for it) keeps its lease whatever the clock says: a
job suspended past its expiry, or a clock that jumped, is still writing when it resumes. A writer confirms the lease is
its own right before each object it writes and before its commit (`Lease.check`), so a writer that lost its lease writes
no further object and never a manifest.

Leases are per process and re-entrant: a stage that holds its output's lease may push to it (the push takes the same
lease again); the object is deleted when the last holder releases it, and at exit for any still held.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields

from blockdraft.errors import LeaseError, StoreError, redact
from blockdraft.reporter import Reporter
from blockdraft.store import Store
from blockdraft.store.base import LEASE_NAME

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
        ints_ok = all(
            isinstance(raw[n], int) and not isinstance(raw[n], bool) and 0 <= raw[n] < 2**63 for n in ("pid", "started")
        )
        if not (
            texts_ok
            and ints_ok
            and raw["pid"] < 2**31
            and all(_is_time(raw[name]) for name in ("acquired_at", "expires_at"))
        ):
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
    """Whether the lease's writer process is alive, when it ran on this host; None for another host's writer (or no
    pid), which is judged by the expiry alone. A running pid whose start time differs from the record's is another
    process."""
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
                    self.reporter.warn(f"lost the lease on {self.store.url}: {self.lost}; this run will not commit its "
                                       "output")
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
    """The lease at `store`'s root as recorded (an unreadable one as `LeaseRecord.unreadable`), or None when there is
    none. LeaseError for a folder standing at the lease's name: no writer can take the lease there, and it is not ours
    to remove."""
    try:
        data = store.read_bytes(LEASE_NAME)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LeaseError(
            f"{store.url.rstrip('/')}/{LEASE_NAME} is a folder, where blockdraft keeps the lease file of the output's "
            "one writer; move that folder away (blockdraft never deletes what it did not write) and rerun"
        ) from None
    return LeaseRecord.parse(data) or LeaseRecord.unreadable()


def _held_here(store: Store) -> bool:
    """Whether this process holds the lease on `store`'s root."""
    return store.url.rstrip("/") in _held


class Lease:
    """The lease on the output at `store` for this process; `acquire` (or `with`) takes it, `release` gives it back.

    `force` (`--force`): take over a live lease of another host's writer. `reporter` hears of
    takeovers and of renewals that failed (a `Reporter()` that only logs when None)."""

    def __init__(self, store: Store, ttl_s: float = LEASE_TTL_S, *, force: bool = False,
                 reporter: Reporter | None = None) -> None:
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
            record = LeaseRecord(_me(), socket.gethostname(), os.getpid(), redact(" ".join(sys.argv[:3]))[:200], now,
                                 now + self.ttl_s, _process_start(os.getpid()))
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
            raise LeaseError(f"could not take the lease on {self.store.url}: other writers keep taking it; rerun when "
                             "they are done")

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
            f"{url} is being written by {record.describe()}, and pid {record.pid} is alive on this host; wait for it "
            "to finish or stop it (--force takes over only a writer that is dead)"
        )
    return LeaseError(f"{url} is being written by {record.describe()}; wait for that run to finish, or rerun with "
                      "--force if it is dead")


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        held = _held[key]
        held.count = 1
        Lease(held.store).release()


def writer_lease(store: Store, *, force: bool = False, reporter: Reporter | None = None) -> Lease:
    """The lease alone, for a folder of outputs that a run writes one by one (train's output, its checkpoints inside):
    held for the whole run, so no second run writes between two of this run's outputs. A context manager."""
    return Lease(store, force=force, reporter=reporter)


# ---------------------------------------------------------------------------------------------- leases around an output


def _lease_at(store: Store) -> LeaseRecord | None:
    try:
        return _read_lease(store)
    except (OSError, StoreError):  # a folder or prefix this user cannot read holds no lease of ours
        return None


def refuse_live_leases(store: Store, keys: list[str], force: bool) -> None:
    """LeaseError naming the writer when a live writer holds a lease above `store` (a folder containing it) or below it
    (at one of `keys`, the output's listing); a lease this process holds does not refuse, nor (`force`) one of another
    host's writer."""
    _refuse_leases_above(store, force)
    _refuse_leases_below(store, keys, force)


def _refuse_leases_above(store: Store, force: bool) -> None:
    up = store.parent()
    while up is not None:
        record = _lease_at(up)
        if record is not None and not _held_here(up) and _holds_live(record, force):
            raise LeaseError(
                f"{up.url.rstrip('/')}, which contains {store.url.rstrip('/')}, is being written by "
                f"{record.describe()}; wait for that run to finish, or write somewhere outside it"
            )
        up = up.parent()


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


__all__ = ["LEASE_TTL_S", "Lease", "LeaseRecord", "refuse_live_leases", "writer_lease"]
