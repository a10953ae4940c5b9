"""Target agreement (docs/TRAINING-SIGNAL.md): is this data what the target itself would write?

The target reads a sample of rows teacher-forced; agreement is the share of supervised positions where its greedy next
token is the row's token there. A drafter learns to predict the target, so it can only be accepted as often as the
target agrees with what it was trained on. On the tiny target (60 rows): its own completions 0.98, the hybrid fixture's
answers 0.87, each answer's words reversed 0.27.

Rows are split by thinking mode: "on" when the supervised tokens hold a think block with reasoning in it, else "off".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from blockdraft.config import BlockdraftConfig
from blockdraft.errors import ConfigError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# More tokens than this between <think> and </think> is reasoning; an empty block renders as a newline or two.
EMPTY_THINK_TOKENS = 2


def load_tokenizer(folder: str | None) -> Any:
    """The tokenizer in `folder`, or None when none loads from it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder) if folder else None
    except (OSError, ValueError):
        return None


def think_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of <think> and </think> in `tokenizer`, or None when it has no such tokens."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if THINK_OPEN in vocab and THINK_CLOSE in vocab:
        return vocab[THINK_OPEN], vocab[THINK_CLOSE]
    return None


def thinking_of(ids: Sequence[int], mask: Sequence[int], think: tuple[int, int] | None) -> str:
    """"on" when the supervised part of a row holds a think block with reasoning in it, else "off"."""
    if think is None:
        return "off"
    supervised = [t for t, m in zip(ids, mask, strict=True) if m]
    if think[0] in supervised and think[1] in supervised:
        start, end = supervised.index(think[0]), supervised.index(think[1])
        return "on" if end - start - 1 > EMPTY_THINK_TOKENS else "off"
    return "off"


@torch.no_grad()
def target_agreement(
    hf_model: Any,
    rows: Iterable[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]],
    think: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """{"agreement", "positions", "rows", "by_thinking": {mode: {"agreement", "positions", "rows"}}} of the target
    `hf_model` over `rows` ((input_ids, loss_mask) pairs), one row per forward."""
    device = next(hf_model.parameters()).device
    hits: dict[str, int] = {}
    counted: dict[str, int] = {}
    nrows: dict[str, int] = {}
    for ids, mask in rows:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        mask_t = torch.as_tensor(mask).bool()
        if ids_t.numel() < 2 or not bool(mask_t[1:].any()):
            continue
        mode = thinking_of(ids_t.tolist(), mask_t.tolist(), think)
        # [S-1]: the token after each
        predicted = hf_model(input_ids=ids_t[None].to(device)).logits[0, :-1].argmax(-1).cpu()
        supervised = mask_t[1:]
        hits[mode] = hits.get(mode, 0) + int((predicted[supervised] == ids_t[1:][supervised]).sum())
        counted[mode] = counted.get(mode, 0) + int(supervised.sum())
        nrows[mode] = nrows.get(mode, 0) + 1
    total = sum(counted.values())
    return {
        "agreement": sum(hits.values()) / total if total else 0.0,
        "positions": total,
        "rows": sum(nrows.values()),
        "by_thinking": {m: {"agreement": hits[m] / counted[m], "positions": counted[m], "rows": nrows[m]}
                        for m in sorted(counted)},
    }


def sample_indices(num_rows: int, count: int, seed: int) -> list[int]:
    """The rows agreement is measured on: the first `count` of a permutation drawn with `seed`, in row order."""
    return sorted(torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def tokenized_agreement(folder: Path, config: BlockdraftConfig) -> dict[str, Any]:
    """Target agreement of the train rows of the tokenized artifact in the local `folder` (`tokenize --check-target`,
    `train --plan`): train.target_agreement_rows rows drawn with train.seed and clipped to train.max_length, as train
    measures it before its first step, the target on the first entry of placement.target_devices. With no train row to
    measure (none with a supervised token) the share is None: no rows to measure, never a share of 0."""
    from datasets import Dataset

    from blockdraft.data.formats import TRAIN_SPLIT
    from blockdraft.model import load_target

    tc = config.train
    if config.target.path is None:
        raise ConfigError("target agreement needs the target: set target.path")
    if not (folder / TRAIN_SPLIT).is_dir():
        raise ConfigError(f"{folder} holds no '{TRAIN_SPLIT}' split to check against the target; pass a tokenized "
                          "artifact")
    ds = Dataset.load_from_disk(str(folder / TRAIN_SPLIT))
    hf_model = load_target(config.target.path, config.placement.target_groups[0], config.target.dtype)
    rows = ((ds[i]["input_ids"][: tc.max_length], ds[i]["loss_mask"][: tc.max_length])
            for i in sample_indices(len(ds), max(tc.target_agreement_rows, 1), tc.seed))
    result = target_agreement(hf_model, rows, think_ids(load_tokenizer(config.target.tokenizer or config.target.path)))
    return {**result, "agreement": None} if result["positions"] == 0 else result


def describe_agreement(result: dict[str, Any]) -> str:
    """One line: the share, and the share of each thinking mode; or that there were no rows to measure."""
    if result["agreement"] is None:
        return "target agreement: no rows to measure (no train row with a supervised token)"
    modes = ", ".join(f"thinking {m} {v['agreement']:.2f} ({v['rows']} rows)" for m, v in result["by_thinking"].items())
    return (f"target agreement {result['agreement']:.2f}: the target's greedy next token is the label at that share of "
            f"{result['positions']:,} supervised positions of {result['rows']} rows ({modes or 'no rows'})")


def agreement_warning(result: dict[str, Any], threshold: float) -> str | None:
    """The one warning line when agreement is below `threshold` (train.min_target_agreement), else None."""
    if result["positions"] == 0 or result["agreement"] >= threshold:
        return None
    low = [m for m, v in result["by_thinking"].items() if v["agreement"] < threshold]
    return (
        f"target agreement {result['agreement']:.2f} is below {threshold:.2f} (thinking {', '.join(low)} rows): the "
        "target would not write this data (answers from another model or person, or another thinking mode than it "
        "serves with), and a drafter trained on it will draft what the target rejects; regenerate the answers with the "
        "target: `blockdraft generate PROMPTS OUT --thinking on|off` in the thinking mode it serves with, then "
        "tokenize again"
    )


__all__ = ["agreement_warning", "describe_agreement", "load_tokenizer", "sample_indices", "target_agreement",
           "tokenized_agreement", "think_ids", "thinking_of"]
