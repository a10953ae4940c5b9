"""Tokenize's tasks: how large a task is for the run's workers (`task_size`); every input file cut by size into parts
(`blockdraft.data.ranges`), one task each; what a finished task's piece is keyed on; whether what a task read of a whole
file is the file as listed; and each file's checksum, put together from what its tasks read (docs/TOKENIZATION.md,
"Tasks"). Whether a piece is kept is `resume.py`'s.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from blockdraft.data.inputs import InputFile
from blockdraft.data.ranges import ReadRange, crc_concat, split_file
from blockdraft.errors import ArtifactError
from blockdraft.store import Store
from blockdraft.store.output import stage_key

# What a piece records of the input bytes its task read (its counts' "input"): the file's pin, whether the pin may
# stand for the content later, the raw bytes read [window) and their CRC64NVME.
INPUT_READ = "input"
# What a piece records of the task size its run cut the input with (`task_size`), so that a rerun can cut it the same
# way.
TASK_SIZE = "task_size"
# Tasks a run aims for per worker: a few, so that the workers share out the uneven ones and end close together.
TASKS_PER_WORKER = 4


@dataclass(frozen=True)
class ShardTask:
    """One part of one input file: `name` (shard-00003 for a file read whole, shard-00003-0001 for its second part)
    names its outputs and its piece; `share` is its part of the file's bytes, for progress. Tasks are in row order."""

    index: int
    name: str
    file: InputFile
    part: ReadRange
    share: int
    file_index: int
    part_index: int
    parts: int

    @property
    def input_key(self) -> str:
        """The input file's object path in its store."""
        return self.file.key


def task_size(total_bytes: int, workers: int, task_bytes: int, min_task_bytes: int) -> int:
    """The input bytes per task for a run of `workers` over `total_bytes`: enough for about TASKS_PER_WORKER tasks a
    worker, so that one large file keeps every worker busy and the last tasks finish close together; at most
    `task_bytes` and at least `min_task_bytes` (or `task_bytes`, when that is smaller). Only how the input is cut
    depends on it: the rows and their order are the same for any size."""
    wanted = -(-total_bytes // (TASKS_PER_WORKER * workers))
    return min(task_bytes, max(min_task_bytes, wanted))


def plan_tasks(store: Store, files: list[InputFile], task_bytes: int) -> list[ShardTask]:
    """Every file cut into tasks of at most about `task_bytes` input bytes (`split_file`). Only files larger than that
    are opened here, for a few bytes each (a header, a Parquet footer), never read through."""

    def parts(f: InputFile) -> list[tuple[ReadRange, int]]:
        return split_file(lambda: store.open_read(f.key), f.key, f.size, task_bytes)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        cut = list(pool.map(parts, files))
    tasks: list[ShardTask] = []
    for i, (f, file_parts) in enumerate(zip(files, cut, strict=True)):
        for k, (part, share) in enumerate(file_parts):
            name = f"shard-{i:05d}" if len(file_parts) == 1 else f"shard-{i:05d}-{k:04d}"
            tasks.append(ShardTask(len(tasks), name, f, part, share, i, k, len(file_parts)))
    return tasks


def piece_key(config_digest: str, task: ShardTask) -> str:
    """What a finished task depends on besides its input's bytes: the run's config digest, its file (key, size) and
    part. The bytes are checked apart (`resume.input_unchanged`), so a moved or touched file whose bytes are the same
    keeps its pieces."""
    return stage_key({"config_digest": config_digest, "input": {"key": task.input_key, "size": task.file.size},
                      "part": task.part.as_dict()})


def check_listed(key: str, size: int, checksum: str | None, window: tuple[int, int] | None, crc: str | None) -> None:
    """ArtifactError when the bytes a task read of a whole file (`window`, their `crc`) are not the file as listed
    (`size`, and `checksum` when the listing names one): the input changed while it was tokenized."""
    if window is None:
        return  # not checksummed: Parquet whose listed checksum is trusted, as its store verified it
    read = window[1] - window[0]
    if read != size or checksum not in (None, crc):
        raise ArtifactError(
            f"input {key} changed while it was tokenized (read {read} bytes, crc64nvme {crc}; listed {size}, "
            f"{checksum}); rerun when the input is complete"
        )


def checksum_from_reads(size: int, reads: list[dict[str, Any]]) -> str | None:
    """A file's CRC64NVME from what its tasks read (their INPUT_READ, in part order): one that read the whole file, or
    parts whose windows tile it, combined; None when they do not cover it (the caller then asks the store)."""
    windows: list[tuple[list[int], str]] = []
    for r in reads:
        window, crc = r.get("window"), r.get("crc")
        if window == [0, size] and crc:
            return crc
        if window and crc:
            windows.append((window, crc))
    if not windows or len(windows) != len(reads):
        return None
    spans = [w for w, _ in windows]
    if spans[0][0] != 0 or spans[-1][1] != size or any(a[1] != b[0] for a, b in pairwise(spans)):
        return None
    return crc_concat([(crc, window[1] - window[0]) for window, crc in windows])


__all__ = [
    "INPUT_READ", "TASKS_PER_WORKER", "TASK_SIZE", "ShardTask", "check_listed", "checksum_from_reads", "piece_key",
    "plan_tasks", "task_size",
]
