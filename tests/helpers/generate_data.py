"""Reading a completions artifact's rows back in tests, from its zstd-compressed JSON Lines shards."""

from __future__ import annotations

import json
from pathlib import Path

import zstandard

from blockdraft.stages.generate import SHARDS_DIR


def output_rows(out: Path) -> list[dict]:
    """Every row of the completions artifact in `out`, shard by shard."""
    rows = []
    for shard in sorted((out / SHARDS_DIR).glob("*.jsonl.zst")):
        text = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes()).decode()
        rows += [json.loads(x) for x in text.splitlines() if x.strip()]
    return rows
