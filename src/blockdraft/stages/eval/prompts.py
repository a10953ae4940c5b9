"""Eval's prompts, as token ids, one set per source: a prompt set (a file of one of the layouts `prompt_sets.py` reads,
local or in a store, a folder `datasets` saved, or a hub dataset), or the held-out rows of a tokenized artifact
(docs/TOKENIZATION.md, "Train / held-out split"); and the target's tokenizer that renders text prompts.

Only what is read is fetched: a prompts file, or of a tokenized artifact the held-out split's files up to the one that
completes eval.num_prompts (never its train split), each compared with its listed size and checksum on the bytes
received.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import AutoTokenizer

from blockdraft.config import BlockdraftConfig, TargetConfig
from blockdraft.data.formats import TOKENIZED_KIND, TRAIN_SPLIT
from blockdraft.errors import EvalError
from blockdraft.stages.eval.prompt_sets import SET_FILES, is_prompt_set, jsonl_rows, read_prompt_set
from blockdraft.store.artifact import InputRef
from blockdraft.store.inputs import StageInput, open_input

STATE_FILE = "state.json"  # what `datasets.save_to_disk` writes beside a dataset's Arrow files
AUTO_LAYOUT = "auto"  # a prompt set's layout recognised from its columns
HELD_OUT_LAYOUT = "held-out"  # the held-out rows of a tokenized artifact


@dataclass
class EvalSet:
    """One prompt set: its name in the report (its layout, numbered when two sets share one), layout, source as given,
    prompt token ids and lineage entry (a raw file, an artifact manifest, or the rows read through `datasets`)."""

    name: str
    layout: str
    source: str
    ids: list[list[int]]
    ref: InputRef


@dataclass
class EvalPrompts:
    """The prompt sets of one eval, in the order given; `ids` are all their prompts in that order."""

    sets: list[EvalSet]

    @property
    def ids(self) -> list[list[int]]:
        return [ids for s in self.sets for ids in s.ids]

    @property
    def sources(self) -> list[str]:
        return [s.source for s in self.sets]

    @property
    def refs(self) -> list[InputRef]:
        return [s.ref for s in self.sets]


def read_eval_prompts(
    source: str | Sequence[str] | None, cfg: BlockdraftConfig, tokenizer: Any, workdir: Path,
    layouts: Sequence[str] = (), every_split: Collection[str] = (),
) -> EvalPrompts:
    """Up to eval.num_prompts prompts from each source: a prompt set (`prompt_sets.read_prompt_set`: a JSONL, JSON or
    Parquet file, a folder of Parquet files or one `datasets` saved, `hf://datasets/NAME`), else a tokenized artifact's
    held-out rows (every row, both splits, for a source in `every_split`: an artifact that is held out whole, as
    train.eval_data is).
    `layouts`: none, or one per source (a layout name, or `auto` to recognise it from its columns). Raises EvalError
    when there is no source, the layouts do not pair with the sources, or a source holds no prompt."""
    sources = [source] if isinstance(source, str) else list(source or [])
    if not sources:
        raise EvalError("no prompts: pass --prompts FILE, set eval.prompts, or set train.data to a tokenized artifact")
    if layouts and len(layouts) != len(sources):
        raise EvalError(
            f"{len(layouts)} prompt set name(s) for {len(sources)} prompts source(s); give one --prompt-set per "
            "--prompts (auto: recognised from its columns), or none"
        )
    limit = cfg.eval.num_prompts
    sets: list[EvalSet] = []
    for index, src in enumerate(sources):
        named = layouts[index] if layouts and layouts[index] != AUTO_LAYOUT else None
        if is_prompt_set(src, cfg.store):
            found = read_prompt_set(src, named, cfg.store, workdir, limit)
            ids = [_render_prompt(row, tokenizer, cfg, where) for row, where in zip(found.rows, found.where,
                                                                                    strict=True)]
            layout, ref = found.layout, found.ref
        elif named is not None:
            raise EvalError(f"--prompt-set {named} names the layout of a prompts file, but {src} is not one "
                            f"({', '.join(SET_FILES)}, a folder of Parquet files or one `datasets` saved, "
                            "hf://datasets/NAME); use auto for a tokenized artifact's held-out rows")
        else:
            data = open_input(src, cfg.store, kinds=[TOKENIZED_KIND], role="prompts artifact")
            (workdir / f"held-out-{index}").mkdir(parents=True, exist_ok=True)
            ids = held_out_prompts(data, limit, workdir / f"held-out-{index}", every_split=src in every_split)
            layout, ref = HELD_OUT_LAYOUT, data.ref
        if not ids:
            raise EvalError(f"no prompts found in {src}; give at least one")
        taken = {s.name for s in sets}
        name = (
            layout
            if layout not in taken
            else next(f"{layout}-{n}" for n in range(2, len(sources) + 2) if f"{layout}-{n}" not in taken)
        )
        sets.append(EvalSet(name, layout, src, ids, ref))
    return EvalPrompts(sets)


def load_target_tokenizer(target: TargetConfig) -> Any:
    """The target's tokenizer (target.tokenizer, else target.path) with target.chat_template, or None when that folder
    has none."""
    source = target.tokenizer or target.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None
    if target.chat_template:
        tokenizer.chat_template = Path(target.chat_template).read_text()
    return tokenizer


def stop_token_ids(hf_model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the generation config's eos ids, plus the tokenizer's eos token."""
    ids: set[int] = set()
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------------------------------
# A JSONL file


