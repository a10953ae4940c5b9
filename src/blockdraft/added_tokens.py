"""The added tokens of a Hugging Face tokenizer folder (`<|im_end|>`, `<think>`, ...), read from its JSON files alone, and
the rule they set for `dflash.mask_token_id`: the mask must be an id the tokenizer never emits. Checked when the config
loads (`config.py`) and again for the tokenizer tokenize actually uses (`data/tokenizer.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Reserved embedding rows that no text encodes to, by the target's text model_type and vocabulary size: the first row after
# Qwen3's added tokens (151643..151668), and the mask of the drafters published for Qwen3.5/3.6.
KNOWN_MASK_TOKEN_IDS: dict[tuple[str, int], int] = {
    ("qwen3", 151936): 151669,
    ("qwen3_moe", 151936): 151669,
    ("qwen3_5_text", 248320): 248070,
}
HOW_TO_CHOOSE = ("set dflash.mask_token_id to a reserved id: a row of the target's embedding (below its vocab_size) that is none "
                 "of the tokenizer's added tokens, e.g. the first id after the tokenizer's last (Qwen3: 151669, Qwen3.5/3.6: 248070)")


def known_mask_token_id(text_config: dict[str, Any]) -> int | None:
    """The reserved mask id for a target whose (text) config.json fields are `text_config`, when the family is known."""
    return KNOWN_MASK_TOKEN_IDS.get((str(text_config.get("model_type")), int(text_config.get("vocab_size") or -1)))


def local_text_config(folder: str | None) -> dict[str, Any]:
    """The text model's fields of a local target folder's config.json (a multimodal one's `text_config`); {} when there is
    no such file here (a hub id, say)."""
    try:
        data = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")) if folder else {}
    except (OSError, ValueError):
        return {}
    return data.get("text_config") or data if isinstance(data, dict) else {}


def tokenizer_added_tokens(folder: Path) -> dict[int, str]:
    """The added tokens (`<|im_end|>`, `<think>`, ...) a Hugging Face tokenizer folder defines, by id, read from its
    tokenizer_config.json (`added_tokens_decoder`) or tokenizer.json (`added_tokens`); {} when it names none."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        decoder = config.get("added_tokens_decoder") or {}
        if decoder:
            return {int(i): str(t.get("content")) for i, t in decoder.items()}
    except (OSError, ValueError, AttributeError):
        pass
    try:
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens") or []
        return {int(t["id"]): str(t.get("content")) for t in added}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}


def mask_token_problem(mask_token_id: int | None, added: dict[int, str]) -> str | None:
    """Why `mask_token_id` cannot be the drafter's mask token given the tokenizer's added tokens, or None."""
    if mask_token_id is None or mask_token_id not in added:
        return None
    return (f"dflash.mask_token_id {mask_token_id} is the tokenizer's token {added[mask_token_id]}, which it emits in the data: "
            "the drafter could not tell a masked slot from it; set it to a reserved id the tokenizer never emits (Qwen3: 151669)")
