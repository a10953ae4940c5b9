"""The tokenizer and chat template a run renders with, resolved from the config's [target] section.

tokenize renders rows with it and eval compares its template hash with the one a checkpoint pinned.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from blockdraft.added_tokens import mask_token_problem, spare_row, tokenizer_json_length
from blockdraft.config import TargetConfig
from blockdraft.data.render import ChatTemplate, compile_chat_template
from blockdraft.errors import ConfigError


@dataclass(frozen=True)
class TokenizerSource:
    """The tokenizer and chat template a run uses, resolved from the [target] section; `target_template_sha256` is the
    tokenizer's own template's (None when it has none)."""

    tokenizer_json: str
    tokenizer_sha256: str
    vocab_size: int
    template: ChatTemplate  # compiled with the tokenizer's special tokens as variables
    template_source: str
    target_template_sha256: str | None


@functools.lru_cache(maxsize=8)
def read_tokenizer_folder(path: str) -> tuple[str, int, str | None, dict[str, str]]:
    """(tokenizer JSON, vocabulary size, its own chat template, its special tokens by name) of a tokenizer folder.

    Cached per process: loading converts vocab/merges when the folder has no tokenizer.json (seconds).
    """
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer folder {path} does not exist; set target.path/target.tokenizer or pass "
                          "--tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path} ({type(exc).__name__}); point --tokenizer at a Hugging "
                          "Face tokenizer folder") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"the tokenizer in {path} has no fast (Rust) version; offsets need one, give a folder with "
                          "tokenizer.json")
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    special = {name: str(value) for name, value in tok.special_tokens_map.items() if isinstance(value, str)}
    return tok.backend_tokenizer.to_str(), len(tok), template, special


def _read_template_file(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"chat template file {p} does not exist; pass a Jinja file with --chat-template or fix "
                          "target.chat_template")
    return p.read_text()


def resolve_tokenizer(target: TargetConfig) -> tuple[TokenizerSource, list[str]]:
    """The tokenizer and template of this run from the [target] section (`tokenize --tokenizer/--chat-template` spell
    target.tokenizer/target.chat_template): target.tokenizer, else target.path; target.chat_template, else that
    tokenizer's own template. Also the warnings to show loudly: a template that is not the tokenizer's own (the target
    must then be served with it too), or a tokenizer with no template of its own to compare with."""
    tok_path = target.tokenizer or target.path
    if not tok_path:
        raise ConfigError("no tokenizer: set target.path (or target.tokenizer) in the config, or pass --tokenizer DIR")
    tokenizer_json, vocab_size, own_template, special_tokens = read_tokenizer_folder(str(tok_path))
    if target.chat_template:
        text, source = _read_template_file(target.chat_template), f"file {Path(target.chat_template).name}"
    elif own_template is not None:
        text, source = own_template, "target"  # the target tokenizer's own template
    else:
        raise ConfigError(f"the tokenizer in {tok_path} has no chat template; pass one with --chat-template FILE")
    template = compile_chat_template(text, special_tokens)
    own_sha = hashlib.sha256(own_template.encode()).hexdigest() if own_template is not None else None
    warnings = []
    if own_sha is None:
        warnings.append(f"the tokenizer in {tok_path} has no chat template of its own to compare with: rows use the "
                        f"template from {source}")
    elif own_sha != template.sha256:
        warnings.append(
            f"the chat template ({source}, sha256 {template.sha256[:12]}) differs from the target tokenizer's own "
            f"(sha256 {own_sha[:12]}): serve the target with this template, or a drafter trained on these rows learns "
            "another prompt format than the target serves"
        )
    src = TokenizerSource(
        tokenizer_json=tokenizer_json,
        tokenizer_sha256=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        vocab_size=vocab_size,
        template=template,
        template_source=source,
        target_template_sha256=own_sha,
    )
    return src, warnings


@functools.lru_cache(maxsize=8)
def end_of_turn_id(tokenizer_json: str, token: str) -> int:
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_str(tokenizer_json).token_to_id(token)
    if token_id is None:
        raise ConfigError(f"end-of-turn token {token!r} is not in the tokenizer's vocabulary; set tokenize.end_of_turn "
                          "to the one it uses")
    return token_id


def special_token_pattern(tokenizer_json: str, variables: dict[str, str] | None = None) -> re.Pattern[str] | None:
    """A regex of the tokenizer's special tokens (added tokens marked special: `<|im_start|>`, `<|im_end|>`,
    `<|endoftext|>`, ...) and of the special tokens the template gets as variables; None when there are none.

    Text holding one of them is encoded as the control token itself, so message content must not
    (`check_special_tokens`).
    """
    added = json.loads(tokenizer_json).get("added_tokens") or []
    tokens = {t["content"] for t in added if t.get("special") and t.get("content")}
    tokens.update(v for v in (variables or {}).values() if v)
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def check_mask_token(mask_token_id: int | None, tokenizer_json: str, vocab_size: int | None = None) -> None:
    """ConfigError when `mask_token_id` is one of this tokenizer's added tokens (`mask_token_problem`); `vocab_size`:
    the target's embedding rows, when known, to name its first spare row as a fit."""
    if mask_token_id is None:
        return
    added = {int(t["id"]): str(t.get("content")) for t in json.loads(tokenizer_json).get("added_tokens") or []}
    if mask_token_id in added:
        raise ConfigError(str(mask_token_problem(mask_token_id, added,
                                                 spare_row(tokenizer_json_length(tokenizer_json), vocab_size))))
