"""The mask id rule on a target whose embedding has no reserved row, as a new user meets one (a Llama-family instruct
model like SmolLM2: vocab_size = len(tokenizer), every row a token, the chat tokens added ones): a mask id the rows
never hold trains and evaluates end to end; one they hold is refused in one line before training starts, naming one that
fits; the advice line states the rule for any tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from blockdraft.added_tokens import HOW_TO_CHOOSE
from blockdraft.cli import app
from blockdraft.config import load_config
from blockdraft.data.seen_ids import SEEN_IDS, SeenIds, suggest_mask_token_id
from blockdraft.errors import ArtifactError, ConfigError
from blockdraft.pipeline import write_toml
from blockdraft.stages import eval as eval_stage
from blockdraft.stages import tokenize as tokenize_stage
from blockdraft.stages import train as train_stage
from blockdraft.store import open_store
from blockdraft.store.artifact import State, commit_artifact, entry_for_local_file, verify_artifact

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as SmolLM2's are
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def conversation(i: int, rng: random.Random) -> dict:
    a, b = rng.randrange(9), rng.randrange(9)
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"what is {WORDS[a]} and {WORDS[b]}?"},
                                        {"role": "assistant",
                                         "content": f"{WORDS[a]} and {WORDS[b]} make {a + b + 2}."}]}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A 2-layer Llama target with tied embeddings and random weights beside a byte-level BPE tokenizer with a ChatML
    template, whose config's vocab_size is len(tokenizer): no reserved row. Also completions.jsonl and prompts.jsonl."""
    folder = tmp_path_factory.mktemp("no-reserved-row")
    rng = random.Random(0)
    conversations = [conversation(i, rng) for i in range(16)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in conversations for m in c["messages"]] + ["user", "assistant", "system", "\n"]
    bpe.train_from_iterator(texts * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=ADDED,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    assert [tokenizer.convert_tokens_to_ids(t) for t in ADDED] == [0, 1, 2]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    with (folder / "completions.jsonl").open("w") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations[:12])
    with (folder / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"id": c["id"], "messages": c["messages"][:1]}) + "\n" for c in conversations[12:])
    return folder


def settings(tmp: Path, target: Path, mask: int | None) -> dict:
    dflash = {"architecture": "dflash", "block_size": 4, "num_draft_layers": 1, "target_layer_ids": [0],
              "num_anchors": 8, "gamma": 4.0}
    return {
        "target": {"path": str(target)}, "store": {"url": str(tmp / "store")}, "tokenize": {"held_out_fraction": 0.0},
        "dflash": dflash if mask is None else {**dflash, "mask_token_id": mask},
        "train": {"data": str(tmp / "tokenized"), "output": str(tmp / "run"), "log_dir": str(tmp / "logs"),
                  "max_steps": 4, "batch_size": 2, "global_batch_size": 2, "checkpoint_every": 4,
                  "decode_eval_prompts": 0, "seed": 0},
        "eval": {"num_prompts": 2},
    }


@pytest.fixture(scope="module")
def tokenized(target, tmp_path_factory) -> Path:
    """The completions tokenized with no mask id set (the target's family has no reserved one to check)."""
    tmp = tmp_path_factory.mktemp("data")
    tokenize_stage.run(load_config(None, settings(tmp, target, None)), str(target / "completions.jsonl"),
                       str(tmp / "tokenized"))
    return tmp / "tokenized"


def seen_ids(tokenized: Path) -> SeenIds:
    manifest = verify_artifact(open_store(tokenized)).manifest
    assert manifest is not None
    return SeenIds.from_record(manifest.counts[SEEN_IDS])


def test_the_target_has_no_reserved_row_and_tokenize_records_the_ids_its_rows_hold(target, tokenized):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    assert vocab_size == len(tokenizer) and all(
        tokenizer.convert_ids_to_tokens(i) is not None for i in range(vocab_size)
    )
    seen = seen_ids(tokenized)
    rows = load_rows(tokenized)
    assert seen.size == vocab_size and {i for i in range(vocab_size) if i in seen} == {i for row in rows for i in row}
    assert 0 < len(seen) < vocab_size


def load_rows(tokenized: Path) -> list[list[int]]:
    return [list(ids) for ids in Dataset.load_from_disk(str(tokenized / "train"))["input_ids"]]


