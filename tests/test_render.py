"""Rendering one assistant turn into a row with the real Qwen3 tokenizer and the 8 fixture chat templates.

The contract (docs/TOKENIZATION.md): the supervised tokens decode to exactly what the model emits for the turn,
through the end-of-turn token and not the newline after it; a row the template cannot render faithfully is
rejected with a reason, never mis-masked.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers.paths import TEMPLATES, TOKENIZER_DIR
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from blockdraft.data.completions import normalise
from blockdraft.data.records import RawRecord
from blockdraft.data.render import PlannedTurn, TurnRejection, TurnRow, compile_chat_template, mask_turn, plan_turns
from blockdraft.data.tokenizer import read_tokenizer_folder

IM_END = 151645


@functools.lru_cache(maxsize=1)
def qwen3_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(read_tokenizer_folder(str(TOKENIZER_DIR))[0])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return qwen3_tokenizer()


@functools.cache
def template(name: str):
    return compile_chat_template((TEMPLATES / f"{name}.jinja").read_text())


def render_rows(tokenizer, conv_dict, template_name, mode="auto", max_length=4096):
    """[(TurnRow | TurnRejection, PlannedTurn | None)] for every assistant turn of the conversation."""
    conv = normalise(RawRecord(1, conv_dict, ""))
    out = []
    for planned in plan_turns(conv, template(template_name), mode):
        if isinstance(planned, TurnRejection):
            out.append((planned, None))
        else:
            enc = tokenizer.encode(planned.full, add_special_tokens=False)
            out.append((mask_turn(planned, enc, IM_END, max_length), planned))
    return out


def supervised_text(tokenizer, row: TurnRow) -> str:
    return tokenizer.decode(row.input_ids[row.loss_mask.astype(bool)].tolist(), skip_special_tokens=False)


def prompt_text(tokenizer, row: TurnRow) -> str:
    first = int(np.argmax(row.loss_mask))
    return tokenizer.decode(row.input_ids[:first].tolist(), skip_special_tokens=False)


def assert_exact(tokenizer, row: TurnRow, planned: PlannedTurn) -> None:
    """Supervised tokens = the emitted turn through <|im_end|>; the prompt tokens = the prompt; only '\\n' after."""
    emitted = planned.full[len(planned.prompt) :]
    assert emitted.endswith("<|im_end|>\n")
    assert supervised_text(tokenizer, row) == emitted[: -len("\n")]
    assert prompt_text(tokenizer, row) == planned.prompt
    mask = row.loss_mask.astype(bool)
    last = int(np.flatnonzero(mask)[-1])
    assert row.input_ids[last] == IM_END
    assert tokenizer.decode(row.input_ids[last + 1 :].tolist()) == "\n"
    # One contiguous supervised span.
    assert mask[int(np.argmax(mask)) : last + 1].all()


REASONING = {"id": "r", "messages": [{"role": "user", "content": "What is 2+3?"},
                                     {"role": "assistant", "reasoning_content": "2 plus 3 is 5.", "content": "5"}]}
PLAIN = {"id": "p", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}

THINK_FULL = "<think>\n2 plus 3 is 5.\n</think>\n\n5<|im_end|>"  # the model emits <think> itself (Qwen3 hybrid)
THINK_AFTER_OPEN = "2 plus 3 is 5.\n</think>\n\n5<|im_end|>"  # the prompt already ends with <think>\n (Qwen3.5/3.6)
PLAIN_OUT = "Hi!<|im_end|>"

# (template, thinking mode, row, expected supervised text or rejection reason), one line per outcome a user relies on.
CASES = [
    ("trl_qwen3", "on", REASONING, THINK_FULL),
    ("trl_qwen3", "auto", REASONING, THINK_FULL),
    ("trl_qwen3", "off", PLAIN, PLAIN_OUT),  # <think>\n\n</think>\n\n is in the prompt, not supervised
    ("trl_qwen3", "auto", PLAIN, PLAIN_OUT),
    # thinking on, empty reasoning: the model emits it
    ("trl_qwen3", "on", PLAIN, "<think>\n\n</think>\n\nHi!<|im_end|>"),
    ("trl_qwen3", "off", REASONING, "render_not_prefix"),  # reasoning cannot follow the non-thinking prompt
    ("qwenlm_qwen3_nonthinking", "auto", PLAIN, PLAIN_OUT),
    ("qwenlm_qwen3_nonthinking", "auto", REASONING, "render_not_prefix"),
    ("trl_qwen3_training", "auto", REASONING, THINK_FULL),
    ("trl_qwen3_training", "auto", PLAIN, PLAIN_OUT),
    ("trl_qwen3_6_training", "auto", REASONING, THINK_AFTER_OPEN),
    ("trl_qwen3_6_training", "auto", PLAIN, PLAIN_OUT),
    ("trl_qwen3_instruct_2507", "auto", REASONING, "template_dropped_reasoning"),  # ignores reasoning_content
    ("trl_qwen3_instruct_2507", "auto", PLAIN, PLAIN_OUT),
    ("trl_qwen3_5_think", "auto", REASONING, THINK_AFTER_OPEN),
    ("trl_qwen3_5_think", "auto", PLAIN, PLAIN_OUT),
    ("trl_qwen3_5_nothink", "auto", REASONING, THINK_AFTER_OPEN),
    ("trl_qwen3_5_nothink", "auto", PLAIN, PLAIN_OUT),
    ("trl_qwen3_6", "auto", REASONING, THINK_AFTER_OPEN),
    ("trl_qwen3_6", "auto", PLAIN, PLAIN_OUT),
    # Thinking on with empty reasoning: the prompt's "<think>\n" and the turn's "\n" merge into one "\n\n" token.
    ("trl_qwen3_6", "on", PLAIN, "boundary_merge"),
    ("trl_qwen3_5_think", "on", PLAIN, "boundary_merge"),
]


def test_every_fixture_template_has_an_expected_outcome():
    assert {c[0] for c in CASES} == {p.stem for p in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize(("name", "mode", "row", "expected"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]['id']}" for c in CASES])
def test_template_outcome(tokenizer, name, mode, row, expected):
    [(result, planned)] = render_rows(tokenizer, row, name, mode)
    if expected.endswith("<|im_end|>"):
        assert isinstance(result, TurnRow), result
        assert supervised_text(tokenizer, result) == expected
        assert_exact(tokenizer, result, planned)
        assert result.thinking == ("on" if planned.thinking else "off")
    else:
        assert isinstance(result, TurnRejection)
        assert result.reason == expected


def test_renderer_matches_transformers_apply_chat_template():
    """Our Jinja environment renders what Hugging Face tokenizers (and so the serving engines) render."""
    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ours = compile_chat_template(hf.chat_template)
    tools = [{"type": "function",
              "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief. Ünïcode ok."},
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "2"}}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is 3.", "reasoning_content": "done"},
    ]
    for gen, thinking, msgs, tl in [(True, True, messages[:4], tools), (False, False, messages, None),
                                    (True, False, messages[:2], None)]:
        expected = hf.apply_chat_template(msgs, tools=tl, tokenize=False, add_generation_prompt=gen,
                                          enable_thinking=thinking)
        assert ours.render(msgs, tl, add_generation_prompt=gen, enable_thinking=thinking) == expected


MULTI = {"id": "m", "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "First question?"},
    {"role": "assistant", "reasoning_content": "EARLIER-REASONING about q1", "content": "First answer."},
    {"role": "user", "content": "Second question?"},
    {"role": "assistant", "reasoning_content": "LATER-REASONING about q2", "content": "Second answer."},
]}

TOOL_CHAIN = {"id": "t", "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "CHAIN-REASONING: I should call the tool", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny, 21C"},
    {"role": "assistant", "reasoning_content": "The tool says sunny.", "content": "Sunny and 21C."},
]}


@pytest.mark.parametrize("name", ["trl_qwen3", "trl_qwen3_5_think", "trl_qwen3_5_nothink", "trl_qwen3_6"])
def test_multi_turn_each_turn_its_own_row_without_earlier_reasoning(tokenizer, name):
    rows = render_rows(tokenizer, MULTI, name)
    assert [r.turn for r, _ in rows] == [0, 1]
    for row, planned in rows:
        assert isinstance(row, TurnRow)
        assert_exact(tokenizer, row, planned)
    first, second = rows[0][0], rows[1][0]
    assert "EARLIER-REASONING" in supervised_text(tokenizer, first)
    # A user message follows turn 0, so the template drops its reasoning from what the model sees at turn 1.
    assert "EARLIER-REASONING" not in prompt_text(tokenizer, second)
    assert "First answer." in prompt_text(tokenizer, second)
    assert "LATER-REASONING" in supervised_text(tokenizer, second)


@pytest.mark.parametrize("name", ["trl_qwen3", "trl_qwen3_6"])
def test_tool_call_chain_keeps_the_reasoning_the_template_keeps(tokenizer, name):
    rows = render_rows(tokenizer, TOOL_CHAIN, name)
    assert len(rows) == 2
    (call, call_planned), (answer, answer_planned) = rows
    assert isinstance(call, TurnRow) and isinstance(answer, TurnRow)
    assert_exact(tokenizer, call, call_planned)
    assert_exact(tokenizer, answer, answer_planned)
    assert "<tool_call>" in supervised_text(tokenizer, call)
    # After the last user message the chain's reasoning stays in context: the prompt of the answer keeps it.
    assert "CHAIN-REASONING" in prompt_text(tokenizer, answer)
    assert "sunny, 21C" in prompt_text(tokenizer, answer)


def test_template_ignoring_reasoning_rejects_every_reasoning_turn(tokenizer):
    rows = render_rows(tokenizer, MULTI, "trl_qwen3_instruct_2507")
    assert [(r.turn, r.reason) for r, _ in rows] == [(0, "template_dropped_reasoning"),
                                                     (1, "template_dropped_reasoning")]


def test_inline_think_equals_reasoning_field(tokenizer):
    inline = {"id": "r", "messages": [{"role": "user", "content": "What is 2+3?"},
                                      {"role": "assistant", "content": "<think>\n2 plus 3 is 5.\n</think>\n\n5"}]}
    [(a, _)] = render_rows(tokenizer, inline, "trl_qwen3")
    [(b, _)] = render_rows(tokenizer, REASONING, "trl_qwen3")
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def test_clip_after_masking_and_reject_when_too_little_is_left(tokenizer):
    [(full, _)] = render_rows(tokenizer, REASONING, "trl_qwen3")
    first = int(np.argmax(full.loss_mask))
    [(clipped, _)] = render_rows(tokenizer, REASONING, "trl_qwen3", max_length=first + 3)
    assert clipped.input_ids.tolist() == full.input_ids[: first + 3].tolist()
    assert clipped.loss_mask.tolist() == [0] * first + [1, 1, 1]
    [(rejected, _)] = render_rows(tokenizer, REASONING, "trl_qwen3", max_length=first + 1)
    assert isinstance(rejected, TurnRejection) and rejected.reason == "too_long"


# Text with the characters that make boundaries hard: newlines, spaces, digits, punctuation, non-ASCII.
_text = st.text(alphabet=st.sampled_from(list("ab xyz\n\n  01.,!?é中<>/-")), min_size=0, max_size=40)
_turn = st.fixed_dictionaries({"user": _text, "reasoning": _text, "content": _text})


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(_turn, min_size=1, max_size=3), system=st.one_of(st.none(), _text),
       name=st.sampled_from(["trl_qwen3", "trl_qwen3_6", "trl_qwen3_training"]),
       mode=st.sampled_from(["auto", "on", "off"]))
def test_mask_never_covers_the_prompt_and_stays_inside_the_turn(turns, system, name, mode):
    tokenizer = qwen3_tokenizer()
    messages = [{"role": "system", "content": system}] if system is not None else []
    for t in turns:
        messages.append({"role": "user", "content": t["user"]})
        messages.append({"role": "assistant", "content": t["content"], "reasoning_content": t["reasoning"]})
    for result, planned in render_rows(tokenizer, {"id": "h", "messages": messages}, name, mode):
        if isinstance(result, TurnRejection):
            assert result.reason in {"render_not_prefix", "boundary_merge", "empty_turn"}
            continue
        enc = tokenizer.encode(planned.full, add_special_tokens=False)
        boundary = len(planned.prompt)
        emitted_end = planned.full.rindex("<|im_end|>") + len("<|im_end|>")
        for i in np.flatnonzero(result.loss_mask):
            start, end = enc.offsets[i]
            assert start >= boundary, "a supervised token covers prompt text"
            assert end <= emitted_end, "a supervised token lies past the end of the assistant turn"
        unsupervised = np.flatnonzero(result.loss_mask == 0)
        assert all(enc.offsets[i][1] <= boundary or enc.offsets[i][0] >= emitted_end for i in unsupervised)


# Qwen3.5 / Qwen3.6 on multi-turn rows: every prompt opens `<think>\n` (thinking on) or closes an empty block (off), the
# model emits the rest; exact prompts and exact supervised text per turn. Turn 1 has no reasoning.
QWEN3_5_FAMILY = ["trl_qwen3_5_think", "trl_qwen3_5_nothink", "trl_qwen3_6", "trl_qwen3_6_training"]
THREE_TURNS = {"id": "m3", "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "reasoning_content": "R1: 7 is prime.", "content": "7."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "reasoning_content": "R3: 2 plus 3 is 5.", "content": "5"},
]}
SYS, OPEN, CLOSED = ("<|im_start|>system\nYou are terse.<|im_end|>\n", "<|im_start|>assistant\n<think>\n",
                     "<|im_start|>assistant\n<think>\n\n</think>\n\n")
U1, U2, U3 = ("<|im_start|>user\n" + q + "<|im_end|>\n" for q in ("Name a prime.", "Say hi.", "What is 2+3?"))
A1_BARE, A2_BARE = "<|im_start|>assistant\n7.<|im_end|>\n", "<|im_start|>assistant\nHi!<|im_end|>\n"
A1_THINK, A2_THINK = OPEN + "R1: 7 is prime.\n</think>\n\n7.<|im_end|>\n", CLOSED + "Hi!<|im_end|>\n"
SUPERVISED = ["R1: 7 is prime.\n</think>\n\n7.<|im_end|>", "Hi!<|im_end|>",
              "R3: 2 plus 3 is 5.\n</think>\n\n5<|im_end|>"]


def expected_prompts(name: str, mode: str) -> list[str]:
    """The exact prompt of each turn: the serving templates drop reasoning before the last user message and render those
    turns bare; the training variant keeps every think block. Thinking per turn: auto = on, off, on."""
    thinking = {"auto": [True, False, True], "on": [True] * 3, "off": [False] * 3}[mode]
    a1, a2 = (A1_THINK, A2_THINK) if name.endswith("_training") else (A1_BARE, A2_BARE)
    histories = [SYS + U1, SYS + U1 + a1 + U2, SYS + U1 + a1 + U2 + a2 + U3]
    return [h + (OPEN if on else CLOSED) for h, on in zip(histories, thinking)]


# (mode, the outcome per turn: "ok" = supervised text SUPERVISED[turn], else the rejection reason)
THREE_TURN_OUTCOMES = [
    ("auto", ["ok", "ok", "ok"]),
    # Thinking on with empty reasoning: the prompt's "<think>\n" and the turn's "\n" merge into one "\n\n" token.
    ("on", ["ok", "boundary_merge", "ok"]),
    # Thinking off: reasoning cannot follow the closed empty think block of the prompt.
    ("off", ["render_not_prefix", "ok", "render_not_prefix"]),
]


@pytest.mark.parametrize("name", QWEN3_5_FAMILY)
@pytest.mark.parametrize(("mode", "outcomes"), THREE_TURN_OUTCOMES, ids=[m for m, _ in THREE_TURN_OUTCOMES])
def test_qwen3_5_and_3_6_three_turns_exact_prompts_and_supervised_text(tokenizer, name, mode, outcomes):
    rows = render_rows(tokenizer, THREE_TURNS, name, mode)
    assert [r.turn for r, _ in rows] == [0, 1, 2]
    prompts = expected_prompts(name, mode)
    for turn, ((row, planned), outcome) in enumerate(zip(rows, outcomes)):
        if outcome != "ok":
            assert isinstance(row, TurnRejection) and row.reason == outcome, (turn, row)
            continue
        assert isinstance(row, TurnRow), (turn, row)
        assert prompt_text(tokenizer, row) == prompts[turn]
        assert supervised_text(tokenizer, row) == SUPERVISED[turn]
        assert_exact(tokenizer, row, planned)
        assert row.thinking == ("on" if prompts[turn].endswith(OPEN) else "off")


@pytest.mark.parametrize("name", QWEN3_5_FAMILY)
def test_qwen3_5_and_3_6_thinking_on_every_turn_reasons_after_the_opened_think(tokenizer, name):
    """Three reasoning turns, thinking on: each prompt ends with the opened `<think>\\n`; the row supervises the
    reasoning from its first character, the closing tag, the answer and <|im_end|>; earlier reasoning is in context only
    for the training variant."""
    messages: list[dict] = []
    for k in range(3):
        messages += [{"role": "user", "content": f"Question {k}?"},
                     {"role": "assistant", "reasoning_content": f"Step {k}: think\nthen answer.",
                      "content": f"Answer {k}."}]
    rows = render_rows(tokenizer, {"id": "on3", "messages": messages}, name, "on")
    assert len(rows) == 3
    for k, (row, planned) in enumerate(rows):
        assert isinstance(row, TurnRow), row
        assert prompt_text(tokenizer, row).endswith(f"<|im_start|>user\nQuestion {k}?<|im_end|>\n{OPEN}")
        assert supervised_text(tokenizer, row) == f"Step {k}: think\nthen answer.\n</think>\n\nAnswer {k}.<|im_end|>"
        assert_exact(tokenizer, row, planned)
        earlier = [f"Step {j}:" in prompt_text(tokenizer, row) for j in range(k)]
        assert earlier == [name.endswith("_training")] * k


@pytest.mark.parametrize("name", QWEN3_5_FAMILY)
def test_qwen3_5_and_3_6_tool_chain_rows_are_exact(tokenizer, name):
    rows = render_rows(tokenizer, TOOL_CHAIN, name)
    (call, call_planned), (answer, answer_planned) = rows
    assert isinstance(call, TurnRow) and isinstance(answer, TurnRow)
    assert_exact(tokenizer, call, call_planned)
    assert_exact(tokenizer, answer, answer_planned)
    assert supervised_text(tokenizer, call) == (
        "CHAIN-REASONING: I should call the tool\n</think>\n\n"
        "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>")
    assert prompt_text(tokenizer, answer).endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n" + OPEN)
    assert "CHAIN-REASONING" in prompt_text(tokenizer, answer)
    assert supervised_text(tokenizer, answer) == "The tool says sunny.\n</think>\n\nSunny and 21C.<|im_end|>"


def test_the_sandbox_still_refuses_what_it_refused_when_its_verdicts_are_remembered():
    """Rendering remembers the sandbox's verdict per (type, attribute): a refused attribute stays refused on every
    render, an allowed one stays allowed, and a template that tries to mutate its messages fails as a
    `template_error`."""
    import jinja2.sandbox

    probe = compile_chat_template("{{ messages[0].content.upper() }}|{{ messages[0].content.__class__ }}|"
                                  "{{ messages.__len__ }}")
    for _ in range(3):
        assert probe.render([{"role": "user", "content": "hi"}], None, False, False) == "HI||"
    mutate = compile_chat_template("{{ messages.append(1) }}{{ messages[0].update({'role': 'x'}) }}")
    for _ in range(2):
        with pytest.raises(jinja2.sandbox.SecurityError):
            mutate.render([{"role": "user", "content": "hi"}], None, False, False)
    conv = normalise(RawRecord(
        0, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, ""))
    (rejected,) = plan_turns(conv, mutate, "auto")
    assert (
        isinstance(rejected, TurnRejection)
        and rejected.reason == "template_error"
        and "SecurityError" in rejected.detail
    )
