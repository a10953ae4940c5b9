"""The shards of a completions artifact: writing each one as a finished piece, and finding the ones a rerun keeps.

A shard is `shards/part-NNNNN.jsonl.zst`, one completed conversation per line; once it verified at the destination it is
recorded as piece `part-NNNNN` (`StageOutput.put_piece`) with the ids it holds and its row stats as counts. A rerun
keeps exactly the pieces recorded for its piece key whose files still verify, so it knows which prompts are done
without reading a shard back; a shard with no finished piece (a torn upload, a run killed between the upload and its
piece) is deleted and its prompts are redone.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from blockdraft.data.chat import Completion, Prompt
from blockdraft.store.artifact import FileEntry, Manifest, entry_for_local_file
from blockdraft.store.output import StageOutput

SHARDS_DIR = "shards"
_SHARD_KEY = re.compile(rf"^{SHARDS_DIR}/(part-(\d+))\.jsonl\.zst$")
PIECE_CHECK_WORKERS = 8  # each piece check is a round trip per file (an S3 HEAD), so they run side by side


def completion_row(prompt: Prompt, done: Completion, settings: dict[str, Any]) -> dict[str, Any]:
    """One output line: the prompt's messages plus the generated assistant turn, its thinking mode, the settings it was
    generated with (`settings_used`) and, when the engine knows them, the exact token ids (what `tokenize` then uses as
    they are)."""
    thinking = {True: "on", False: "off", None: "default"}[prompt.enable_thinking]
    row: dict[str, Any] = {
        "id": prompt.id,
        "messages": prompt.messages + [assistant_turn(done)],
        "thinking": thinking,
        "settings": settings,
        "finish_reason": done.finish_reason,
    }
    if prompt.group is not None:
        row["group"] = prompt.group
    if prompt.tools:
        row["tools"] = prompt.tools  # tokenize renders them, as the target saw them
    if done.prompt_token_ids and done.completion_token_ids:
        row["prompt_token_ids"] = done.prompt_token_ids
        row["completion_token_ids"] = done.completion_token_ids
    return row


def assistant_turn(done: Completion) -> dict[str, Any]:
    """The target's answer as an assistant message (with its tool calls, in OpenAI form, when it made any)."""
    turn = {"role": "assistant", "content": done.content, "reasoning_content": done.reasoning_content}
    return turn | ({"tool_calls": done.tool_calls} if done.tool_calls else {})


def row_stats(row: dict[str, Any]) -> list[str]:
    """What the manifest counts per row: its thinking mode, why it ended, whether it carries token ids, and each
    setting it was generated with (`setting_counts` reads those back)."""
    stats = [f"thinking_{row.get('thinking', 'default')}", f"finish_{row.get('finish_reason', 'stop')}"]
    stats += [f"{SETTING_PREFIX}{key}={_bucket(key, value)}" for key, value in row.get("settings", {}).items()]
    return stats + (["with_token_ids"] if "completion_token_ids" in row else [])


SETTING_PREFIX = "setting_"


def _bucket(key: str, value: Any) -> str:
    """A setting's value as counted: sampling values to two decimals, lengths by the power of two they reach, so a
    set whose rows each carry their own length or temperature counts a few dozen values, not one per row."""
    if key == "max_new_tokens" and isinstance(value, int):
        return f"<={1 << max(0, value - 1).bit_length()}"
    if isinstance(value, float):
        return f"{round(value, 2):g}"
    return str(value)[:40]


def setting_counts(stats: dict[str, int]) -> dict[str, int]:
    """{"temperature=0.7": rows, ...}: how many rows were generated with each setting, from row stats' counts."""
    return {key.removeprefix(SETTING_PREFIX): n for key, n in sorted(stats.items()) if key.startswith(SETTING_PREFIX)}


def shard_name(index: int) -> str:
    return f"part-{index:05d}"


class ShardWriter:
    """Completed rows -> a shard at the destination every `rows_per_shard` rows, each recorded as a piece for
    `piece_key`.

    `entries`, `ids` and `stats` sum up what this writer put there.
    """

    def __init__(self, out: StageOutput, piece_key: str, first_index: int, rows_per_shard: int, staging: Path) -> None:
        self.out = out
        self.piece_key = piece_key
        self.index = first_index
        self.rows_per_shard = rows_per_shard
        self.staging = staging
        self.entries: list[FileEntry] = []
        self.ids: list[str] = []
        self.stats: Counter[str] = Counter()
        self._rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        """Upload the rows held as the next shard, then record its piece (after the upload verified)."""
        if not self._rows:
            return
        name = shard_name(self.index)
        local = self.staging / SHARDS_DIR / f"{name}.jsonl.zst"
        local.parent.mkdir(parents=True, exist_ok=True)
        lines = b"".join(json.dumps(row, ensure_ascii=False).encode() + b"\n" for row in self._rows)
        local.write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
        entry = entry_for_local_file(self.staging, local)
        self.out.store.put_file(entry.path, local, entry.checksum)
        local.unlink()
        ids = [row["id"] for row in self._rows]
        stats = Counter(stat for row in self._rows for stat in row_stats(row))
        self.out.put_piece(name, self.piece_key, [entry], counts={"ids": ids, "rows_by": dict(sorted(stats.items()))})
        self.entries.append(entry)
        self.ids += ids
        self.stats += stats
        self.index += 1
        self._rows = []


@dataclass
class HeldShards:
    """What the destination already holds for one piece key, from the piece sub-manifests alone (no shard is read).

    `entries`/`ids`/`stats`: the files, prompt ids and row stats of the finished pieces; `other_key`: names of pieces
    recorded for another piece key (completions made with other settings); `unfinished`: shard keys with no finished
    piece, and `stale`: pieces of this key whose files no longer verify; both are removed before new shards are written.
    """

    entries: list[FileEntry] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    stats: Counter[str] = field(default_factory=Counter)
    next_index: int = 0
    other_key: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    def clear_unfinished(self, out: StageOutput) -> None:
        """Drop stale pieces first, then delete shards with no finished piece, so no piece ever names a deleted file."""
        for name in self.stale:
            out.drop_piece(name)
        for key in self.unfinished:
            out.store.delete(key)


def held_shards(out: StageOutput, piece_key: str) -> HeldShards:
    """The shards at the destination that a rerun with `piece_key` keeps, and the ones it must refuse or remove."""
    held = HeldShards()
    ours, held.other_key = out.piece_names(piece_key)
    with ThreadPoolExecutor(PIECE_CHECK_WORKERS) as pool:
        finished: list[Manifest | None] = list(pool.map(lambda name: out.finished_piece(name, piece_key), ours))
    kept: set[str] = set()
    for name, piece in zip(ours, finished, strict=True):
        if piece is None:
            held.stale.append(name)
            continue
        held.entries += piece.files
        held.ids.update(piece.counts.get("ids", []))
        held.stats.update(piece.counts.get("rows_by", {}))
        kept.update(entry.path for entry in piece.files)
    for info in out.store.list(f"{SHARDS_DIR}/"):
        match = _SHARD_KEY.match(info.key)
        if match is None:
            continue
        if info.key in kept:
            held.next_index = max(held.next_index, int(match.group(2)) + 1)
        else:
            held.unfinished.append(info.key)
    return held
