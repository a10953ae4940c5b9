"""The rule for `dflash.mask_token_id`, the id a drafter fills its masked block slots with: a row of the target's
embedding (below its config's vocab_size) that the training data never holds and that is none of the tokenizer's added
tokens.

Such an id reaches the drafter only as the mask, so a masked slot is never confused with a real token; the serving
engines read it from the export's `dflash_config` and need nothing else (no added embedding row). A target whose
embedding has spare rows past the tokenizer's last id (Qwen3's 151669..151935) has ids no text encodes to; one whose
every row is a token (Llama-family SmolLM2: vocab_size = len(tokenizer)) takes an ordinary token its data never uses.

Added tokens (`<|im_end|>`, `<think>`, ...) are refused even when the data does not hold them: they are the control
tokens the chat template and the tokenizer emit on paths the data may not cover (tools, system prompts, the other
thinking mode), and there is always a plain id to take instead. Checked when the config loads (`config.py`) and for the
tokenizer tokenize uses (`data/tokenizer.py`). That the data never holds the id is checked against the ids tokenize
records (`data/seen_ids.py`, which also names a fitting id): by tokenize once its artifact is committed, and by train
before any row is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Reserved embedding rows that no text encodes to, by the target's text model_type and vocabulary size: the first row
# after Qwen3's added tokens (151643..151668), and the mask of the drafters published for Qwen3.5/3.6.
KNOWN_MASK_TOKEN_IDS: dict[tuple[str, int], int] = {
    ("qwen3", 151936): 151669,
    ("qwen3_moe", 151936): 151669,
    ("qwen3_5_text", 248320): 248070,
}
HOW_TO_CHOOSE = ("set dflash.mask_token_id to an id the tokenized rows never hold: a row of the target's embedding "
                 "(below its config's vocab_size) that is none of the tokenizer's added tokens, best the first row "
                 "past the tokenizer's last id when the embedding has spare rows, else an ordinary token the data "
                 "never uses (tokenize and train name one)")


def known_mask_token_id(text_config: dict[str, Any]) -> int | None:
    """The reserved mask id for a target whose (text) config.json fields are `text_config`, when the family is known."""
    return KNOWN_MASK_TOKEN_IDS.get((str(text_config.get("model_type")), int(text_config.get("vocab_size") or -1)))


def local_text_config(folder: str | None) -> dict[str, Any]:
    """The text model's fields of a local target folder's config.json (a multimodal one's `text_config`); {} when there
    is no such file here (a hub id, say)."""
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


def tokenizer_json_length(tokenizer_json: str) -> int:
    """The ids a tokenizer.json defines: one past its highest, of its model's vocabulary and its added tokens (0:
    none)."""
    data = json.loads(tokenizer_json)
    vocab = (data.get("model") or {}).get("vocab") or {}
    # Unigram: a list of (piece, score)
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def tokenizer_length(folder: Path) -> int | None:
    """The ids a Hugging Face tokenizer folder defines (`len(tokenizer)`), read from its tokenizer.json, else its
    vocab.json and added tokens; None when neither is there."""
    try:
        return tokenizer_json_length((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    try:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        return max([*vocab.values(), *tokenizer_added_tokens(folder)], default=-1) + 1
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def spare_row(tokenizer_ids: int | None, vocab_size: int | None) -> int | None:
    """The first row of the embedding past the tokenizer's last id, when the embedding has one: no text encodes to
    it."""
    return (
        tokenizer_ids if tokenizer_ids is not None and vocab_size is not None and tokenizer_ids < vocab_size else None
    )


def folder_spare_row(tokenizer_folder: Path, target_path: str | None) -> int | None:
    """`spare_row` of a local tokenizer folder and target folder (None when either is not here)."""
    vocab_size = local_text_config(target_path).get("vocab_size")
    return spare_row(tokenizer_length(tokenizer_folder), vocab_size if isinstance(vocab_size, int) else None)


def mask_token_problem(mask_token_id: int | None, added: dict[int, str], example: int | None = None) -> str | None:
    """Why `mask_token_id` cannot be the drafter's mask token given the tokenizer's added tokens, or None. `example`: an
    id to name as a fit (a spare row), when known."""
    if mask_token_id is None or mask_token_id not in added:
        return None
    return (f"dflash.mask_token_id {mask_token_id} is the tokenizer's added token {added[mask_token_id]}, a control "
            "token its chat template and tokenizer emit: the drafter could not tell a masked slot from it; "
            f"{HOW_TO_CHOOSE}"
            + (f" (here: {example}, the first row past the tokenizer's last id)" if example is not None else ""))
