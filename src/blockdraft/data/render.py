"""One assistant turn -> one training row, with the loss mask exactly as in docs/TOKENIZATION.md.

For assistant turn j: `prompt = render(history, add_generation_prompt=True)`, `full = render(history + [turn j])`,
both with the target's own template and the turn's thinking mode. `full` must start with `prompt`; `full` is
encoded once with offsets; tokens starting at or after `len(prompt)` are supervised up to and including the last
end-of-turn token; a token straddling `len(prompt)` is a boundary merge. No per-family rules: the boundary comes
from the template itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from blockdraft.data.completions import Conversation

ThinkingMode = Literal["auto", "on", "off"]


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (training templates mark assistant spans with it): render the body as
    is.

    The mask here comes from the render boundary, not from these markers, so the tag only has to be accepted.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Same spelling as Hugging Face chat templating (non-ASCII kept), so rendered prompts match what servers send.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Values a template receives from a conversation. For an object of exactly one of these types, whether an attribute is
# safe to read depends only on the type and the attribute's name (jinja2's checks look at nothing else for them).
_PLAIN_TYPES = frozenset({str, int, float, bool, type(None), list, dict, tuple})


class _Sandbox(ImmutableSandboxedEnvironment):
    """Hugging Face's sandbox, with its verdict on each (plain type, attribute) pair computed once and remembered: the
    checks ran on every `.strip`, `.split` or `.role` a template reads (about ten per render), a tenth of rendering."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in _PLAIN_TYPES:
            return super().is_safe_attribute(obj, attr, value)
        verdict = self._verdicts.get((kind, attr))
        if verdict is None:
            verdict = self._verdicts[kind, attr] = super().is_safe_attribute(obj, attr, value)
        return verdict


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. `sha256` is of the template text, recorded in the manifest; `variables` are the
    tokenizer's special tokens (`bos_token`, `eos_token`, ...), which templates may use, as Hugging Face passes them."""

    text: str
    sha256: str
    variables: dict[str, str]
    _template: jinja2.Template

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool,
               enable_thinking: bool) -> str:
        return self._template.render(
            **self.variables, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking
        )