def test_a_mask_id_the_rows_never_hold_trains_and_evaluates_end_to_end(target, tokenized, tmp_path):
    """The rule's pick for a target without spare rows: the highest id the rows never hold that is no added token (an
    ordinary token). Tokenize with it set is done (nothing refused); train and a greedy eval run on it."""
    seen, vocab_size = seen_ids(tokenized), len(PreTrainedTokenizerFast.from_pretrained(target))
    mask = suggest_mask_token_id(seen, vocab_size, dict.fromkeys(range(len(ADDED)), ""))
    assert mask is not None and len(ADDED) <= mask < vocab_size and mask not in seen
    cfg = load_config(None, {**settings(tmp_path, target, mask), "train": {**settings(tmp_path, target, mask)["train"],
                                                                          "data": str(tokenized)}})
    again = tokenize_stage.run(cfg, str(target / "completions.jsonl"), str(tokenized))
    assert again.already_done
    trained = train_stage.run(cfg).details
    assert trained.steps == 4 and trained.drafter.spec.mask_token_id == mask
    report = eval_stage.run(cfg, str(tmp_path / "run"), prompts=str(target / "prompts.jsonl"), max_new_tokens=8).details
    assert report.lossless.ok, report.lossless
    assert report.mask_token_id == mask


def test_a_mask_id_the_rows_hold_is_refused_in_one_line_before_training_and_by_tokenize(target, tokenized, tmp_path):
    seen = seen_ids(tokenized)
    held = next(i for i in range(len(ADDED), seen.size) if i in seen)  # an ordinary token of the rows
    fit = suggest_mask_token_id(seen, seen.size, dict.fromkeys(range(len(ADDED)), ""))
    train_cfg = {**settings(tmp_path, target, held)["train"], "data": str(tokenized)}
    with pytest.raises(ConfigError) as raised:
        train_stage.run(load_config(None, {**settings(tmp_path, target, held), "train": train_cfg}))
    message = str(raised.value)
    assert (
        "\n" not in message
        and f"mask_token_id {held} occurs in the tokenized rows of" in message
        and f"e.g. {fit}" in message
    )
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))  # refused before any step
    # the CLI: after the memory plan, one error line and exit status 2
    toml = tmp_path / "c.toml"
    write_toml(toml, {**settings(tmp_path, target, held), "train": train_cfg})
    result = CliRunner().invoke(app, ["train", "--config", str(toml)])
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: dflash.mask_token_id {held} occurs in the tokenized rows of ")
    # tokenize with that mask id set commits its rows, then refuses the mask id in one line
    out = tmp_path / "tokenized-again"
    with pytest.raises(ConfigError, match=rf"mask_token_id {held} occurs in the tokenized rows .* e\.g\. {fit} \(the "
                                          r"artifact is "):
        tokenize_stage.run(load_config(None, settings(tmp_path, target, held)), str(target / "completions.jsonl"),
                           str(out))
    assert verify_artifact(open_store(out)).state is State.VERIFIED


def test_an_added_token_as_mask_and_an_unset_mask_are_refused_with_the_rule_for_any_tokenizer(
    target, tokenized, tmp_path
):
    assert "Qwen" not in HOW_TO_CHOOSE and "never hold" in HOW_TO_CHOOSE and "vocab_size" in HOW_TO_CHOOSE
    with pytest.raises(ConfigError) as raised:  # <|im_start|>: an added token, refused when the config loads
        load_config(None, settings(tmp_path, target, 1))
    message = str(raised.value)
    assert "\n" not in message and "<|im_start|>" in message and HOW_TO_CHOOSE in message and "Qwen" not in message
    # no mask id set, and a Llama target has no known reserved one: the rule, and an id the rows never hold
    with pytest.raises(ConfigError) as raised:
        train_stage.run(load_config(None, {**settings(tmp_path, target, None),
                                           "train": {**settings(tmp_path, target, None)["train"],
                                                     "data": str(tokenized)}}))
    message = str(raised.value)
    fit = suggest_mask_token_id(seen_ids(tokenized), seen_ids(tokenized).size, dict.fromkeys(range(len(ADDED)), ""))
    assert (
        "\n" not in message
        and "has no known reserved id" in message
        and HOW_TO_CHOOSE in message
        and f"e.g. {fit}" in message
    )
    assert "Qwen" not in message


def test_a_tokenized_artifact_without_recorded_ids_is_refused_in_one_line(target, tmp_path):
    """An artifact whose manifest records no token ids (an older tokenize's) cannot have its mask id checked."""
    folder = tmp_path / "old"
    DatasetDict({"train": Dataset.from_list([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])}).save_to_disk(
        str(folder)
    )
    entries = [entry_for_local_file(folder, p) for p in sorted(folder.rglob("*")) if p.is_file()]
    commit_artifact(open_store(folder), "tokenized", entries, counts={"train_rows": 1})
    cfg = load_config(None, {**settings(tmp_path, target, 200),
                             "train": {**settings(tmp_path, target, 200)["train"], "data": str(folder)}})
    with pytest.raises(ArtifactError,
                       match=r"records no token ids \(counts.token_ids\).*rerun tokenize into it") as raised:
        train_stage.run(cfg)
    assert "\n" not in str(raised.value)
