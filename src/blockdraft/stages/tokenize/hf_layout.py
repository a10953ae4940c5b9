"""The output folder as `datasets.save_to_disk` lays out a DatasetDict, so `datasets.load_from_disk(OUTPUT)` reads it.

    dataset_dict.json                                  {"splits": ["train", "held_out"]}
    train/shard-00000-part-000.arrow ...  state.json  dataset_info.json
    held_out/...                                       (same; a split with no rows gets one schema-only `empty.arrow`)
    quarantine/shard-00000.jsonl                       rejected rows (not part of the DatasetDict)

`datasets` is imported inside the two functions that need it: it is heavy (seconds, ~100 MiB), and the worker
processes, which import this package, never call them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa

from blockdraft.data.formats import SPLITS
from blockdraft.store.local import TMP_PREFIX

QUARANTINE_DIR = "quarantine"
EMPTY_SPLIT_FILE = "empty.arrow"


@functools.lru_cache(maxsize=1)
def output_schema() -> pa.Schema:
    """The Arrow schema of the rows, with the `datasets` feature metadata so `load_from_disk` restores the types."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
            "num_tokens": datasets.Value("int32"),
            "num_supervised": datasets.Value("int32"),
            "source_id": datasets.Value("string"),
            "turn": datasets.Value("int32"),
        }
    ).arrow_schema


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary sibling, fsynced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_split_metadata(out: Path, shard_files: list[list[tuple[str, str]]], schema: pa.Schema) -> list[Path]:
    """state.json / dataset_info.json per split and dataset_dict.json; returns the paths written.

    `shard_files`: per shard in input order, its Arrow files as (path relative to `out`, crc64nvme checksum), in the
    order the shard wrote them (train then held_out, parts in order). The fingerprint hashes that order, so it is kept.
    """
    import datasets

    features = datasets.Features.from_arrow_schema(schema)
    checksums = [checksum for files in shard_files for _, checksum in files]
    written = []
    for split in SPLITS:
        names = [path.split("/", 1)[1] for files in shard_files for path, _ in files if path.split("/", 1)[0] == split]
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        if not names:
            # `load_from_disk` needs at least one table per split: an empty split gets one schema-only file.
            empty = folder / EMPTY_SPLIT_FILE
            with pa.ipc.new_stream(str(empty), schema):
                pass
            names, written = [EMPTY_SPLIT_FILE], [*written, empty]
        fingerprint = hashlib.sha256(json.dumps([split, *names, *checksums]).encode()).hexdigest()[:16]
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        info = {"citation": "", "description": "", "features": features.to_dict(), "homepage": "", "license": ""}
        for name, data in (("state.json", state), ("dataset_info.json", info)):
            write_atomic(folder / name, json.dumps(data, indent=2, sort_keys=True).encode())
            written.append(folder / name)
    write_atomic(out / "dataset_dict.json", json.dumps({"splits": list(SPLITS)}).encode())
    written.append(out / "dataset_dict.json")
    return written


def remove_leftovers(out: Path, keep: set[str]) -> None:
    """Delete every row or quarantine file not in `keep` (paths relative to `out`) and the split metadata (rewritten
    at commit), so the folder holds nothing a reader could mix with this run's rows."""
    for sub in (*SPLITS, QUARANTINE_DIR):
        folder = out / sub
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.suffix in (".arrow", ".jsonl", ".json") and f"{sub}/{p.name}" not in keep:
                p.unlink()
