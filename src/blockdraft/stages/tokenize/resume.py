"""Resuming a tokenize run, beside the shard that records what it resumes (`shard.py`).

A shard is kept only when its piece (`StageOutput.finished_piece`) names this run's `piece_key` (config digest, the same
part of the same input file), every file it lists reads back as listed, and the input bytes it was made from are still
the file's (`input_unchanged`). Anything else is deleted and redone from scratch. A file that one of its tasks could not
read whole is left out whole (`drop_failed_files`), so a rerun tries it again.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from blockdraft.data.ranges import range_crc
from blockdraft.stages.tokenize.hf_layout import remove_leftovers
from blockdraft.stages.tokenize.shard import ShardOutput
from blockdraft.stages.tokenize.tasks import INPUT_READ, ShardTask, piece_key
from blockdraft.store import Store
from blockdraft.store.artifact import FileEntry
from blockdraft.store.local import LocalStore
from blockdraft.store.output import StageOutput, recorded_pieces


def input_unchanged(store: Store, task: ShardTask, read: dict[str, Any]) -> bool:
    """Whether the input bytes a finished piece was made from (`read`, its counts' INPUT_READ) are still the file's: its
    pin is unchanged and was trusted when recorded, else every byte range its rows depend on (`reads`), read again now,
    has the CRC it recorded."""
    if not read:
        return False
    if read.get("pin") == task.file.pin and read.get("pin_trusted"):
        return True
    ranges = read.get("reads") or []
    if not ranges or not all(crc for _, _, crc in ranges):
        return False
    with store.open_read(task.input_key) as stream:
        return all(range_crc(stream, start, end) == crc for start, end, crc in ranges)


def finished_shard(out: StageOutput, in_store: Store, digest: str, task: ShardTask) -> ShardOutput | None:
    """The shard of `task` as its piece records it, when this run keeps it (see the module's docstring); else None."""
    piece = out.finished_piece(task.name, piece_key(digest, task))
    if piece is None or not input_unchanged(in_store, task, piece.counts.get(INPUT_READ, {})):
        return None
    return ShardOutput(task.name, list(piece.files), piece.counts)


def keep_finished_shards(
    out: StageOutput, in_store: Store, digest: str, tasks: list[ShardTask]
) -> dict[str, ShardOutput]:
    """The shards whose pieces match this run, by name; every other piece, temporary file and unnamed file is
    deleted."""
    recorded = recorded_pieces(out.store)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # each check reads files back (and maybe input bytes)
        found = list(pool.map(lambda task: finished_shard(out, in_store, digest, task),
                              [t for t in tasks if t.name in recorded]))
    kept = {shard.name: shard for shard in found if shard is not None}
    for name in recorded:
        if name not in kept:
            out.drop_piece(name)
    out.store.abort_partial_uploads()  # temporary files of a killed run
    remove_leftovers(out.store, {entry.path for shard in kept.values() for entry in shard.files})
    return kept


def drop_failed_files(out: StageOutput, tasks: list[ShardTask], outputs: dict[str, ShardOutput]) -> list[ShardOutput]:
    """The shards to commit, in task order: a file that one of its tasks could not read whole is left out whole, as one
    failed input (the first failed task's quarantine line); its other tasks' pieces and files are deleted."""
    failed_files = {t.file_index for t in tasks if outputs[t.name].stats.get("input_files_failed")}
    keep: list[ShardOutput] = []
    named: set[int] = set()
    for task in tasks:
        shard = outputs[task.name]
        if task.file_index not in failed_files or (
            shard.stats.get("input_files_failed") and task.file_index not in named
        ):
            keep.append(shard)
            named.add(task.file_index)
            continue
        out.drop_piece(task.name)  # the piece first: a crash in between never leaves a piece over missing files
        for entry in shard.files:
            out.store.delete(entry.path)  # in its folder opened without following a link
    return keep


def finished_shard_entries(local_dir: Path) -> list[FileEntry]:
    """Every file of the shards finished so far in `local_dir`, as their pieces (written after the files) list them."""
    pieces = recorded_pieces(LocalStore(local_dir))
    return [entry for _, piece in sorted(pieces.items()) for entry in piece.files]


__all__ = ["drop_failed_files", "finished_shard", "finished_shard_entries", "input_unchanged", "keep_finished_shards"]
