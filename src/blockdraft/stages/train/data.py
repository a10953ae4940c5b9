"""The training rows: the train side of a verified tokenized artifact, in a seeded order per epoch.

The order and the anchors depend only on (seed, epoch, row index), never on a running random stream, so a run
resumed at any step consumes exactly the rows and anchors an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, concatenate_datasets

from blockdraft.added_tokens import HOW_TO_CHOOSE, known_mask_token_id, tokenizer_added_tokens
from blockdraft.config import BlockdraftConfig, StoreConfig
from blockdraft.data.formats import HELD_OUT_SPLIT, TRAIN_SPLIT
from blockdraft.data.seen_ids import SEEN_IDS, SeenIds, mask_in_data_problem, suggest_mask_token_id
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import StageInput
from blockdraft.store.transfer import pull


def _splits(root: Path, role: str) -> list[str]:
    """The splits a tokenize output folder lists (`datasets.save_to_disk` layout of a DatasetDict, docs/TOKENIZATION.md)."""
    listing = root / "dataset_dict.json"
    if not listing.is_file():
        raise ArtifactError(f"{root} holds no DatasetDict saved by tokenize (no dataset_dict.json); pass a tokenized artifact as {role}")
    return json.loads(listing.read_text()).get("splits", [])


def _columns(ds: Dataset, root: Path) -> Dataset:
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ArtifactError(f"tokenized artifact {root} lacks column(s) {sorted(missing)}; it is not a tokenize output")
    return ds.select_columns(["input_ids", "loss_mask"])


def _load_dataset(root: Path) -> Dataset:
    """The train split of a tokenize output folder.

    Only the train split is opened here: the held-out split may be empty, and training never steps on it
    (`_load_split` opens it for the held-out figures).
    """
    if TRAIN_SPLIT not in _splits(root, "train.data"):
        raise ArtifactError(f"tokenized artifact {root} has no '{TRAIN_SPLIT}' split; re-run tokenize")
    return _columns(Dataset.load_from_disk(str(root / TRAIN_SPLIT)), root)


def _load_split(root: Path, split: str, role: str) -> Dataset | None:
    """Split `split` of a tokenize output folder, or None when it has none or it holds no row."""
    if split not in _splits(root, role):
        return None
    # An empty split is saved with no Arrow file at all, which `load_from_disk` cannot open.
    if not json.loads((root / split / "state.json").read_text()).get("_data_files"):
        return None
    ds = _columns(Dataset.load_from_disk(str(root / split)), root)
    return ds if len(ds) else None


def _load_eval_rows(root: Path, url: str) -> Dataset:
    """Every row of the train.eval_data artifact in `root`: its train split, then its held-out split. All of them are
    held out from this run (a separate set of conversations, which may have been tokenized with held_out_fraction 0)."""
    parts = [ds for split in (TRAIN_SPLIT, HELD_OUT_SPLIT) if (ds := _load_split(root, split, "train.eval_data")) is not None]
    if not parts:
        raise ArtifactError(f"train.eval_data {url} holds no rows in either split; tokenize more conversations into it, or unset "
                            "train.eval_data to take train.data's held-out rows")
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


class TrainRows:
    """The train rows, memory-mapped from the artifact's Arrow files (read one row at a time, never all at once),
    plus the data artifact's lineage entry and what its tokenize run recorded (template hash, thinking mode, ...).
    `held_out`: the rows held out from training (None: there are none), read only for the held-out figures and the
    decoded checkpoints' prompts: train.data's held-out split, or every row of train.eval_data when it is set, whose
    lineage entry is then `eval_lineage`."""

    def __init__(
        self, dataset, lineage: InputRef, max_length: int, tokenize_run: dict | None = None, held_out=None,
        eval_lineage: InputRef | None = None,
    ) -> None:
        self.dataset = dataset
        self.held_out = held_out
        self.lineage = lineage
        self.eval_lineage = eval_lineage
        self.max_length = max_length
        self.tokenize_run = tokenize_run or {}

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) [<= max_length] long of row `index`."""
        r = self.dataset[index]
        ids = torch.as_tensor(r["input_ids"][: self.max_length], dtype=torch.long)
        return ids, torch.as_tensor(r["loss_mask"][: self.max_length], dtype=torch.long)


# What tokenize recorded of how rows were made (tokenize_run in the manifest's config), which held-out rows must share
# with the training rows: their figures measure the drafter on text it trains to draft.
_TOKENIZED_WITH = {
    "template_sha256": "chat template", "tokenizer_sha256": "tokenizer", "thinking": "thinking mode",
    "end_of_turn_id": "end-of-turn id",
}


def _shown(value: object) -> str:
    if value is None:
        return "none recorded"
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else repr(value)


def _content(ref: InputRef) -> tuple[Any, ...]:
    """What pins an input's content: a manifest's sha256, else a file's size and CRC64NVME, else its URL and ETag."""
    if ref.sha256:
        return ("sha256", ref.sha256)
    if ref.checksum:
        return ("crc64nvme", ref.size, ref.checksum)
    return ("etag", ref.url, ref.etag)


