"""The generate stage's chat types, shared with the fixtures that write sample answers: a `Prompt` is normalised chat
messages; a `Completion` is the answer split into reasoning and content the way Qwen3 reasoning parsers split it, with
the exact token ids when they are known. `render_prompt` is a prompt as the target's chat template writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Prompt:
    """One prompt: normalised messages ending with a user (or tool) turn; `enable_thinking` None = the template's
    default."""

    id: str
    messages: list[dict[str, Any]]
    enable_thinking: bool | None = None


@dataclass
class Completion:
    """The target's answer. Token ids, when known, are the exact prompt and completion (end-of-turn token included when
    it stopped)."""

    id: str
    content: str
    reasoning_content: str
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning_content, content) of generated assistant text, split at `</think>` the way Qwen3 reasoning parsers do.

    Handles both template families: the model emits `<think>` itself (Qwen3 hybrid) or the prompt already ends with it
    (Qwen3.5/3.6), so the text starts inside the reasoning.
    """
    if "</think>" not in text:
        return "", text.strip()
    head, _, tail = text.partition("</think>")
    return head.replace("<think>", "", 1).strip("\n"), tail.lstrip("\n")


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    kwargs = {} if prompt.enable_thinking is None else {"enable_thinking": prompt.enable_thinking}
    return tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True, **kwargs)


__all__ = ["Completion", "Prompt", "render_prompt", "split_reasoning"]
