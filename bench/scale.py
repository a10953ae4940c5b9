"""How cost grows with the job's size: bytes `eval` moves to read its prompts from an `s3://` tokenized artifact, and
the time `status` takes over 100 / 1,000 / 10,000 committed artifacts on a local folder store.

    .venv/bin/python -m bench.scale [--train-mib 256] [--num-prompts 32] [--sizes 100,1000,10000] [--repeats 3] [--skip
    eval|status]

eval fetch: a tokenized artifact in tokenize's layout (a big train split, a small held-out split in several Arrow files)
is pushed to a local SeaweedFS, then eval's prompts are resolved from it (`read_eval_prompts`, what `eval` runs with
train.data). Bytes moved are counted at the store, over every S3Store read (whole-object downloads, small reads,
read-back checksums, streams), and printed beside the held-out split's bytes and the artifact's.

status: N artifacts of one tiny file each, committed with `commit_artifact` once (the largest N), the smaller sets
copied from it; `status()` is timed at each size first (every file checksummed) and then `--repeats` times again (what a
repeated status costs; the fastest is kept, as on a shared machine the others measure the neighbours). Each time is wall
seconds and the process's CPU seconds, which waiting for a busy machine's cores does not inflate; the load average is
printed before and after. Growth is the ratio of the largest to the one ten times smaller: about 10 is linear.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from blockdraft.config import load_config
from blockdraft.data.formats import TOKENIZED_KIND
from blockdraft.stages.tokenize.hf_layout import output_schema, write_split_metadata
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, Manifest, commit_artifact, entry_for_local_file
from blockdraft.store.checksum import crc64nvme_file
from blockdraft.store.s3 import S3Store
from blockdraft.store.status import status
from blockdraft.store.transfer import push

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.s3server import SeaweedS3  # noqa: E402

MIB = 1024 * 1024
ROW_TOKENS = 1024  # tokens per row: 64 of prompt, the rest supervised
PROMPT_TOKENS = 64
BATCH_ROWS = 256


# ---------------------------------------------------------------------------------------------------------------------
# eval fetch bytes


def _rows_batch(rng: np.random.Generator, rows: int, schema: pa.Schema, first: int) -> pa.RecordBatch:
    """`rows` rows of ROW_TOKENS random ids, the first PROMPT_TOKENS unsupervised, in tokenize's Arrow schema."""
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * ROW_TOKENS)
    ids = rng.integers(0, 150_000, rows * ROW_TOKENS, dtype=np.int32)
    mask = np.tile(np.r_[np.zeros(PROMPT_TOKENS, np.uint8), np.ones(ROW_TOKENS - PROMPT_TOKENS, np.uint8)], rows)
    columns = {
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids), type=schema.field("input_ids").type),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask), type=schema.field("loss_mask").type),
        "num_tokens": pa.array(np.full(rows, ROW_TOKENS, np.int32)),
        "num_supervised": pa.array(np.full(rows, ROW_TOKENS - PROMPT_TOKENS, np.int32)),
        "source_id": pa.array([f"c{first + i}" for i in range(rows)]),
        "turn": pa.array(np.zeros(rows, np.int32)),
    }
    return pa.RecordBatch.from_arrays([columns[name] for name in schema.names], schema=schema)


def _write_arrow(path: Path, rows: int, rng: np.random.Generator, first: int) -> tuple[str, str]:
    schema = output_schema()
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.ipc.new_stream(str(path), schema) as writer:
        for start in range(0, rows, BATCH_ROWS):
            writer.write_batch(_rows_batch(rng, min(BATCH_ROWS, rows - start), schema, first + start))
    return path.parent.name + "/" + path.name, crc64nvme_file(path)[1]


