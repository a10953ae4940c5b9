"""The added tokens of a Hugging Face tokenizer folder (`<|im_end|>`, `<think>`, ...), read from its JSON files alone, and
the rule they set for `dflash.mask_token_id`: the mask must be an id the tokenizer never emits. Checked when the config
loads (`config.py`) and again for the tokenizer tokenize actually uses (`data/tokenizer.py`).
"""

from __future__ import annotations

import json
from pathlib import Path


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
