"""The training data: the rows of a tokenized artifact in a seeded order, and the DFlash blocks built from them.

The training rows: the train side of a verified tokenized artifact, in a seeded order per epoch.

The order and the anchors depend only on (seed, epoch, row index), never on a running random stream, so a run
resumed at any step consumes exactly the rows and anchors an uninterrupted run would.

Training batch construction for DFlash (docs/DFLASH.md, "Training batch construction").

One training row (input_ids, loss_mask of length S) becomes N blocks of B query slots, laid out after the row's S
context entries. Shapes below: b = rows in the batch, S = longest row, N = blocks per row, B = block size, Q = N*B.
With `train.packing` the target reads the batch's rows back to back in fewer, fuller sequences instead (`PackedRows`),
each row seen alone, and its features are laid back out as rows for the drafter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch
from datasets import Dataset, concatenate_datasets

from blockdraft.added_tokens import HOW_TO_CHOOSE, known_mask_token_id, tokenizer_added_tokens
from blockdraft.config import BlockdraftConfig, StoreConfig
from blockdraft.data.formats import HELD_OUT_SPLIT, TRAIN_SPLIT
from blockdraft.data.seen_ids import SEEN_IDS, SeenIds, mask_in_data_problem, suggest_mask_token_id
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.model.attention import sliding_window_mask
from blockdraft.model.block_sparse import AnchorLayout
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import StageInput
from blockdraft.store.transfer import pull


def _splits(root: Path, role: str) -> list[str]:
    """The splits a tokenize output folder lists (`datasets.save_to_disk` layout of a DatasetDict,
    docs/TOKENIZATION.md)."""
    listing = root / "dataset_dict.json"
    if not listing.is_file():
        raise ArtifactError(f"{root} holds no DatasetDict saved by tokenize (no dataset_dict.json); pass a tokenized "
                            f"artifact as {role}")
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
    parts = [ds for split in (TRAIN_SPLIT, HELD_OUT_SPLIT)
             if (ds := _load_split(root, split, "train.eval_data")) is not None]
    if not parts:
        raise ArtifactError(f"train.eval_data {url} holds no rows in either split; tokenize more conversations into "
                            "it, or unset train.eval_data to take train.data's held-out rows")
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
            f"train.eval_data {theirs} is the artifact train.data {ours} (the same manifest): its rows are the "
            "training rows, not held out; set train.eval_data to a separately tokenized artifact, or unset it to take "
            "train.data's held-out rows"
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
                f"train.eval_data {theirs} was tokenized with another {what} ({key} {_shown(eval_made.get(key))}) than "
                f"train.data {ours} ({_shown(made.get(key))}): its figures would measure the drafter on rows it does "
                "not learn to draft; tokenize the eval conversations with train.data's target, template and thinking "
                "settings"
            )


def check_mask_in_rows(config: BlockdraftConfig, hf_config: Any, data: StageInput) -> None:
    """Refuse, in one line and before any row is read, a mask id the rows of train.data hold (`added_tokens`: the rule),
    naming an id they never hold; the same when dflash.mask_token_id is unset and the target family has no reserved id.
    The ids come from what tokenize recorded in the manifest (`counts.token_ids`): an artifact without them is
    refused."""
    url = data.store.url
    record = data.manifest.counts.get(SEEN_IDS)
    if record is None:
        raise ArtifactError(f"tokenized artifact {url} records no token ids (counts.{SEEN_IDS}): it was made by an "
                            "older blockdraft, so dflash.mask_token_id cannot be checked against its rows; rerun "
                            "tokenize into it (its rows are remade)")
    try:
        seen = SeenIds.from_record(record)
    except ValueError as exc:
        raise ArtifactError(f"tokenized artifact {url} has an unreadable counts.{SEEN_IDS} ({exc}); rerun tokenize "
                            "into it") from None
    getter = getattr(hf_config, "get_text_config", None)
    text = getter() if getter is not None else hf_config
    vocab_size, model_type = int(text.vocab_size), getattr(text, "model_type", None)
    known = known_mask_token_id({"model_type": model_type, "vocab_size": vocab_size})
    folder = config.target.tokenizer or config.target.path
    added = tokenizer_added_tokens(Path(folder)) if folder else {}
    mask = config.dflash.mask_token_id if config.dflash.mask_token_id is not None else known
    if mask is None:
        fit = suggest_mask_token_id(seen, vocab_size, added)
        raise ConfigError(
            f"dflash.mask_token_id is not set and this target (model_type {model_type}, vocab_size "
            f"{vocab_size}) has no known reserved id; {HOW_TO_CHOOSE}"
            + (f": here e.g. {fit}, which the rows of {url} never hold" if fit is not None else "")
        )
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
        raise ArtifactError(f"tokenized artifact {data.store.url} has no train rows; tokenize more data or lower "
                            "tokenize.held_out_fraction")
    tokenize_run = data.manifest.config.get("tokenize_run")
    if eval_data is None or eval_local is None:
        return TrainRows(dataset, data.ref, max_length, tokenize_run, _load_split(local, HELD_OUT_SPLIT, "train.data"))
    return TrainRows(dataset, data.ref, max_length, tokenize_run, _load_eval_rows(eval_local, eval_data.store.url),
                     eval_data.ref)


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


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p <= S-2 with loss_mask[p] and loss_mask[p+1] set: [E] long, ascending.

    The anchor itself is a clean token already produced, and slot 1 (the first draft) must be supervised.
    """
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` eligible anchors drawn uniformly without replacement, sorted; padded to exactly
    `num_anchors`.

    Returns (anchors [N] long, keep [N] bool). Padded entries have anchor 0 and keep False.
    """
    eligible = eligible_anchors(loss_mask)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    if eligible.numel() > num_anchors:
        pick = torch.randperm(eligible.numel(), generator=generator)[:num_anchors]
        eligible = eligible[pick].sort().values
    anchors[: eligible.numel()] = eligible
    keep[: eligible.numel()] = True
    return anchors, keep


def anchor_generator(seed: int, epoch: int, row: int) -> torch.Generator:
    """The generator that draws row `row`'s anchors in `epoch`.

    Keyed by (seed, epoch, row) rather than one running stream, so a resumed run draws exactly the anchors an
    uninterrupted run would, and every epoch draws new ones.
    """
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + row) % 2**63)  # manual_seed takes 64 bits
    return g


def slot_decay(block_size: int, gamma: float) -> torch.Tensor:
    """[B] float: 0 for slot 0 (the anchor, not predicted), exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def block_attention_mask(
    anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """[b, 1, Q, S+Q] bool, True = may attend; keys are the S context entries, then the Q = N*B block slots.

    Full attention (`sliding_window` None): a query of block n sees context keys at positions strictly below its anchor
    (`<=` would leak the anchor's own hidden state, which inference does not have) and every slot of its own block,
    bidirectionally. A padded block (keep False) sees its own block only, so no query row is fully masked (that gives
    NaN in SDPA). A sliding layer with window W sees that AND its causal window: the query at q = a_n + k sees context
    positions c with q - W < c < a_n and its own block's slots at positions <= q (what the drafter computes per layer).
    """
    b, n = anchors.shape
    q = n * block_size
    block_of_query = torch.arange(q, device=anchors.device) // block_size  # [Q]
    anchor_of_query = anchors[:, block_of_query]  # [b, Q]
    keep_of_query = keep[:, block_of_query]  # [b, Q]
    ctx_pos = torch.arange(context_len, device=anchors.device)
    ctx = (ctx_pos[None, None, :] < anchor_of_query[:, :, None]) & keep_of_query[:, :, None]  # [b, Q, S]
    own = (block_of_query[:, None] == block_of_query[None, :]).expand(b, q, q)  # [b, Q, Q]
    mask = torch.cat([ctx, own], dim=-1)[:, None]
    if sliding_window is None:
        return mask
    query_pos = anchor_of_query + torch.arange(block_size, device=anchors.device).repeat(n)  # [b, Q]
    key_pos = torch.cat([ctx_pos.expand(b, context_len), query_pos], dim=1)  # [b, S+Q]
    return mask & sliding_window_mask(query_pos, key_pos, sliding_window)


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Indices into `lengths` grouped into sequences of at most `max_length` tokens: each row goes into the first
    sequence it fits (first fit, in the given order, so the packing depends only on the rows and their order). Rows are
    clipped to `max_length` when read (`TrainRows.row`), so every row fits an empty sequence."""
    packs: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"row {i} has {n} tokens, more than max_length {max_length}")
        fit = next((j for j, free in enumerate(room) if free >= n), None)
        if fit is None:
            packs.append([i])
            room.append(max_length - n)
        else:
            packs[fit].append(i)
            room[fit] -= n
    return packs


@dataclass
class PackedRows:
    """A batch's rows laid back to back for the target's forward (`pack_rows`): input_ids [p, T] long (right-padded
    with 0), positions [p, T] long (each token's position in its row: they restart at 0 where a row, or the padding,
    begins, which is how the target tells the rows apart), real [p, T] bool (the rows' tokens) and `index` [b, S] long:
    where each token of the batch's padded rows sits in the packed sequences flattened (a padded entry points at entry
    0)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, seqs: Sequence[torch.Tensor], max_length: int) -> PackedRows:
        packs = pack_rows([ids.numel() for ids in seqs], max_length)
        t = max(sum(seqs[i].numel() for i in pack) for pack in packs)
        input_ids = torch.zeros(len(packs), t, dtype=torch.long)
        positions = torch.zeros(len(packs), t, dtype=torch.long)
        real = torch.zeros(len(packs), t, dtype=torch.bool)
        index = torch.zeros(len(seqs), max(ids.numel() for ids in seqs), dtype=torch.long)
        for p, pack in enumerate(packs):
            at = 0
            for i in pack:
                n = seqs[i].numel()
                input_ids[p, at : at + n], real[p, at : at + n] = seqs[i], True
                positions[p, at : at + n] = torch.arange(n)
                index[i, :n] = p * t + at + torch.arange(n)
                at += n
            positions[p, at:] = torch.arange(t - at)
        return cls(input_ids, positions, real, index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-token states of the packed sequences [p, T, F] -> the same states as the batch's rows [b, S, F] (padded
        entries hold some row's state: nothing reads them)."""
        return packed.flatten(0, 1)[self.index.to(packed.device)]


@dataclass
class BlockBatch:
    """One packed training batch; every tensor is on the CPU until `to(device)`.

    input_ids [b, S] long (right-padded with 0), attention_mask_context [b, S] bool (real tokens), context_positions [b,
    S], anchors [b, N], keep [b, N] bool, block_ids [b, Q] (anchor token at slot 0, mask token elsewhere),
    block_positions [b, Q] (anchor + k), labels [b, Q] (token at anchor + k), weights [b, Q] float.
    `attention_mask` [b, 1, Q, S+Q] bool is built on the batch's device when read (it is the one large tensor:
    about 92 MB per row at S = 3072, N = 512, B = 16, not worth a host-to-device copy). `attention` says what the
    drafter gets (`drafter_attention`): that dense mask, or with "flex" the anchors' layout, from which it builds
    block-sparse masks, so the dense one is never made. `packed`: the rows as the target reads them with
    `train.packing` (None: it reads `input_ids`), kept on the CPU.
    """

    input_ids: torch.Tensor
    attention_mask_context: torch.Tensor
    context_positions: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor
    block_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    block_size: int
    attention: Literal["dense", "flex"] = "dense"
    packed: PackedRows | None = None

    @property
    def attention_mask(self) -> torch.Tensor:
        return block_attention_mask(self.anchors, self.keep, self.input_ids.shape[1], self.block_size)

    @property
    def layout(self) -> AnchorLayout:
        return AnchorLayout(self.anchors, self.keep, self.input_ids.shape[1], self.block_size)

    @property
    def drafter_attention(self) -> torch.Tensor | AnchorLayout:
        """The drafter forward's `attention_mask` argument for this batch's `attention` path."""
        return self.layout if self.attention == "flex" else self.attention_mask

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) context tokens in the batch."""
        return int(self.attention_mask_context.sum())

    @property
    def num_positions(self) -> int:
        """Entries the target's padded or packed forward computes, padding included (packed rows run one by one
        compute `num_tokens`)."""
        return (self.packed.input_ids if self.packed is not None else self.input_ids).numel()

    def to(self, device: torch.device | str) -> BlockBatch:
        moved = {f.name: value.to(device) for f in fields(self)
                 if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def build_block_batch(
    rows: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]],
    *,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    generators: Sequence[torch.Generator],
    attention: Literal["dense", "flex"] = "dense",
    pack_to: int | None = None,
) -> BlockBatch:
    """Lay `rows` ((input_ids, loss_mask) pairs) out as one BlockBatch, one generator per row for its anchors;
    `attention` is the drafter's attention path (`blockdraft.model.block_sparse.resolve_attention`); `pack_to`: also
    pack the rows into sequences of at most that many tokens for the target (`PackedRows`).

    N is min(num_anchors, the most eligible anchors of any row in the batch) (at least 1): rows with fewer get padded
    blocks of weight 0. Weight of slot k of block n:
    keep_n * (a_n + k < S_row) * (k > 0) * loss_mask[a_n + k] * exp(-(k - 1) / gamma).
    """
    if len(rows) != len(generators):
        raise ValueError(f"{len(rows)} rows but {len(generators)} generators")
    seqs = [torch.as_tensor(ids, dtype=torch.long) for ids, _ in rows]
    masks = [torch.as_tensor(mask, dtype=torch.bool) for _, mask in rows]
    for ids, mask in zip(seqs, masks, strict=True):
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids length {ids.numel()} != loss_mask length {mask.numel()}")
    b = len(seqs)
    s = max(ids.numel() for ids in seqs)
    n = max(1, min(num_anchors, max(eligible_anchors(mask).numel() for mask in masks)))
    q = n * block_size

    input_ids = torch.zeros(b, s, dtype=torch.long)
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    real = torch.zeros(b, s, dtype=torch.bool)
    anchors = torch.zeros(b, n, dtype=torch.long)
    keep = torch.zeros(b, n, dtype=torch.bool)
    for i, (ids, mask, gen) in enumerate(zip(seqs, masks, generators, strict=True)):
        input_ids[i, : ids.numel()] = ids
        loss_mask[i, : ids.numel()] = mask
        real[i, : ids.numel()] = True
        anchors[i], keep[i] = sample_anchors(mask, n, gen)

    k = torch.arange(block_size).repeat(n)  # [Q] slot index within its block
    block_of_query = torch.arange(q) // block_size
    block_positions = anchors[:, block_of_query] + k  # [b, Q]
    in_row = torch.stack([block_positions[i] < seqs[i].numel() for i in range(b)])  # [b, Q]
    gather_pos = block_positions.clamp(max=s - 1)
    labels = torch.gather(input_ids, 1, gather_pos)
    supervised = torch.gather(loss_mask, 1, gather_pos) & in_row & keep[:, block_of_query]
    weights = slot_decay(block_size, gamma)[k][None, :] * supervised.float()
    block_ids = torch.where(k[None, :] == 0, labels, torch.full_like(labels, mask_token_id))

    return BlockBatch(
        input_ids=input_ids,
        attention_mask_context=real,
        context_positions=torch.arange(s).expand(b, s).clone(),
        anchors=anchors,
        keep=keep,
        block_ids=block_ids,
        block_positions=block_positions,
        labels=labels,
        weights=weights,
        block_size=block_size,
        attention=attention,
        packed=PackedRows.of(seqs, pack_to) if pack_to is not None else None,
    )


def teacher_forced_tau(leading: Sequence[float], blocks: float) -> float:
    """tau estimate of drafted blocks, teacher forced: 1 + the mean over `blocks` of how many slots from slot 1 on were
    all right (`leading[k]`: the blocks whose slots 1..k+1 all were). What a greedy verify accepts of them when the
    target's next tokens are the row's; taken block by block, since a slot is right far more often after right slots
    before it than its share over all blocks says (a product of per-slot accuracies reads well below decoding)."""
    return 1.0 + float(sum(leading)) / blocks if blocks > 0 else 1.0


__all__ = [
    "BlockBatch", "PackedRows", "RowOrder", "TrainRows", "anchor_generator", "block_attention_mask",
    "build_block_batch", "check_eval_data", "check_mask_in_rows", "eligible_anchors", "epoch_order", "load_train_rows",
    "pack_rows", "sample_anchors", "slot_decay", "steps_per_epoch", "teacher_forced_tau",
]
