"""What a writer may touch: its own output, never a user's file, another artifact's, or what it reads.

- `claim_output`: before the first byte, a writer (holding its output's lease) checks that the output is empty, already
  a blockdraft artifact of its kind whose manifest lists every file there, or marked (`WRITING_NAME`) as being written by
  an earlier run of its kind, or holding that run's piece records (an interrupted run resumes); anything else is refused with one line naming a file, and
  nothing is deleted or overwritten. Bookkeeping names (`base.BOOKKEEPING_PREFIX`) are blockdraft's. Folders below that
  are other artifacts' roots (`base.ROOT_MARKERS`) belong to those artifacts, and a live writer above or below the output
  is respected: refused with one line naming it.
- `refuse_nested`: a stage's input equal to, inside, or containing its output is refused, for every stage.
"""

from __future__ import annotations

import json
import os

from blockdraft.errors import ArtifactError, ConfigError, LeaseError, StoreError
from blockdraft.store.artifact import MANIFEST_NAME, PIECES_DIR, read_manifest
from blockdraft.store.base import ROOT_MARKERS, Store, is_bookkeeping
from blockdraft.store.lease import LEASE_NAME, LeaseRecord, held_here, holds_live, read_lease

# At the root of an output a stage has begun to write and not committed yet: which kind it is making. It says the files
# there are an earlier run's of that kind, so a rerun may resume over them; removed once the manifest is written.
WRITING_NAME = ".blockdraft-writing.json"
PIECE_SUFFIX = "-piece"


def claim_output(store: Store, kind: str, force: bool, mark: bool = True) -> None:
    """Refuse (ArtifactError, LeaseError: one line) an output this writer does not own, else mark it as being written
    (`mark_writing`; `mark` False leaves that to the caller, right before it first changes the output).

    Called with the output's lease held and before anything is written or uncommitted. `force` is the lease's: a live
    writer of another host above or below the output does not stop a forced writer, one alive on this host always does.
    """
    _respect_leases_above(store, force)
    keys = [info.key for info in store.list()]
    others = _other_roots(keys)
    _respect_leases_below(store, keys, others, force)
    problem = _not_ours(store, kind, [k for k in keys if not any(k.startswith(root + "/") for root in others)])
    if problem is not None:
        raise ArtifactError(problem)
    if mark:
        mark_writing(store, kind)


def mark_writing(store: Store, kind: str) -> None:
    """Note at the output's root that a run is making it into a `kind` artifact (`WRITING_NAME`)."""
    store.put_bytes(WRITING_NAME, json.dumps({"kind": kind}).encode() + b"\n")


def release_claim(store: Store) -> None:
    """The output is committed: it is no longer being written."""
    store.delete(WRITING_NAME)


def _lease_at(store: Store) -> LeaseRecord | None:
    try:
        return read_lease(store)
    except (OSError, StoreError):  # a folder or prefix this user cannot read holds no lease of ours
        return None


def _respect_leases_above(store: Store, force: bool) -> None:
    up = store.parent()
    while up is not None:
        record = _lease_at(up)
        if record is not None and not held_here(up) and holds_live(record, force):
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


def _respect_leases_below(store: Store, keys: list[str], others: set[str], force: bool) -> None:
    for key in keys:
        root, _, name = key.rpartition("/")
        if name != LEASE_NAME or not root:
            continue
        below = store.child(root)
        record = _lease_at(below)
        if record is not None and not held_here(below) and holds_live(record, force):
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
    """The kind whose piece records (`stage_io.PIECES_DIR`) an earlier run left at the output, or None: such records
    mark an interrupted run of that kind as surely as the writing mark does."""
    record = next((k for k in keys if k.startswith(PIECES_DIR + "/") and k.endswith(".json")), None)
    if record is None:
        return None
    try:
        kind = json.loads(store.read_bytes(record)).get("kind")
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    return kind.removesuffix(PIECE_SUFFIX) if isinstance(kind, str) and kind.endswith(PIECE_SUFFIX) else None


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


__all__ = ["WRITING_NAME", "claim_output", "mark_writing", "refuse_nested", "release_claim"]
