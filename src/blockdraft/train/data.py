"""The training rows: the train side of a verified tokenized artifact, in a seeded order per epoch.

The order and the anchors depend only on (seed, epoch, row index), never on a running random stream, so a run
resumed at any step consumes exactly the rows and anchors an uninterrupted run would.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.store import open_store
from blockdraft.store.artifact import ArtifactError, InputRef, State, verify_artifact

TOKENIZED_KIND = "tokenized"

TRAIN_SPLIT = "train"


def _load_dataset(root: Path):
    """The train rows under an artifact folder in `datasets.save_to_disk` layout: a DatasetDict with a train split,
    a Dataset with a `split` column, or a `train/` sub-folder."""
    from datasets import Dataset, DatasetDict, load_from_disk

    for candidate in (root, root / TRAIN_SPLIT):
        if (candidate / "dataset_dict.json").is_file() or (candidate / "state.json").is_file():
            ds = load_from_disk(str(candidate))
            break
    else:
        raise ArtifactError(f"{root} holds no dataset saved with datasets.save_to_disk; pass a tokenized artifact as train.data")
    if isinstance(ds, DatasetDict):
        if TRAIN_SPLIT not in ds:
            raise ArtifactError(f"tokenized artifact {root} has splits {sorted(ds)} but no '{TRAIN_SPLIT}'; re-run tokenize")
        ds = ds[TRAIN_SPLIT]
    assert isinstance(ds, Dataset)
    if "split" in ds.column_names:
        ds = ds.filter(lambda s: s == TRAIN_SPLIT, input_columns="split")
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ArtifactError(f"tokenized artifact {root} lacks column(s) {sorted(missing)}; it is not a tokenize output")
    return ds.select_columns(["input_ids", "loss_mask"])


@dataclass
class TrainRows:
    """The train rows in memory: ids and loss masks as lists of int tensors, plus the data artifact's lineage entry."""

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    lineage: InputRef

    def __len__(self) -> int:
        return len(self.input_ids)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[index], self.loss_mask[index]


def load_train_rows(url: str, store_settings: object, max_length: int) -> TrainRows:
    """Verify the tokenized artifact at `url` (local or s3://), fetch it if remote, and load its train rows clipped to max_length."""
    store = open_store(url, store_settings)
    report = verify_artifact(store)
    if report.state is not State.VERIFIED:
        raise ArtifactError(f"train.data {store.url} is {report.state.value}: {report.summary()}; fix or regenerate it first")
    if report.manifest.kind != TOKENIZED_KIND:
        raise ArtifactError(f"train.data {store.url} is a '{report.manifest.kind}' artifact; point it at a tokenize output")
    lineage = InputRef(kind="manifest", url=store.url, sha256=report.manifest_sha256)
    local = store.local_path()
    tmp = None
    try:
        if local is None:
            from blockdraft.store.transfer import pull

            tmp = Path(tempfile.mkdtemp(prefix="blockdraft-data-"))
            pull(url, tmp, store_settings)
            local = tmp
        ds = _load_dataset(local).with_format("torch")
        ids = [r[:max_length].long() for r in ds["input_ids"]]
        mask = [r[:max_length].long() for r in ds["loss_mask"]]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not ids:
        raise ArtifactError(f"tokenized artifact {url} has no train rows; tokenize more data or lower tokenize.held_out_fraction")
    return TrainRows(ids, mask, lineage)


def steps_per_epoch(num_rows: int, global_batch: int) -> int:
    return math.ceil(num_rows / global_batch)


def step_rows(num_rows: int, seed: int, epoch: int, step_in_epoch: int, global_batch: int, rank: int, per_rank: int) -> list[int]:
    """Row indices this rank trains on at one step: a slice of the epoch's seeded permutation.

    The last batch of an epoch wraps around to the permutation's start, so every rank always has `per_rank` rows
    (a rank without rows would stall DDP).
    """
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_rows, generator=g)
    first = step_in_epoch * global_batch + rank * per_rank
    return [int(order[i % num_rows]) for i in range(first, first + per_rank)]


__all__ = ["TrainRows", "load_train_rows", "step_rows", "steps_per_epoch"]