def prompts_from_jsonl(path: Path, tokenizer: Any, cfg: BlockdraftConfig, limit: int) -> list[list[int]]:
    """Prompt token ids from a JSONL file: one object per line with `input_ids`, `messages` (rendered with the target's
    chat template and a generation prompt) or `prompt` (raw text)."""
    return [_render_prompt(row, tokenizer, cfg, where) for where, row in jsonl_rows(path, path.name, limit)]


def _render_prompt(row: dict[str, Any], tokenizer: Any, cfg: BlockdraftConfig, where: str) -> list[int]:
    ids = _prompt_ids(row, tokenizer, cfg, where)
    if not ids:  # nothing to condition on: decoding would fail only after the models loaded
        raise EvalError(f"{where}: the prompt is empty (it renders to no tokens); give it text, or remove that row")
    return ids


def _prompt_ids(row: dict[str, Any], tokenizer: Any, cfg: BlockdraftConfig, where: str) -> list[int]:
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise EvalError(f"{where}: input_ids must be a non-empty list of integers")
        return ids
    if tokenizer is None:
        raise EvalError(f"{where}: text prompts need a tokenizer, and none loads from the target; give input_ids or "
                        "set target.tokenizer")
    if "messages" in row:
        kwargs = {}
        thinking = row.get("enable_thinking")
        if thinking is None and cfg.tokenize.thinking != "auto":
            thinking = cfg.tokenize.thinking == "on"
        if thinking is not None:
            kwargs["enable_thinking"] = bool(thinking)
        try:
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # a template raising on a malformed conversation is a bad prompt, not a bug here
            raise EvalError(f"{where}: the chat template rejects these messages ({exc}); fix the prompt") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(row.get("prompt"), str):
        return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    raise EvalError(f"{where}: a prompt row needs 'input_ids', 'messages' or 'prompt'")


# ---------------------------------------------------------------------------------------------------------------------
# The held-out rows of a tokenized artifact