def compile_chat_template(text: str, variables: dict[str, str] | None = None) -> ChatTemplate:
    """Compile Jinja chat-template text with the environment Hugging Face tokenizers use (trim/lstrip blocks,
    sandboxed)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return ChatTemplate(text=text, sha256=hashlib.sha256(text.encode()).hexdigest(), variables=dict(variables or {}),
                        _template=env.from_string(text))


@dataclass
class PlannedTurn:
    """A rendered assistant turn waiting to be encoded: `full[len(prompt):]` is what the model emits."""

    turn: int
    thinking: bool
    prompt: str
    full: str


@dataclass
class TurnRow:
    """One training row. `input_ids` int32 [T], `loss_mask` uint8 [T] (1 = supervised). A row clipped to `max_length`
    keeps what it lost: `clipped_tokens` cut off its end, `clipped_supervised` of them supervised (0 and 0 when
    whole)."""

    turn: int
    thinking: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    clipped_tokens: int = 0
    clipped_supervised: int = 0


@dataclass
class TurnRejection:
    turn: int | None
    reason: str
    detail: str


def _thinking_for(message: dict[str, Any], mode: ThinkingMode) -> bool:
    if mode == "auto":
        return bool(message.get("reasoning_content"))
    return mode == "on"


def plan_turns(conv: Conversation, template: ChatTemplate, mode: ThinkingMode) -> list[PlannedTurn | TurnRejection]:
    """Render every assistant turn of `conv` (history passed as it is); text-level checks only, no tokenizer.

    Rejections: `template_error`, `render_not_prefix`, `template_dropped_reasoning`, `template_dropped_content`.
    """
    out: list[PlannedTurn | TurnRejection] = []
    for turn, j in enumerate(conv.assistant_indices):
        message = conv.messages[j]
        thinking = _thinking_for(message, mode)
        try:
            prompt = template.render(conv.messages[:j], conv.tools, add_generation_prompt=True,
                                     enable_thinking=thinking)
            full = template.render(conv.messages[: j + 1], conv.tools, add_generation_prompt=False,
                                   enable_thinking=thinking)
        except Exception as exc:  # any template failure on one row is that row's problem, never the run's
            out.append(TurnRejection(turn, "template_error", f"{type(exc).__name__}: {exc}"[:200]))
            continue
        if not full.startswith(prompt):
            out.append(TurnRejection(turn, "render_not_prefix", _first_difference(prompt, full)))
            continue
        emitted = full[len(prompt) :]
        reasoning = message.get("reasoning_content", "").strip()
        if thinking and reasoning and reasoning not in emitted:
            out.append(TurnRejection(turn, "template_dropped_reasoning",
                                     "the rendered turn lacks its reasoning_content"))
            continue
        content = message["content"].strip()
        if content and content not in emitted:
            out.append(TurnRejection(turn, "template_dropped_content", "the rendered turn lacks its content"))
            continue
        out.append(PlannedTurn(turn, thinking, prompt, full))
    return out


def _first_difference(prompt: str, full: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    return f"full render differs from the prompt at char {i}: prompt {prompt[i:i + 30]!r} vs full {full[i:i + 30]!r}"


def _has_adjacent_pair(mask: np.ndarray) -> bool:
    return bool(np.any(mask[1:] & mask[:-1]))


def mask_turn(planned: PlannedTurn, encoding: Any, eot_id: int, max_length: int) -> TurnRow | TurnRejection:
    """Build the row from `encoding` (a `tokenizers.Encoding` of `planned.full`, no special tokens added).

    Rejections: `boundary_merge`, `no_end_of_turn`, `empty_turn`, `too_long` (fewer than 2 adjacent supervised tokens
    left after clipping).
    """
    boundary = len(planned.prompt)
    first = encoding.char_to_token(boundary)
    if first is None:
        return TurnRejection(planned.turn, "no_end_of_turn", "nothing rendered after the prompt")
    start, _ = encoding.token_to_chars(first)
    if start != boundary:
        token = planned.full[start : encoding.token_to_chars(first)[1]]
        return TurnRejection(planned.turn, "boundary_merge", f"token {token!r} spans the prompt/turn boundary at char "
                                                             f"{boundary}")
    ids = np.asarray(encoding.ids, dtype=np.int32)
    ends = np.flatnonzero(ids[first:] == eot_id)
    if ends.size == 0:
        return TurnRejection(planned.turn, "no_end_of_turn", f"no end-of-turn token (id {eot_id}) after the prompt")
    last = first + int(ends[-1])
    mask = np.zeros(ids.shape[0], dtype=np.uint8)
    mask[first : last + 1] = 1
    return _clip(planned.turn, "on" if planned.thinking else "off", ids, mask, max_length)


def _clip(turn: int, thinking: str, ids: np.ndarray, mask: np.ndarray, max_length: int) -> TurnRow | TurnRejection:
    """Clip to `max_length` after masking, recording what was cut off; a row needs 2 adjacent supervised tokens (one
    prediction to train)."""
    if not _has_adjacent_pair(mask):
        return TurnRejection(turn, "empty_turn", "fewer than 2 supervised tokens: the turn emits nothing but its end")
    total = int(ids.shape[0])
    if total <= max_length:
        return TurnRow(turn, thinking, ids, mask)
    if not _has_adjacent_pair(mask[:max_length]):
        return TurnRejection(turn, "too_long", f"{total} tokens > max_length {max_length} leaves < 2 supervised tokens")
    dropped_supervised = int(mask[max_length:].sum())
    return TurnRow(turn, thinking, ids[:max_length], mask[:max_length], total - max_length, dropped_supervised)


def row_from_generator_ids(conv: Conversation, max_length: int, vocab_size: int) -> TurnRow | TurnRejection:
    """The row for a completion that carries its generator's token ids: mask 0 over the prompt, 1 over the
    completion."""
    assert conv.prompt_ids is not None and conv.completion_ids is not None
    turn = max(len(conv.assistant_indices) - 1, 0)
    ids = np.asarray(conv.prompt_ids + conv.completion_ids, dtype=np.int64)
    if int(ids.max()) >= vocab_size:
        return TurnRejection(turn, "bad_token_ids", f"token id {int(ids.max())} >= vocabulary size {vocab_size}")
    mask = np.zeros(ids.shape[0], dtype=np.uint8)
    mask[len(conv.prompt_ids) :] = 1
    return _clip(turn, "generator", ids.astype(np.int32), mask, max_length)
