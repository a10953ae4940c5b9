"""A stage whose output is a remote store: it writes the artifact in a local staging folder, its finished pieces are
pushed while it runs, and one verified `push` commits it at the end (`stage_and_push`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from blockdraft.config import StoreConfig
from blockdraft.errors import StoreError
from blockdraft.reporter import Reporter
from blockdraft.store import open_store
from blockdraft.store.artifact import FileEntry, check_file, uncommit
from blockdraft.store.base import Store
from blockdraft.store.lease import Lease
from blockdraft.store.ownership import claim_output
from blockdraft.store.preflight import preflight
from blockdraft.store.transfer import TransferReport, push


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
    """Run a stage whose output is the remote `url`: preflight, stage locally, push finished pieces meanwhile, then push.

    `run_stage(local_dir)` writes and commits the artifact locally; `finished(local_dir)` lists the files it has
    completed so far (with their checksums). The remote must be this writer's to write (`ownership.claim_output` for an
    artifact of `kind`) before the first piece goes up. The remote's old manifest is removed before the first upload that
    changes anything there (so a rerun over a committed output that uploads nothing leaves it committed), and no
    reader sees it over new files; the final `push` verifies everything and writes the manifest last.
    `force` (`--force`) goes to the remote's lease: a dead writer's is taken over. Returns (what run_stage returned,
    the push report).
    """
    remote = open_store(url, store_config)
    preflight(remote)
    local = staging_folder(url, store_config)
    local.mkdir(parents=True, exist_ok=True)
    # One writer from the first piece pushed to the commit; the final push takes the lease again (re-entrant).
    with Lease(remote, force=force, reporter=reporter) as lease:
        claim_output(remote, kind, lease.force)
        pusher = _FinishedPiecePusher(local, remote, finished, poll_s)
        try:
            result = run_stage(local)
        finally:
            pusher.stop()
        report = push(local, url, store_config, force=force, reporter=reporter)
    return result, report


__all__ = ["stage_and_push", "staging_folder"]
