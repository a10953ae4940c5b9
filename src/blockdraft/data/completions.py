"""Reading completions: JSONL (plain, .gz, .zst), a JSON array, or Parquet, normalised to one internal form.

Accepted variants (docs/TOKENIZATION.md): `messages` or `conversations`; OpenAI `role`/`content` or ShareGPT
`from`/`value` (`human`/`gpt`); reasoning in `reasoning_content` (or `reasoning`) or inline as a leading
`<think>...</think>` in the content; optional `tools`; optional generator token ids (`prompt_token_ids` +
`completion_token_ids`, or `prompt_ids` + `completion_ids`), which are then used as they are.

A row that cannot be normalised raises `RowRejected` with a short reason code; the caller quarantines it. A file that
cannot be decoded whole raises `InputUnreadable` (`blockdraft.data.streams`); the caller drops the whole file.

Rows are read by `records.py`; a row larger than `tokenize.max_row_bytes` reaches `normalise` without its data, which
rejects it as `row_too_large`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockdraft.config import StoreConfig
from blockdraft.data.records import RawRecord
from blockdraft.errors import ConfigError
from blockdraft.store import Store, open_store
from blockdraft.store.inputs import StageInput, open_input, recorded_manifest

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")
# Columns that make a Parquet file one of conversations: one of these sets must all be there.

_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
_ID_KEYS = ("id", "source_id", "conversation_id", "uuid")
_IDS_KEYS = (("prompt_token_ids", "completion_token_ids"), ("prompt_ids", "completion_ids"))


class RowRejected(ValueError):
    """A row (or one assistant turn of it) that must not be trained; `reason` is the code counted in the manifest."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    """A normalised conversation.

    `messages`: dicts with `role` (system/user/assistant/tool) and `content` (str); assistant messages also carry
    `reasoning_content` (str, "" when none) and, when present, `tool_calls`; tool messages keep `name`/`tool_call_id`.
    `prompt_ids`/`completion_ids`: generator token ids, when the row carries them.
    """

    source_id: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    assistant_indices: list[int] = field(default_factory=list)


def is_completions_file(key: str) -> bool:
    return key.lower().endswith(SUFFIXES)


def source_id_of(record: RawRecord) -> str | None:
    """The row's conversation id; for a row without one, the hash of its text, so the split does not depend on file
    layout."""
    if not isinstance(record.data, dict):
        return None
    found = next((record.data[k] for k in _ID_KEYS if record.data.get(k) is not None), None)
    return str(found) if found is not None else "sha256:" + hashlib.sha256(record.text.encode()).hexdigest()[:32]


def group_text(value: object) -> str | None:
    """A row's `group` as text: a non-empty string or a whole number (rows that share it are held out together, e.g.
    several answers to one prompt); None when the row has none. Any other value is RowRejected("bad_group"): the one
    rule of generate's prompt rows and tokenize's completion rows."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise RowRejected("bad_group", f"group is {value!r}; give a non-empty string or a whole number (rows sharing "
                                       "it are held out together)")
    return str(value)


def group_of(record: RawRecord) -> str | None:
    """The `group` of a row (`group_text`), or None when it has none."""
    return group_text(record.data.get("group")) if isinstance(record.data, dict) else None


