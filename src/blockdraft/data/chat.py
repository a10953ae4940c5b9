"""The generate stage's chat types, shared with the fixtures that write sample answers: a `Prompt` is normalised chat
messages; a `Completion` is the answer split into reasoning and content the way Qwen3 reasoning parsers split it, with
the exact token ids when they are known. `render_prompt` is a prompt as the target's chat template writes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What a prompt row may set for itself, over the [generate] section: sampling, the answer's length, and the chat
# template's reasoning effort (passed to the template as `reasoning_effort`, the name templates that have it use).
ROW_SETTINGS = ("temperature", "top_p", "max_new_tokens", "reasoning_effort")


@dataclass
class Prompt:
    """One prompt: normalised messages ending with a user (or tool) turn; `enable_thinking` None = the template's
    default; `settings` the row's own values of `ROW_SETTINGS` (those it sets), which override the config's; `group`
    the row's group, kept in its completion (tokenize holds a group out together)."""

    id: str
    messages: list[dict[str, Any]]
    enable_thinking: bool | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    # generate.turns = "all": the indices in `messages` of the earlier assistant turns, regenerated in order before the
    # final one (each on the history the target wrote); empty: only the final turn is generated
    rewrite: list[int] = field(default_factory=list)
    tools: list[Any] | None = None  # the row's tool definitions (OpenAI form), which the chat template renders

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with beyond the messages: the thinking mode and the reasoning effort,
        where set (the same keys an OpenAI-compatible server takes as `chat_template_kwargs`)."""
        kwargs: dict[str, Any] = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        if "reasoning_effort" in self.settings:
            kwargs["reasoning_effort"] = self.settings["reasoning_effort"]
        return kwargs


@dataclass
class Completion:
    """The target's answer. Token ids, when known, are the exact prompt and completion (end-of-turn token included when
    it stopped); `tool_calls` the calls it made, in OpenAI form, as a server's tool parser returned them."""

    id: str
    content: str
    reasoning_content: str
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    tool_calls: list[Any] | None = None


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
    tools = {"tools": prompt.tools} if prompt.tools else {}
    return tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True, **tools,
                                         **prompt.template_kwargs())


__all__ = ["ROW_SETTINGS", "Completion", "Prompt", "render_prompt", "split_reasoning"]