def make_tokenized(out: Path, train_mib: int, held_out_files: int, held_out_rows: int) -> Path:
    """A committed tokenized artifact in tokenize's layout: train files of about 64 MiB, `held_out_files` held-out files
    of `held_out_rows` rows each."""
    rng = np.random.default_rng(0)
    row_bytes = ROW_TOKENS * 5  # int32 ids + uint8 mask
    train_rows = train_mib * MIB // row_bytes
    per_file = 64 * MIB // row_bytes
    shards: list[list[tuple[str, str]]] = []
    first = 0
    for i, start in enumerate(range(0, train_rows, per_file)):
        rows = min(per_file, train_rows - start)
        shards.append([_write_arrow(out / "train" / f"shard-{i:05d}-part-000.arrow", rows, rng, first)])
        first += rows
    for i in range(held_out_files):
        shards.append([_write_arrow(out / "held_out" / f"shard-{i:05d}-part-000.arrow", held_out_rows, rng, first)])
        first += held_out_rows
    write_split_metadata(out, shards, output_schema())
    entries = [entry_for_local_file(out, p) for p in sorted(out.rglob("*")) if p.is_file()]
    commit_artifact(open_store(out), TOKENIZED_KIND, entries, config={}, counts={"rows": first})
    return out


@contextmanager
def counting_s3_reads() -> Iterator[Counter[str]]:
    """Bytes each S3 object sent, by URL, over every S3Store read while the block runs (a stream counts its whole
    object)."""
    moved: Counter[str] = Counter()
    originals = {name: getattr(S3Store, name) for name in ("get_file", "read_bytes", "checksum_by_reading",
                                                           "open_read")}

    def sized(name: str, measure: Any) -> Any:
        def wrapper(store: S3Store, key: str, *args: Any) -> Any:
            result = originals[name](store, key, *args)
            moved[f"{store.url.rstrip('/')}/{key}"] += measure(store, key, result)
            return result
        return wrapper

    S3Store.get_file = sized("get_file", lambda s, k, r: r[0])  # type: ignore[method-assign]
    S3Store.read_bytes = sized("read_bytes", lambda s, k, r: len(r))  # type: ignore[method-assign]
    S3Store.checksum_by_reading = sized("checksum_by_reading", lambda s, k, r: r[0])  # type: ignore[method-assign]
    S3Store.open_read = sized("open_read", lambda s, k, r: _size(s, k))  # type: ignore[method-assign]
    try:
        yield moved
    finally:
        for name, fn in originals.items():
            setattr(S3Store, name, fn)


def _size(store: S3Store, key: str) -> int:
    info = store.head(key)
    return info.size if info else 0


def bench_eval_fetch(tmp: Path, train_mib: int, num_prompts: int) -> dict[str, Any]:
    # Imported here: it loads torch, whose objects would weigh on every garbage collection the status part times (a
    # process running `blockdraft status` holds none of them).
    from blockdraft.stages.eval.prompts import read_eval_prompts

    local = make_tokenized(tmp / "tokenized", train_mib, held_out_files=4, held_out_rows=64)
    with SeaweedS3(tmp / "s3") as server:
        os.environ.update(server.admin.env(server.endpoint))
        remote = f"s3://{server.new_bucket()}/tokenized"
        push(local, remote)
        cfg = load_config(None, {"eval": {"num_prompts": num_prompts}})
        start = time.perf_counter()
        with counting_s3_reads() as moved:
            prompts = read_eval_prompts(remote, cfg, None, tmp / "work")
        seconds = time.perf_counter() - start
    sizes = {e.path: e.size for e in Manifest.model_validate_json((local / MANIFEST_NAME).read_bytes()).files}
    read = {url.removeprefix(f"{remote}/"): n for url, n in moved.items() if url.startswith(f"{remote}/")}
    files_moved = sum(n for key, n in read.items() if key != MANIFEST_NAME)
    return {
        "part": "eval fetch",
        "prompts": len(prompts.ids),
        "seconds": round(seconds, 3),
        "bytes_moved": files_moved,
        "manifest_bytes": read.get(MANIFEST_NAME, 0),
        "held_out_bytes": sum(n for p, n in sizes.items() if p.startswith("held_out/")),
        "train_bytes": sum(n for p, n in sizes.items() if p.startswith("train/")),
        "total_bytes": sum(sizes.values()),
        "train_bytes_moved": sum(n for key, n in read.items() if key.startswith("train/")),
        "files_moved": sorted(k for k in read if k != MANIFEST_NAME),
    }