def check_eval_data(data: StageInput, eval_data: StageInput) -> None:
    """ConfigError (one line naming both) when train.eval_data cannot stand in for held-out rows of train.data: it is
    the same artifact, or was tokenized from an input train.data was tokenized from too (compared by content in the
    two manifests' lineage: its rows are training rows, and its figures training figures), or its rows were made
    another way (another chat template, tokenizer, thinking mode or end-of-turn id, as their tokenize_run record)."""
    ours, theirs = data.store.url.rstrip("/"), eval_data.store.url.rstrip("/")
    if eval_data.ref.sha256 == data.ref.sha256:
        raise ConfigError(
            f"train.eval_data {theirs} is the artifact train.data {ours} (the same manifest): its rows are the training rows, "
            "not held out; set train.eval_data to a separately tokenized artifact, or unset it to take train.data's held-out rows"
        )
    trained_from = {_content(ref) for ref in data.manifest.lineage}
    shared = next((ref for ref in eval_data.manifest.lineage if _content(ref) in trained_from), None)
    if shared is not None:
        raise ConfigError(
            f"train.eval_data {theirs} was tokenized from {shared.url}, as train.data {ours} was: its rows are "
            "training rows, so its held-out figures would be training figures; tokenize held-out conversations into "
            "train.eval_data apart from train.data's, or unset it to take train.data's held-out rows"
        )
    made = data.manifest.config.get("tokenize_run") or {}
    eval_made = eval_data.manifest.config.get("tokenize_run") or {}
    for key, what in _TOKENIZED_WITH.items():
        if made.get(key) != eval_made.get(key):
            raise ConfigError(
                f"train.eval_data {theirs} was tokenized with another {what} ({key} {_shown(eval_made.get(key))}) than train.data "
                f"{ours} ({_shown(made.get(key))}): its figures would measure the drafter on rows it does not learn to draft; "
                "tokenize the eval conversations with train.data's target, template and thinking settings"
            )


def check_mask_in_rows(config: BlockdraftConfig, hf_config: Any, data: StageInput) -> None:
    """Refuse, in one line and before any row is read, a mask id the rows of train.data hold (`added_tokens`: the rule),
    naming an id they never hold; the same when dflash.mask_token_id is unset and the target family has no reserved id.
    The ids come from what tokenize recorded in the manifest (`counts.token_ids`): an artifact without them is refused."""
    url = data.store.url
    record = data.manifest.counts.get(SEEN_IDS)
    if record is None:
        raise ArtifactError(f"tokenized artifact {url} records no token ids (counts.{SEEN_IDS}): it was made by an older blockdraft, "
                            "so dflash.mask_token_id cannot be checked against its rows; rerun tokenize into it (its rows are remade)")
    try:
        seen = SeenIds.from_record(record)
    except ValueError as exc:
        raise ArtifactError(f"tokenized artifact {url} has an unreadable counts.{SEEN_IDS} ({exc}); rerun tokenize into it") from None
    getter = getattr(hf_config, "get_text_config", None)
    text = getter() if getter is not None else hf_config
    vocab_size, model_type = int(text.vocab_size), getattr(text, "model_type", None)
    known = known_mask_token_id({"model_type": model_type, "vocab_size": vocab_size})
    folder = config.target.tokenizer or config.target.path
    added = tokenizer_added_tokens(Path(folder)) if folder else {}
    mask = config.dflash.mask_token_id if config.dflash.mask_token_id is not None else known
    if mask is None:
        fit = suggest_mask_token_id(seen, vocab_size, added)
        raise ConfigError(f"dflash.mask_token_id is not set and this target (model_type {model_type}, vocab_size {vocab_size}) has no "
                          f"known reserved id; {HOW_TO_CHOOSE}" + (f": here e.g. {fit}, which the rows of {url} never hold" if fit is not None else ""))
    if problem := mask_in_data_problem(mask, seen, url, vocab_size, added, known):
        raise ConfigError(problem)


def _local_copy(data: StageInput, store_config: StoreConfig | None, cache_dir: Path, fetch: bool) -> Path:
    """The folder `data` is read from: where it is when local, else `cache_dir/data-<manifest digest>`, which the
    process with `fetch` pulls it into (every checksum recomputed) and where a rerun finds it already verified."""
    local = data.store.local_path()
    if local is not None:
        return local
    digest = data.report.manifest_sha256
    assert digest is not None  # open_input returns only verified inputs, whose manifest digest is known
    local = cache_dir / f"data-{digest[:16]}"
    if fetch:
        pull(data.store.url, local, store_config)
    return local


def load_train_rows(
    data: StageInput, store_config: StoreConfig | None, max_length: int, cache_dir: Path, fetch: bool = True,
    wait: Callable[[], None] = lambda: None, eval_data: StageInput | None = None,
) -> TrainRows:
    """Open the train rows of the verified tokenized artifact `data` (from `open_input`), clipped to max_length, and
    the held-out rows: every row of `eval_data` (train.eval_data, verified the same way) when given, else `data`'s
    held-out split.

    A remote artifact is pulled into the local cache under `cache_dir` (`_local_copy`). Of the processes on one machine
    only the one with `fetch` pulls; every process then calls `wait` (a barrier) before reading.
    """
    local = _local_copy(data, store_config, cache_dir, fetch)
    eval_local = _local_copy(eval_data, store_config, cache_dir, fetch) if eval_data is not None else None
    wait()
    dataset = _load_dataset(local)
    if len(dataset) == 0:
        raise ArtifactError(f"tokenized artifact {data.store.url} has no train rows; tokenize more data or lower tokenize.held_out_fraction")
    tokenize_run = data.manifest.config.get("tokenize_run")
    if eval_data is None or eval_local is None:
        return TrainRows(dataset, data.ref, max_length, tokenize_run, _load_split(local, HELD_OUT_SPLIT, "train.data"))
    return TrainRows(dataset, data.ref, max_length, tokenize_run, _load_eval_rows(eval_local, eval_data.store.url), eval_data.ref)


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


__all__ = ["RowOrder", "TrainRows", "check_eval_data", "check_mask_in_rows", "epoch_order", "load_train_rows", "steps_per_epoch"]