def held_out_prompts(data: StageInput, limit: int, workdir: Path, every_split: bool = False) -> list[list[int]]:
    """Up to `limit` prompts from the held-out rows of a verified tokenized artifact: each row's ids before its first
    supervised token (a row supervised from token 0 has no prompt to condition on and is skipped). `every_split`: the
    artifact is held out whole (train.eval_data): its train split first, then the others, the order training decodes
    them.

    Files are fetched one at a time, in the dataset's row order, and only until `limit` prompts are found: each split's
    state.json, then its Arrow files, each checked against the manifest (`StageInput.fetch`); a local artifact is read
    where it is. Otherwise the train split is never read."""
    dest = workdir / "prompts"
    prompts: list[list[int]] = []
    rows = 0
    for path, split_column in _held_out_files(data, dest, every_split):
        for ids, mask in _arrow_rows(data.fetch([path], dest) / path, split_column):
            rows += 1
            supervised = np.flatnonzero(mask)
            if supervised.size and supervised[0]:
                prompts.append(ids[: supervised[0]].tolist())
            if len(prompts) >= limit:
                return prompts
    if rows == 0 and every_split:
        raise EvalError(f"tokenized artifact {data.store.url} holds no rows; tokenize conversations into it or pass "
                        "--prompts FILE")
    if rows == 0:
        raise EvalError(
            f"tokenized artifact {data.store.url} has no held-out rows; tokenize with tokenize.held_out_fraction > 0 "
            "or pass --prompts FILE"
        )
    return prompts


def _held_out_files(data: StageInput, dest: Path, every_split: bool) -> Iterator[tuple[str, bool]]:
    """(Arrow file, whether its `split` column picks the held-out rows) in row order, from a `datasets.save_to_disk`
    layout: the manifest lists the folders, each folder's state.json orders its files (fetched only when reached).

    A DatasetDict (what tokenize writes) has one folder per split: every split but `train` is held out, and only those
    folders are read (all of them, `train` first, with `every_split`). Without split folders, one dataset at the root,
    whose `split` column says which rows are held out (every row is, with `every_split`).
    """
    paths = {e.path for e in data.manifest.files}
    splits = {p.split("/", 1)[0] for p in paths if p.count("/") == 1 and p.endswith(f"/{STATE_FILE}")}
    folders = sorted(splits - {TRAIN_SPLIT})
    if every_split and TRAIN_SPLIT in splits:
        folders.insert(0, TRAIN_SPLIT)
    if not folders and STATE_FILE not in paths:
        return
    for folder in [f"{f}/" for f in folders] or [""]:
        state_path = f"{folder}{STATE_FILE}"
        try:
            state = json.loads((data.fetch([state_path], dest) / state_path).read_bytes())
            names = [f"{folder}{item['filename']}" for item in state["_data_files"]]
        except (ValueError, KeyError, TypeError):
            raise EvalError(f"{data.store.url.rstrip('/')}/{state_path} does not list its Arrow files; regenerate the "
                            "tokenized artifact") from None
        for name in names:
            yield name, not folder and not every_split


def _arrow_rows(path: Path, split_column: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) of each row of one Arrow stream file, batch by batch from a memory map (nothing is loaded
    whole); with `split_column`, only the rows whose `split` is not train (none when there is no such column)."""
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        names = reader.schema.names
        if "input_ids" not in names or "loss_mask" not in names:
            raise EvalError(f"{path.name} has no input_ids and loss_mask columns; pass a tokenized artifact made by "
                            "tokenize")
        if split_column and "split" not in names:
            return
        for batch in reader:
            ids, mask = batch.column("input_ids"), batch.column("loss_mask")
            split = batch.column("split").to_pylist() if split_column else None
            for i in range(batch.num_rows):
                if split is None or split[i] != TRAIN_SPLIT:
                    yield ids[i].values.to_numpy(zero_copy_only=False), mask[i].values.to_numpy(zero_copy_only=False)


__all__ = [
    "AUTO_LAYOUT", "HELD_OUT_LAYOUT", "EvalPrompts", "EvalSet", "held_out_prompts", "load_target_tokenizer",
    "prompts_from_jsonl", "read_eval_prompts", "stop_token_ids",
]
