"""Which token ids a set of tokenized rows holds: one bit per id of the tokenizer, recorded by tokenize in its
artifact's manifest (`counts.token_ids`) so that any mask id can be checked against the data later without reading a row
(`mask_in_data_problem`).

The record is {"size": ids covered (the tokenizer's length), "seen": how many of them occur, "bits": the bitmap, packed
little-endian, zlib-compressed and base64-encoded}: a few KiB for any vocabulary (a dense bitmap and a sparse one both
compress well).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import Any

import numpy as np

from blockdraft.added_tokens import spare_row

SEEN_IDS = "token_ids"  # the field of a tokenized artifact's manifest counts (and of each tokenize piece's counts)


class SeenIds:
    """A set of token ids below `size`, as a boolean array."""

    def __init__(self, size: int, bits: np.ndarray | None = None) -> None:
        self.size = size
        self.bits = np.zeros(size, dtype=bool) if bits is None else bits

    def add(self, ids: np.ndarray) -> None:
        """Mark every id of `ids` (each below `size`) as seen."""
        self.bits[np.asarray(ids, dtype=np.int64)] = True

    def update(self, other: SeenIds) -> None:
        """Add every id `other` holds (the union; the larger size wins)."""
        if other.size > self.size:
            self.bits = np.concatenate([self.bits, np.zeros(other.size - self.size, dtype=bool)])
            self.size = other.size
        self.bits[: other.size] |= other.bits

    def __contains__(self, token_id: int) -> bool:
        return 0 <= token_id < self.size and bool(self.bits[token_id])

    def __len__(self) -> int:
        return int(self.bits.sum())

    def highest_absent(self, below: int, exclude: set[int] | frozenset[int] = frozenset()) -> int | None:
        """The highest id below `below` that is not held and not in `exclude` (None when every one is)."""
        free = np.ones(below, dtype=bool)
        held = min(self.size, below)
        free[:held] = ~self.bits[:held]
        free[[i for i in exclude if 0 <= i < below]] = False
        found = np.flatnonzero(free)
        return int(found[-1]) if found.size else None

    def to_record(self) -> dict[str, Any]:
        packed = np.packbits(self.bits, bitorder="little").tobytes()
        return {"size": self.size, "seen": len(self),
                "bits": base64.b64encode(zlib.compress(packed, 9)).decode("ascii")}

    @classmethod
    def from_record(cls, record: Any) -> SeenIds:
        """The set a `to_record` dict holds; ValueError naming what is wrong with a malformed one."""
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("size"), int)
            or not isinstance(record.get("bits"), str)
        ):
            raise ValueError("not a {size, seen, bits} record")
        size = record["size"]
        try:
            packed = zlib.decompress(base64.b64decode(record["bits"], validate=True))
        except (binascii.Error, zlib.error) as exc:
            raise ValueError(f"its bitmap does not decode ({exc})") from None
        if len(packed) != (size + 7) // 8:
            raise ValueError(f"its bitmap holds {len(packed) * 8} bits for {size} ids")
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=size, bitorder="little").astype(bool)
        return cls(size, bits)


def suggest_mask_token_id(seen: SeenIds, vocab_size: int, added: dict[int, str],
                          known: int | None = None) -> int | None:
    """An id that fits the rule for a target of `vocab_size` rows whose tokenized data holds `seen` (`seen.size`: the
    tokenizer's ids): the family's reserved id when the data does not hold it, else the first row past the tokenizer's
    last id, else the highest id the data never holds that is not an added token (in a BPE vocabulary the later merges
    are the rarer ones); None when no row is free."""
    if known is not None and known < vocab_size and known not in seen and known not in added:
        return known
    if (row := spare_row(seen.size, vocab_size)) is not None:
        return row
    return seen.highest_absent(min(vocab_size, seen.size), set(added))


def mask_in_data_problem(mask_token_id: int, seen: SeenIds, data: str, vocab_size: int, added: dict[int, str],
                         known: int | None = None) -> str | None:
    """The one line that refuses `mask_token_id` when the tokenized rows of `data` (which hold `seen`) hold it, naming
    an id that fits instead; None when they never do."""
    if mask_token_id not in seen:
        return None
    fit = suggest_mask_token_id(seen, vocab_size, added, known)
    fix = (f"set dflash.mask_token_id to an id these rows never hold, e.g. {fit}" if fit is not None else
           f"every id below vocab_size {vocab_size} occurs in them or is an added token, so no row of the target's "
           "embedding can be the mask")
    return (f"dflash.mask_token_id {mask_token_id} occurs in the tokenized rows of {data} (they hold {len(seen):,} "
            f"distinct ids of {seen.size:,}): the drafter could not tell a masked slot from that token; {fix}")


__all__ = ["SEEN_IDS", "SeenIds", "mask_in_data_problem", "suggest_mask_token_id"]
