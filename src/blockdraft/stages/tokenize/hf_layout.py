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
from pathlib import Path

import pyarrow as pa

from blockdraft.data.formats import SPLITS
from blockdraft.store.base import Store
from blockdraft.store.checksum import crc64nvme_bytes
from blockdraft.store.local import LocalStore
from blockdraft.store.manifest import FileEntry

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


def write_split_metadata(out: Path, shard_files: list[list[tuple[str, str]]], schema: pa.Schema) -> list[FileEntry]:
    """state.json / dataset_info.json per split and dataset_dict.json; returns the entries of the files written.

    `shard_files`: per shard in input order, its Arrow files as (path relative to `out`, crc64nvme checksum), in the
    order the shard wrote them (train then held_out, parts in order). The fingerprint hashes that order, so it is kept.

    Every file is written through `LocalStore` (`put_bytes`, `writing`): its folder opened one name at a time without
    following a link and the file renamed into place within that opened folder, so a link planted at a split folder is
    refused as resolving outside the output, and one at a file's name is replaced, never written through. pyarrow writes
    the empty split's stream into the open file object, never by path.
    """
    import datasets

    store = LocalStore(out)
    features = datasets.Features.from_arrow_schema(schema)
    checksums = [checksum for files in shard_files for _, checksum in files]
    written: list[FileEntry] = []

    def put(key: str, data: bytes) -> None:
        store.put_bytes(key, data)
        written.append(FileEntry(path=key, size=len(data), checksum=crc64nvme_bytes(data)))

    for split in SPLITS:
        names = [path.split("/", 1)[1] for files in shard_files for path, _ in files if path.split("/", 1)[0] == split]
        if not names:
            # `load_from_disk` needs at least one table per split: an empty split gets one schema-only file.
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, schema):
                pass
            put(f"{split}/{EMPTY_SPLIT_FILE}", sink.getvalue().to_pybytes())
            names = [EMPTY_SPLIT_FILE]
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
            put(f"{split}/{name}", json.dumps(data, indent=2, sort_keys=True).encode())
    put("dataset_dict.json", json.dumps({"splits": list(SPLITS)}).encode())
    return written


def remove_leftovers(store: Store, keep: set[str]) -> None:
    """Delete every row or quarantine file not in `keep` (keys in `store`, the output) and the split metadata (rewritten
    at commit), so the folder holds nothing a reader could mix with this run's rows.

    The folders are listed without following a link to one, and each file is deleted by the store in its folder opened
    one name at a time without following a link: nothing outside the output is listed or removed through a link planted
    at a split or quarantine folder (a link there is OutsideArtifactError when the run writes into it)."""
    for sub in (*SPLITS, QUARANTINE_DIR):
        for info in store.list(f"{sub}/"):
            name = info.key.removeprefix(f"{sub}/")
            if "/" not in name and name.endswith((".arrow", ".jsonl", ".json")) and info.key not in keep:
                store.delete(info.key)
