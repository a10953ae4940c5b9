"""One writer per output: a lease object at the output's root, taken before anything is written, released at commit.

A lease is `LEASE_NAME` under the output root, created only if absent (`Store.put_bytes_if_absent`: O_EXCL on a folder,
`If-None-Match: *` on S3), naming its owner (host, pid, a per-process token, the command) and an expiry that a heartbeat
thread pushes forward while the writer lives. A second writer finds it and fails at once with one line naming the owner.
A lease past its expiry, or left on this host by a process that no longer exists (kill -9, a crash), is taken over with a
warning, so a rerun resumes; `--force` (`set_force_takeover`) takes over a live one whose writer the user knows is dead. A commit first checks that the lease is still its own (`Lease.check`), so a
writer that lost its lease never writes a manifest.

Leases are per process and re-entrant: a stage that holds its output's lease may push to it (the push takes the same
lease again); the object is deleted when the last holder releases it, and at exit for any still held.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import socket
import sys
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass

from blockdraft.errors import LeaseError, redact
from blockdraft.store.base import Store

LEASE_NAME = ".blockdraft-lease.json"
LEASE_TTL_S = 600.0  # a dead writer blocks its output for at most this long; a live one renews every third of it
_PROCESS_TOKEN = uuid.uuid4().hex[:12]
FORCE_ENV = "BLOCKDRAFT_TAKE_OVER_LEASE"  # set by --force; inherited by the ranks torchrun starts


def set_force_takeover(force: bool) -> None:
    """`--force`: take over a live lease too (its writer is known to be dead). Process-wide, set by the CLI."""
    if force:
        os.environ[FORCE_ENV] = "1"
    else:
        os.environ.pop(FORCE_ENV, None)


def _force_takeover() -> bool:
    return os.environ.get(FORCE_ENV) == "1"


@dataclass
class LeaseRecord:
    """What the lease object says: who writes the output, since when, and until when unless renewed (epoch seconds)."""

    owner: str
    host: str
    pid: int
    command: str
    acquired_at: float
    expires_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes) -> LeaseRecord | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None  # torn or foreign: treated as expired

    def describe(self) -> str:
        until = _dt.datetime.fromtimestamp(self.expires_at, _dt.UTC).isoformat(timespec="seconds")
        return f"pid {self.pid} on {self.host} ({self.command}; lease until {until})"


def _writer_dead(record: LeaseRecord) -> bool:
    """True when the lease's writer ran on this host and its process is gone (a kill -9 or a crash): its output can be
    taken over at once, as a rerun on the same machine expects. Another host's writer is judged by the expiry alone."""
    if record.host != socket.gethostname() or record.pid <= 0:
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


class _Held:
    """A lease this process holds on one output root: its record, how many holders share it, its heartbeat."""

    def __init__(self, store: Store, record: LeaseRecord, ttl_s: float) -> None:
        self.store, self.record, self.ttl_s = store, record, ttl_s
        self.count = 1
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="blockdraft-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = _read(self.store)
                if current is None or current.owner != self.record.owner:
                    self.lost = f"now held by {current.describe()}" if current else "deleted by someone else"
                    return
                self.record.expires_at = time.time() + self.ttl_s
                self.store.put_bytes(LEASE_NAME, self.record.to_bytes())
            except Exception as exc:  # the store is unreachable for now: the commit's check will tell
                self.lost = self.lost or None
                warnings.warn(f"could not renew the lease on {self.store.url} ({type(exc).__name__}); retrying", stacklevel=1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


_held: dict[str, _Held] = {}
_lock = threading.Lock()


def _read(store: Store) -> LeaseRecord | None:
    try:
        data = store.read_bytes(LEASE_NAME)
    except FileNotFoundError:
        return None
    return LeaseRecord.parse(data) or LeaseRecord("unknown", "unknown", 0, "unreadable lease", 0.0, 0.0)


class Lease:
    """The lease on the output at `store` for this process; `acquire` (or `with`) takes it, `release` gives it back."""

    def __init__(self, store: Store, ttl_s: float = LEASE_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.key = store.url.rstrip("/")
        self.taken_over: LeaseRecord | None = None

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
            record = LeaseRecord(_me(), socket.gethostname(), os.getpid(), redact(" ".join(sys.argv[:3]))[:200], now, now + self.ttl_s)
            for _ in range(5):
                if self.store.put_bytes_if_absent(LEASE_NAME, record.to_bytes()):
                    _held[self.key] = _Held(self.store, record, self.ttl_s)
                    return self
                current = _read(self.store)
                if current is None:
                    continue  # released between our create and our read: try again
                if current.owner == record.owner:  # left by this very process (an earlier holder that crashed mid-way)
                    self.store.delete(LEASE_NAME)
                    continue
                if current.expires_at > time.time() and not _force_takeover() and not _writer_dead(current):
                    raise LeaseError(
                        f"{self.store.url} is being written by {current.describe()}; wait for that run to finish, or rerun with "
                        "--force if it is dead"
                    )
                self.taken_over = current
                warnings.warn(f"taking over the lease on {self.store.url} from {current.describe()}", stacklevel=2)
                self.store.delete(LEASE_NAME)
            raise LeaseError(f"could not take the lease on {self.store.url}: other writers keep taking it; rerun when they are done")

    def check(self) -> None:
        """Raise LeaseError unless this process still holds the lease (called right before a commit)."""
        held = _held.get(self.key)
        current = _read(self.store)
        if held is None or current is None or current.owner != held.record.owner:
            who = current.describe() if current else "nobody (the lease was deleted)"
            raise LeaseError(f"lost the lease on {self.store.url} to {who}; this run's output was not committed; rerun it")

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
                current = _read(self.store)
                if current is not None and current.owner == held.record.owner:
                    self.store.delete(LEASE_NAME)
            except Exception:  # best effort: an unreleased lease expires on its own
                pass


def held_leases() -> list[str]:
    """The output roots whose lease this process holds (for tests and diagnostics)."""
    return sorted(_held)


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        held = _held[key]
        held.count = 1
        Lease(held.store).release()


__all__ = ["LEASE_NAME", "LEASE_TTL_S", "Lease", "LeaseRecord", "held_leases", "set_force_takeover"]