def _split_inline_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, content) from content that may start with `<think>...</think>`."""
    has_open, has_close = "<think>" in content, "</think>" in content
    if not has_open and not has_close:
        return "", content
    if has_close and not has_open:
        raise RowRejected("lone_think_close", "assistant content has </think> without <think>")
    if has_open and not has_close:
        raise RowRejected("unclosed_think", "assistant content has <think> without </think>")
    if content.count("<think>") != 1 or content.count("</think>") != 1:
        raise RowRejected("unclosed_think", "assistant content has more than one <think> block")
    before, rest = content.split("<think>", 1)
    reasoning, after = rest.split("</think>", 1)
    if before.strip() or "<think>" in after:
        raise RowRejected("unclosed_think", "the <think> block is not at the start of the assistant content")
    return reasoning.strip("\n"), after.lstrip("\n")


def normalise_message(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RowRejected("bad_message", f"a message is a {type(raw).__name__}, not an object")
    role_raw = raw.get("role", raw.get("from"))
    role = _ROLE_ALIASES.get(str(role_raw).lower()) if role_raw is not None else None
    if role is None:
        raise RowRejected("unknown_role", f"role {role_raw!r}")
    content = raw.get("content", raw.get("value"))
    tool_calls = raw.get("tool_calls") or None
    if content is None and (tool_calls or role == "assistant"):
        content = ""
    if not isinstance(content, str):
        raise RowRejected("non_string_content", f"{role} content is a {type(content).__name__}")
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise RowRejected("non_string_content", f"reasoning is a {type(reasoning).__name__}")
        if reasoning:
            if "<think>" in content or "</think>" in content:
                raise RowRejected("unclosed_think", "reasoning given both as a field and inline in the content")
            msg["reasoning_content"] = reasoning
        else:
            inline, visible = _split_inline_reasoning(content)
            msg["reasoning_content"], msg["content"] = inline, visible
        if tool_calls:
            msg["tool_calls"] = tool_calls
    elif role == "tool":
        for key in ("name", "tool_call_id"):
            if raw.get(key) is not None:
                msg[key] = raw[key]
    return msg


def _token_ids(data: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    for prompt_key, completion_key in _IDS_KEYS:
        if data.get(prompt_key) is not None and data.get(completion_key) is not None:
            prompt, completion = data[prompt_key], data[completion_key]
            # bool is an int to Python: true/false in an id list would train ids 1 and 0.
            ok = all(isinstance(x, list) and all(type(t) is int and t >= 0 for t in x) for x in (prompt, completion))
            if not ok or not prompt or len(completion) < 2:
                raise RowRejected("bad_token_ids", f"{prompt_key}/{completion_key} must be non-empty lists of "
                                                   "non-negative integer token ids (not true/false, floats or strings)")
            return list(prompt), list(completion)
    return None


def normalise(record: RawRecord) -> Conversation:
    """One raw row -> `Conversation`, or `RowRejected` naming why it cannot be trained."""
    data = record.data
    if record.oversize:
        raise RowRejected("row_too_large", f"the row is {record.oversize:,} bytes, more than tokenize.max_row_bytes; "
                          "raise tokenize.max_row_bytes to keep it")
    if data is None:
        raise RowRejected("bad_json", record.text[:120])
    if not isinstance(data, dict):
        raise RowRejected("bad_json", f"a row is a {type(data).__name__}, not an object")
    source_id = source_id_of(record)
    assert source_id is not None
    group_of(record)  # a bad group is refused here, where the row is quarantined, not when it is split
    ids = _token_ids(data)
    raw_messages = data.get("messages", data.get("conversations"))
    if raw_messages is None and ids is not None:
        return Conversation(source_id, [], prompt_ids=ids[0], completion_ids=ids[1])
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RowRejected("no_messages", "no 'messages' or 'conversations' list")
    messages = [normalise_message(m) for m in raw_messages]
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise RowRejected("system_not_first", f"system message at position {roles.index('system', 1)}")
    if "user" not in roles:
        raise RowRejected("no_user_turn")
    assistant = [i for i, r in enumerate(roles) if r == "assistant"]
    if not assistant:
        raise RowRejected("no_assistant_turn")
    tools = data.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise RowRejected("bad_message", "'tools' is not a list")
    conv = Conversation(source_id, messages, tools=tools, assistant_indices=assistant)
    if ids is not None:
        conv.prompt_ids, conv.completion_ids = ids
    return conv


def check_special_tokens(conv: Conversation, special: re.Pattern[str] | None) -> None:
    """`RowRejected("special_token_in_content")` when a message's text holds one of the tokenizer's special tokens.

    Rendered, `<|im_end|>\n<|im_start|>user` inside an assistant's content is a turn boundary the template did not make:
    the drafter would be trained across a fake turn, and the tokenizer encodes the text as the control token itself.
    """
    if special is None:
        return
    for i, message in enumerate(conv.messages):
        texts = {"content": message["content"], "reasoning_content": message.get("reasoning_content") or ""}
        if message.get("tool_calls"):
            texts["tool_calls"] = json.dumps(message["tool_calls"], ensure_ascii=False, default=str)
        for name, text in texts.items():
            found = special.search(text)
            if found is not None:
                raise RowRejected("special_token_in_content",
                                  f"message {i} ({message['role']}) has the special token {found.group()!r} in its "
                                  f"{name}")
    found = special.search(json.dumps(conv.tools, ensure_ascii=False, default=str)) if conv.tools else None
    if found is not None:
        raise RowRejected("special_token_in_content", f"the tools list has the special token {found.group()!r}")


def resolve_completions(input_url: str, store_config: StoreConfig | None) -> tuple[Store, list[str], StageInput | None]:
    """Where the completions at `input_url` are: (store, sorted keys, None) for a file or a folder of them, or (store,
    keys the artifact lists, the verified artifact) for a completions artifact; ConfigError when there are none."""
    store = open_store(input_url, store_config)
    local = store.local_path()
    if local is not None and local.is_file():
        return open_store(local.parent, store_config), [local.name], None
    if local is not None and not local.exists():
        raise ConfigError(f"input {input_url} does not exist; pass a completions file or folder")
    if local is not None and not local.is_dir():
        raise not_a_regular_file(local, local.stat())
    if recorded_manifest(store) is not None:
        artifact = open_input(store)
        keys = [f.path for f in artifact.manifest.files if is_completions_file(f.path)]
        if not keys:
            raise ConfigError(f"input artifact {input_url} lists no completions files ({', '.join(SUFFIXES)})")
        return store, keys, artifact
    keys = [info.key for info in store.list() if is_completions_file(info.key) and not info.key.startswith(".")]
    if not keys:
        raise ConfigError(f"input {input_url} has no completions files ({', '.join(SUFFIXES)}); point INPUT at a file "
                          "or folder of them")
    return store, sorted(keys), None


def not_a_regular_file(path: Path, st: os.stat_result) -> ConfigError:
    """The error for an input path that is no regular file (a FIFO, a device such as /dev/zero, a socket): reading one
    would wait forever or never end."""
    kinds = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
             stat.S_IFSOCK: "a socket"}
    kind = kinds.get(stat.S_IFMT(st.st_mode), "not a regular file")
    return ConfigError(f"input {path} is {kind}, not a regular file; pass completions files (or a folder of them) that "
                       "hold their rows")
