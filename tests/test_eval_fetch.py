"""`eval` reads only what it needs from a tokenized artifact on S3 (a real SeaweedFS server on 127.0.0.1): the held-out
split's files, in row order, up to the one that completes eval.num_prompts; never a byte of the train split. What moved
is counted at the store (every S3Store read), not inferred from what landed on disk."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from helpers.paths import GOLDEN

from blockdraft.config import load_config
from blockdraft.model.drafter import DFlashDrafter
from blockdraft.stages import eval as eval_stage
from blockdraft.stages.eval.prompts import held_out_prompts
from blockdraft.stages.train import save_checkpoint
from blockdraft.store import open_store
from blockdraft.store.artifact import MANIFEST_NAME, commit_artifact, entry_for_local_file
from blockdraft.store.inputs import open_input
from blockdraft.store.local import LocalStore
from blockdraft.store.s3 import S3Store
from blockdraft.store.transfer import push

GOLDEN_DFLASH = {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 3, 5], "num_draft_layers": 3,
                 "gamma": 4.0}
HELD_OUT_SHARDS = 4


def _rows(count: int, seed: int, length: int = 48) -> list[dict]:
    """Rows in the golden target's vocabulary: 8 unsupervised prompt tokens, then supervised ones."""
    rng = random.Random(seed)
    return [
        {"input_ids": [rng.randrange(500) for _ in range(length)], "loss_mask": [0] * 8 + [1] * (length - 8),
         "source_id": f"r{seed}-{i}"}
        for i in range(count)
    ]


def _tokenized(folder: Path) -> Path:
    """A tokenized artifact in the layout tokenize writes: a big train split and a held-out split in several Arrow
    files."""
    splits = DatasetDict({"train": Dataset.from_list(_rows(3000, 1)), "held_out": Dataset.from_list(_rows(16, 2))})
    splits.save_to_disk(str(folder), num_shards={"train": 3, "held_out": HELD_OUT_SHARDS})
    entries = [entry_for_local_file(folder, p) for p in sorted(folder.rglob("*")) if p.is_file()]
    commit_artifact(open_store(folder), "tokenized", entries, config={}, counts={})
    return folder


class Moved:
    """Bytes each S3 object sent, by URL, over every read path of S3Store (whole-object downloads, small reads,
    read-back checksums, streams: a stream counts its whole object, an upper bound)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes: Counter[str] = Counter()
        moved = self.bytes

        def url(store: S3Store, key: str) -> str:
            return f"{store.url.rstrip('/')}/{key}"

        get_file, read_bytes, checksum_by_reading, open_read = (
            S3Store.get_file, S3Store.read_bytes, S3Store.checksum_by_reading, S3Store.open_read
        )

        def counted_get_file(store: S3Store, key: str, into: LocalStore, as_key: str) -> tuple[int, str]:
            size, checksum = get_file(store, key, into, as_key)
            moved[url(store, key)] += size
            return size, checksum

        def counted_read_bytes(store: S3Store, key: str) -> bytes:
            data = read_bytes(store, key)
            moved[url(store, key)] += len(data)
            return data

        def counted_checksum_by_reading(store: S3Store, key: str) -> tuple[int, str]:
            size, checksum = checksum_by_reading(store, key)
            moved[url(store, key)] += size
            return size, checksum

        def counted_open_read(store: S3Store, key: str):
            stream = open_read(store, key)
            info = store.head(key)
            moved[url(store, key)] += info.size if info else 0
            return stream

        monkeypatch.setattr(S3Store, "get_file", counted_get_file)
        monkeypatch.setattr(S3Store, "read_bytes", counted_read_bytes)
        monkeypatch.setattr(S3Store, "checksum_by_reading", counted_checksum_by_reading)
        monkeypatch.setattr(S3Store, "open_read", counted_open_read)

    def under(self, prefix: str) -> dict[str, int]:
        return {u.removeprefix(prefix): n for u, n in self.bytes.items() if u.startswith(prefix)}


def _sizes(remote: str) -> dict[str, int]:
    return {e.path: e.size for e in open_input(remote).manifest.files}


def test_eval_against_an_s3_tokenized_artifact_moves_at_most_the_held_out_bytes(s3_bucket, tmp_path, monkeypatch):
    remote = f"s3://{s3_bucket}/tokenized"
    push(_tokenized(tmp_path / "tokenized"), remote)
    cfg = load_config(None, {
        "target": {"path": str(GOLDEN / "target")},
        "dflash": dict(GOLDEN_DFLASH),
        "store": {"url": str(tmp_path / "store")},
        "train": {"data": remote},
        "eval": {"untrained_baseline": False, "num_prompts": 3},
    })
    save_checkpoint(open_store(tmp_path / "ckpt"), 7, DFlashDrafter.from_pretrained(GOLDEN / "drafter"), {},
                    cfg.resolved(), [], {})
    sizes = _sizes(remote)
    held_out = {path: size for path, size in sizes.items() if path.startswith("held_out/")}
    arrow = sorted(p for p in held_out if p.endswith(".arrow"))
    assert len(arrow) == HELD_OUT_SHARDS and sum(sizes.values()) > 10 * sum(held_out.values())

    moved = Moved(monkeypatch)
    result = eval_stage.run(cfg, str(tmp_path / "ckpt"), max_new_tokens=6)
    assert result.details.num_prompts == 3 and result.details.prompts_source == [remote] and result.details.lossless.ok

    read = moved.under(f"{remote}/")
    files = {path: n for path, n in read.items() if path != MANIFEST_NAME}
    assert not [p for p in read if p.startswith("train/")]
    assert set(files) <= set(held_out) and all(n == held_out[p] for p, n in files.items())  # each read once, whole
    assert sum(files.values()) <= sum(held_out.values())
    # Three prompts sit in the first held-out file (four rows each): its state.json and that file are all that moved.
    assert set(files) == {"held_out/state.json", arrow[0]}


def test_every_held_out_file_is_read_once_when_the_prompts_need_them_all(s3_bucket, tmp_path, monkeypatch):
    local = _tokenized(tmp_path / "tokenized")
    remote = f"s3://{s3_bucket}/tokenized"
    push(local, remote)
    data = open_input(remote)
    held_out = {path: size for path, size in _sizes(remote).items() if path.startswith("held_out/")}

    moved = Moved(monkeypatch)
    prompts = held_out_prompts(data, limit=100, workdir=tmp_path / "work")
    files = moved.under(f"{remote}/")
    assert files == {p: n for p, n in held_out.items() if p.endswith(".arrow") or p.endswith("/state.json")}
    assert len(prompts) == 16 and prompts == [
        row[:8] for row in DatasetDict.load_from_disk(str(local))["held_out"]["input_ids"]
    ]

    # A local artifact is read where it is: nothing is copied into the work folder.
    assert held_out_prompts(open_input(str(local)), limit=100, workdir=tmp_path / "local") == prompts
    assert not (tmp_path / "local").exists()
