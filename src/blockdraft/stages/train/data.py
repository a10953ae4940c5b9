"""The training rows: the train side of a verified tokenized artifact, in a seeded order per epoch.

The order and the anchors depend only on (seed, epoch, row index), never on a running random stream, so a run
resumed at any step consumes exactly the rows and anchors an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset

from blockdraft.config import StoreConfig
from blockdraft.data.formats import HELD_OUT_SPLIT, TRAIN_SPLIT
from blockdraft.errors import ArtifactError
from blockdraft.store.artifact import InputRef
from blockdraft.store.stage_io import StageInput
from blockdraft.store.transfer import pull


def _load_dataset(root: Path) -> Dataset:
    """The train split of a tokenize output folder (`datasets.save_to_disk` layout of a DatasetDict, docs/TOKENIZATION.md).

    Only the train split is opened here: the held-out split may be empty, and training never steps on it
    (`_load_held_out` opens it for the held-out figures).
    """
    listing = root / "dataset_dict.json"
    if not listing.is_file():
        raise ArtifactError(f"{root} holds no DatasetDict saved by tokenize (no dataset_dict.json); pass a tokenized artifact as train.data")
    if TRAIN_SPLIT not in json.loads(listing.read_text()).get("splits", []):
        raise ArtifactError(f"tokenized artifact {root} has no '{TRAIN_SPLIT}' split; re-run tokenize")
    ds = Dataset.load_from_disk(str(root / TRAIN_SPLIT))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ArtifactError(f"tokenized artifact {root} lacks column(s) {sorted(missing)}; it is not a tokenize output")
    return ds.select_columns(["input_ids", "loss_mask"])


def _load_held_out(root: Path) -> Dataset | None:
    """The held-out split of a tokenize output folder, or None when it has none or it holds no row."""
    if HELD_OUT_SPLIT not in json.loads((root / "dataset_dict.json").read_text()).get("splits", []):
        return None
    # An empty split is saved with no Arrow file at all, which `load_from_disk` cannot open.
    if not json.loads((root / HELD_OUT_SPLIT / "state.json").read_text()).get("_data_files"):
        return None
    ds = Dataset.load_from_disk(str(root / HELD_OUT_SPLIT))
    return ds.select_columns(["input_ids", "loss_mask"]) if len(ds) else None


class TrainRows:
    """The train rows, memory-mapped from the artifact's Arrow files (read one row at a time, never all at once),
    plus the data artifact's lineage entry and what its tokenize run recorded (template hash, thinking mode, ...).
    `held_out`: the artifact's held-out rows (None: it has none), read only for the held-out figures."""

    def __init__(self, dataset, lineage: InputRef, max_length: int, tokenize_run: dict | None = None, held_out=None) -> None:
        self.dataset = dataset
        self.held_out = held_out
        self.lineage = lineage
        self.max_length = max_length
        self.tokenize_run = tokenize_run or {}

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) [<= max_length] long of row `index`."""
        r = self.dataset[index]
        ids = torch.as_tensor(r["input_ids"][: self.max_length], dtype=torch.long)
        return ids, torch.as_tensor(r["loss_mask"][: self.max_length], dtype=torch.long)


def load_train_rows(
    data: StageInput, store_config: StoreConfig | None, max_length: int, cache_dir: Path, fetch: bool = True,
    wait: Callable[[], None] = lambda: None,
) -> TrainRows:
    """Open the train rows of the verified tokenized artifact `data` (from `open_input`), clipped to max_length.

    A remote artifact is pulled (every checksum recomputed) into `cache_dir/data-<manifest digest>`, where a rerun
    finds it already verified. Of the processes on one machine only the one with `fetch` pulls; every process then
    calls `wait` (a barrier) before reading.
    """
    local = data.store.local_path()
    if local is None:
        digest = data.report.manifest_sha256
        assert digest is not None  # open_input returns only verified inputs, whose manifest digest is known
        local = cache_dir / f"data-{digest[:16]}"
        if fetch:
            pull(data.store.url, local, store_config)
    wait()
    dataset = _load_dataset(local)
    if len(dataset) == 0:
        raise ArtifactError(f"tokenized artifact {data.store.url} has no train rows; tokenize more data or lower tokenize.held_out_fraction")
    return TrainRows(dataset, data.ref, max_length, data.manifest.config.get("tokenize_run"), _load_held_out(local))


def steps_per_epoch(num_rows: int, global_batch: int) -> int:
    return math.ceil(num_rows / global_batch)


def epoch_order(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """[num_rows] long: the seeded permutation of the rows in `epoch`."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_rows, generator=g)


class RowOrder:
    """The rows each step trains on: slices of its epoch's seeded permutation (`epoch_order`).

    The permutation is drawn once per epoch and kept (8 bytes a row), not once per step: drawing it costs time linear in
    the rows (tens of ms at a million), which would otherwise grow every step's cost with the data.
    """

    def __init__(self, num_rows: int, seed: int, global_batch: int, per_rank: int) -> None:
        self.num_rows, self.seed, self.global_batch, self.per_rank = num_rows, seed, global_batch, per_rank
        self._epoch: int | None = None
        self._order = torch.empty(0, dtype=torch.long)

    def rows(self, epoch: int, step_in_epoch: int, rank: int) -> list[int]:
        """Row indices `rank` trains on at one step. The last batch of an epoch wraps around to the permutation's start,
        so every rank always has `per_rank` rows (a rank without rows would stall DDP)."""
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_rows, self.seed, epoch)
        first = step_in_epoch * self.global_batch + rank * self.per_rank
        return self._order[torch.arange(first, first + self.per_rank) % self.num_rows].tolist()


__all__ = ["RowOrder", "TrainRows", "epoch_order", "load_train_rows", "steps_per_epoch"]
