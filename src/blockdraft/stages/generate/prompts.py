"""The prompts of a `generate` input: each row's messages without its final assistant turn, and the rows that are no
prompt.

The input is one object, a folder or prefix of completions files, or an artifact (`blockdraft.data.completions`); it is
pinned by content as lineage (raw objects by size and checksum or ETag, an artifact by its manifest's sha256).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from blockdraft.config import StoreConfig, is_s3_url
from blockdraft.data.chat import ROW_SETTINGS, Prompt
from blockdraft.data.completions import (
    RowRejected,
    group_text,
    is_completions_file,
    normalise_message,
    resolve_completions,
    source_id_of,
)
from blockdraft.data.records import iter_records
from blockdraft.errors import ConfigError
from blockdraft.store import Store
from blockdraft.store.artifact import InputRef, raw_input
from blockdraft.store.inputs import open_raw_input

# (key, size, checksum) of each input file, as listed
PromptFile = tuple[str, int, str]


@dataclass
class BadPrompt:
    """An input row that is no prompt: `id` when it had one, `source` as "file:row", `reason` the code counted."""

    id: str | None
    source: str
    reason: str
    detail: str


def list_prompt_files(input_url: str, store_config: StoreConfig) -> tuple[Store, list[PromptFile], list[InputRef]]:
    """(store, files, lineage) of the input: one object, a folder or prefix, or an artifact. Every raw file is pinned by
    its checksum (read whole when its store holds none and no ETag) or ETag, as lineage; raises ConfigError when absent.
    A single s3:// object is taken as it is (listing would list its parent).
    """
    if is_s3_url(input_url) and is_completions_file(input_url):
        raw = open_raw_input(input_url, store_config)
        info = raw.info
        return raw.store, [(info.key, info.size, info.checksum or f"etag:{info.etag}")], [raw.ref]
    store, keys, artifact = resolve_completions(input_url, store_config)
    if artifact is not None:
        listed = set(keys)
        return (
            store,
            [(f.path, f.size, f.checksum) for f in artifact.manifest.files if f.path in listed],
            [artifact.ref],
        )
    files, lineage = [], []
    # One round trip per object on S3 (a full read on a folder): in parallel.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(store.head, keys))
    for key, info in zip(keys, infos, strict=True):
        if info is None:
            raise ConfigError(f"input {input_url}/{key} disappeared while listing; retry when the input is complete")
        if info.checksum is None and info.etag is None:
            size, checksum = store.checksum_by_reading(key)
            info = type(info)(key=key, size=size, checksum=checksum, etag=info.etag)
        # An object uploaded without CRC64NVME is pinned by its ETag (recorded as lineage), not re-read whole.
        files.append((key, info.size, info.checksum or f"etag:{info.etag}"))
        lineage.append(raw_input(store, info))
    return store, files, lineage


def read_prompts(store: Store, files: list[PromptFile], thinking: str,
                 turns: str = "last") -> tuple[list[Prompt], list[BadPrompt]]:
    """Every prompt of the input files in order; rows that cannot be prompts (and repeated ids) as `BadPrompt`s. With
    `turns` "all", each prompt also names its earlier assistant turns to regenerate (`Prompt.rewrite`)."""
    prompts: list[Prompt] = []
    bad: list[BadPrompt] = []
    seen: set[str] = set()
    for key, _size, _checksum in files:
        with store.open_read(key) as stream:
            for record in iter_records(stream, key):
                source = f"{key}:{record.position}"
                source_id = source_id_of(record)
                if record.data is None or source_id is None:
                    bad.append(BadPrompt(None, source, "bad_json", record.text[:120]))
                    continue
                if source_id in seen:
                    bad.append(BadPrompt(source_id, source, "duplicate_id", "an earlier row has the same id"))
                    continue
                try:
                    prompt = _prompt_from_row(record.data, source_id, thinking, turns)
                except RowRejected as exc:
                    bad.append(BadPrompt(source_id, source, exc.reason, exc.detail))
                    continue
                seen.add(source_id)
                prompts.append(prompt)
    return prompts, bad


def _prompt_from_row(data: Any, source_id: str, thinking: str, turns: str = "last") -> Prompt:
    """The row's prompt: messages without the final assistant turn, and the row's own settings (`row_settings`); with
    `turns` "all", the indices of its other assistant turns too (`Prompt.rewrite`).

    Thinking: the row's own boolean `enable_thinking` if it has one (a row's setting overrides the config's); else
    `on`/`off` from the config; on `auto`, on when the dropped turn had reasoning and off when it had none, else (a bare
    prompt) the chat template's default.
    """
    if not isinstance(data, dict):
        raise RowRejected("bad_json", f"a row is a {type(data).__name__}, not an object")
    raw = data.get("messages", data.get("conversations"))
    if raw is None and isinstance(data.get("prompt"), str):
        raw = [{"role": "user", "content": data["prompt"]}]
    if not isinstance(raw, list) or not raw:
        raise RowRejected("no_messages", "no 'messages', 'conversations' or 'prompt'")
    messages = [normalise_message(m) for m in raw]
    dropped = messages.pop() if messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise RowRejected("no_user_turn", "nothing to answer: the prompt does not end with a user or tool turn")
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise RowRejected("system_not_first", f"system message at position {roles.index('system', 1)}")
    own = data.get("enable_thinking")
    if own is not None and not isinstance(own, bool):
        raise RowRejected("bad_setting", f"enable_thinking is {own!r}; give true or false")
    if own is not None:
        enable: bool | None = own
    elif thinking == "on":
        enable = True
    elif thinking == "off":
        enable = False
    else:
        enable = bool(dropped.get("reasoning_content")) if dropped is not None else None
    group = group_text(data.get("group"))
    # an assistant turn answers the user or tool turn before it; one that answers nothing (a greeting that opens the
    # conversation, a second turn in a row) is kept as given
    rewrite = [i for i, m in enumerate(messages)
               if turns == "all" and m["role"] == "assistant" and i and messages[i - 1]["role"] in ("user", "tool")]
    tools = data.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RowRejected("bad_message", "'tools' is not a list of tool definitions; give a list of objects in "
                                         "OpenAI form ({\"type\": \"function\", \"function\": {...}})")
    return Prompt(source_id, messages, enable, row_settings(data), group, rewrite, tools)


def row_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The `ROW_SETTINGS` a row sets for itself, checked; RowRejected("bad_setting") naming the first bad one. A key
    given as null is unset (the config's value holds)."""
    found = {key: data[key] for key in ROW_SETTINGS if data.get(key) is not None}
    for key, value in found.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "temperature" and not (number and 0 <= value <= 100):
            raise RowRejected("bad_setting", f"temperature is {value!r}; give a number from 0 (greedy) to 100")
        if key == "top_p" and not (number and 0 < value <= 1):
            raise RowRejected("bad_setting", f"top_p is {value!r}; give a number in (0, 1]")
        if key == "max_new_tokens" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise RowRejected("bad_setting", f"max_new_tokens is {value!r}; give a whole number >= 1")
        if key == "reasoning_effort" and not (isinstance(value, str) and value.strip()):
            raise RowRejected("bad_setting", f"reasoning_effort is {value!r}; give the chat template's word for it "
                                             "(e.g. low, medium, high)")
    return {key: float(v) if key in ("temperature", "top_p") else v for key, v in found.items()}