# ---------------------------------------------------------------------------------------------------------------------
# status over many artifacts


def make_artifacts(root: Path, count: int) -> None:
    """`count` committed artifacts of one tiny file each under `root`: a00000/ ..."""
    for i in range(count):
        folder = root / f"a{i:05d}"
        folder.mkdir(parents=True)
        (folder / "data.bin").write_bytes(f"artifact {i}\n".encode())
        commit_artifact(open_store(folder), "bench", [entry_for_local_file(folder, folder / "data.bin")], config={},
                        counts={"rows": 1})


def copy_artifacts(source: Path, root: Path, count: int) -> None:
    """The first `count` artifacts of `source` copied (new files, so nothing cached about them carries over)."""
    root.mkdir()
    for i in range(count):
        shutil.copytree(source / f"a{i:05d}", root / f"a{i:05d}")


def timed_status(root: Path, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one `status()` over the `n` artifacts under `root`, all of which must verify."""
    store = open_store(root)
    wall, cpu = time.perf_counter(), time.process_time()
    found = status(store)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert len(found) == n and all(a.state.value == "verified" for a in found), f"status at {n} found {len(found)}"
    return wall, cpu


def bench_status(tmp: Path, sizes: list[int], repeats: int = 3) -> dict[str, Any]:
    largest = max(sizes)
    start = time.perf_counter()
    make_artifacts(tmp / f"n{largest}", largest)
    for n in sizes:
        if n != largest:
            copy_artifacts(tmp / f"n{largest}", tmp / f"n{n}", n)
    built = time.perf_counter() - start
    result: dict[str, Any] = {"part": "status", "build_seconds": round(built, 1), "load_before": os.getloadavg()[0]}
    first: dict[int, tuple[float, float]] = {}
    again: dict[int, tuple[float, float]] = {}
    for n in sorted(sizes):
        first[n] = timed_status(tmp / f"n{n}", n)
        again[n] = min(timed_status(tmp / f"n{n}", n) for _ in range(max(1, repeats)))
        result[f"seconds_{n}"] = {
            "first": round(first[n][0], 3), "again": round(again[n][0], 3),
            "first_cpu": round(first[n][1], 3), "again_cpu": round(again[n][1], 3),
        }
    small = largest // 10
    if small in first:
        result[f"ratio_{largest}_over_{small}"] = {
            f"{name}{suffix}": round(times[largest][i] / times[small][i], 2)
            for i, suffix in ((0, ""), (1, "_cpu")) for name, times in (("first", first), ("again", again))
        }
    result["load_after"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--train-mib", type=int, default=256, help="size of the tokenized artifact's train split")
    parser.add_argument("--num-prompts", type=int, default=32, help="eval.num_prompts")
    parser.add_argument("--sizes", default="100,1000,10000", help="artifact counts for status")
    parser.add_argument("--repeats", type=int, default=3, help="repeated status passes per size (the fastest is "
                                                               "reported)")
    parser.add_argument("--skip", choices=["eval", "status"], action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        # The local checksum cache in this run's folder: status's first pass is then the uncached one, and the user's
        # cache is left alone.
        os.environ["BLOCKDRAFT_CACHE_DIR"] = str(Path(tmp) / "cache")
        if "eval" not in args.skip:
            (Path(tmp) / "eval").mkdir()
            print(json.dumps(bench_eval_fetch(Path(tmp) / "eval", args.train_mib, args.num_prompts)), flush=True)
        if "status" not in args.skip:
            (Path(tmp) / "status").mkdir()
            print(json.dumps(bench_status(Path(tmp) / "status", [int(n) for n in args.sizes.split(",")], args.repeats)),
                  flush=True)


if __name__ == "__main__":
    main()
