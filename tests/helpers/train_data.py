"""What the train tests share: learnable tokenized rows from the golden target, a config file around them, the metrics
log.

Rows are the golden target's own greedy continuations (learnable, as regenerated data is); prompts are unsupervised.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict

from blockdraft.data.seen_ids import SEEN_IDS, SeenIds
from blockdraft.model import load_target
from blockdraft.store import open_store
from blockdraft.store.artifact import commit_artifact, entry_for_local_file
from helpers.paths import GOLDEN_TARGET


def make_rows(num_rows: int, prompt_len: int, new_tokens: int, seed: int) -> list[dict]:
    """`num_rows` rows of `prompt_len` random prompt tokens (unsupervised) and the target's `new_tokens` greedy ones."""
    model = load_target(str(GOLDEN_TARGET), "cpu", torch.float32)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 500, (num_rows, prompt_len), generator=g)
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    mask = [0] * prompt_len + [1] * new_tokens
    return [{"input_ids": row.tolist(), "loss_mask": mask, "source_id": f"row-{i}"} for i, row in enumerate(out)]


def write_tokenized(folder: Path, train_rows: list[dict], held_out_rows: list[dict],
                    tokenize_run: dict | None = None) -> str:
    """A tokenized artifact in the layout `tokenize` writes: a DatasetDict (train, held_out) plus the manifest, whose
    config records `tokenize_run` (what tokenize records of its template, tokenizer, thinking mode) when given, and
    whose counts record the token ids the rows hold, as tokenize's do."""
    DatasetDict({"train": Dataset.from_list(train_rows), "held_out": Dataset.from_list(held_out_rows)}).save_to_disk(
        str(folder)
    )
    entries = [entry_for_local_file(folder, p) for p in sorted(folder.rglob("*")) if p.is_file()]
    config = {"tokenize_run": tokenize_run} if tokenize_run is not None else {}
    ids = [i for row in train_rows + held_out_rows for i in row["input_ids"]]
    seen = SeenIds(max(ids, default=-1) + 1)
    seen.add(np.asarray(ids, dtype=np.int64))
    counts = {"train_rows": len(train_rows), SEEN_IDS: seen.to_record()}  # the ids train checks the mask id against
    commit_artifact(open_store(folder), "tokenized", entries, config=config, counts=counts)
    return str(folder)


def config_file(tmp: Path, data: str, output: str | None = None, **train) -> Path:
    """`tmp/blockdraft.toml`: the golden target, a 2-layer B=4 drafter, checkpoints to `output` (default `tmp/ckpt`),
    logs in `tmp/logs`, deterministic, one micro-batch per step (global batch = batch_size x ranks unless given);
    `train` overrides train.* settings, `drafters` the drafter devices. No checkpoint is decoded for real unless a test
    asks (`decode_eval_prompts`): on the golden target each decode costs seconds at every checkpoint, and the tests of
    the decoded figures (test_training_signal, test_train's first) ask for it."""
    placement = train.pop("drafters", ["cpu"])
    settings = {
        "max_steps": 12, "batch_size": 2, "lr": 3e-3, "warmup_ratio": 0.1, "checkpoint_every": 4, "log_every": 1,
        "lm_head_chunk_blocks": 3, "seed": 0, "deterministic": True, "decode_eval_prompts": 0, **train,
    }
    settings.setdefault("global_batch_size", settings["batch_size"] * len(placement))  # one micro-batch per rank
    lines = [
        "[target]", f'path = "{GOLDEN_TARGET.as_posix()}"',
        "[dflash]", 'architecture = "dflash"', "block_size = 4", "mask_token_id = 511", "num_draft_layers = 2",
        "gamma = 4.0", "num_anchors = 8", "intermediate_size = 96",
        "[placement]", f"drafter_devices = {json.dumps(placement)}",
        "[store]", f'url = "{(tmp / "store").as_posix()}"',
        "[train]", f'data = "{data}"', f'output = "{output or (tmp / "ckpt").as_posix()}"',
        f'log_dir = "{(tmp / "logs").as_posix()}"',
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = tmp / "blockdraft.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def logged_losses(log_dir: Path) -> dict[int, float]:
    """Loss by step as the metrics log holds it."""
    return {e["step"]: e["loss"] for e in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def assert_same_training(one: Path, two: Path, steps: int, rtol: float, atol: float) -> None:
    """Two runs (each with `ckpt/` and `logs/` under its folder) trained the same: the final checkpoint's weights within
    rtol/atol, and every step's logged loss within rel 1e-5."""
    from safetensors.torch import load_file

    from blockdraft.model.formats import checkpoint_key

    w1 = load_file(str(one / "ckpt" / checkpoint_key(steps) / "model.safetensors"))
    w2 = load_file(str(two / "ckpt" / checkpoint_key(steps) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=rtol, atol=atol, msg=name)
    l1, l2 = logged_losses(one / "logs"), logged_losses(two / "logs")
    assert sorted(l1) == sorted(l2) == list(range(1, steps + 1))
    for step in l1:
        assert abs(l2[step] - l1[step]) <= 1e-5 * abs(l1[step]), (step, l1[step], l2[step])
