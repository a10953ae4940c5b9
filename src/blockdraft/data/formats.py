"""What the data artifacts are called and how a tokenized one is split: the names that generate and tokenize write and
that tokenize, train and eval read, so that no stage imports another to learn them (model/formats.py does the same for
drafter artifacts)."""

from __future__ import annotations

COMPLETIONS_KIND = "completions"  # generate's output: shards/*.jsonl.zst, failures.ndjson, generate.settings
TOKENIZED_KIND = "tokenized"  # tokenize's output: the `datasets.save_to_disk` layout of a DatasetDict
TRAIN_SPLIT = "train"  # the split train reads and eval's prompts leave out
HELD_OUT_SPLIT = "held_out"  # the rows tokenize holds out of training (tokenize.held_out_fraction)
SPLITS = (TRAIN_SPLIT, HELD_OUT_SPLIT)  # the tokenized artifact's splits, in this order

__all__ = ["COMPLETIONS_KIND", "HELD_OUT_SPLIT", "SPLITS", "TOKENIZED_KIND", "TRAIN_SPLIT"]
