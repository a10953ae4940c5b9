"""Rows longer than `tokenize.max_length` are clipped and counted: rows clipped, tokens dropped, supervised tokens
dropped.

The expected figures come from the same conversations tokenized whole (a `max_length` nothing reaches): every clipped
row must be its whole row cut at `max_length`, and the counts in the summary, the manifest and `status` must add up to
exactly what the cuts removed, across shards, workers and resumed runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers.tokenize_data import config, conversation, half_finished, long_conversation, rows_of, tokenize, write_jsonl
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.reporter import Reporter
from blockdraft.stages.tokenize import summary_lines
from blockdraft.stages.tokenize.report import clip_warning
from blockdraft.store import open_store
from blockdraft.store.artifact import PIECES_DIR, State, read_manifest

WHOLE = 10**6  # a max_length no row here reaches
MAX_LENGTH = 152  # cuts 12 of the 18 turns of LONG; one of them loses only the unsupervised newline after <|im_end|>
CLIP_KEYS = ("rows_clipped", "tokens_clipped", "supervised_tokens_clipped")
# Multi-turn reasoning conversations, plus one whose prompt alone outgrows MAX_LENGTH (rejected too_long, not clipped).
LONG = [long_conversation(i, turns=3, words=20 + 10 * (i % 3)) for i in range(6)]
TOO_LONG = {"id": "big-prompt", "messages": [{"role": "user", "content": "word " * 200},
                                              {"role": "assistant", "reasoning_content": "Short.", "content": "Yes."}]}


def expected_clipping(whole: Path, clipped: Path, max_length: int) -> dict[str, int]:
    """The clip counts, worked out from the rows themselves: each row of `clipped` is its `whole` row cut at
    `max_length`."""
    cut = {(r["source_id"], r["turn"]): r for rows in rows_of(clipped).values() for r in rows}
    counts: dict[str, int] = dict.fromkeys(CLIP_KEYS, 0)
    for row in (r for rows in rows_of(whole).values() for r in rows):
        ids, mask = row["input_ids"], row["loss_mask"]
        kept = cut.get((row["source_id"], row["turn"]))
        if kept is None:  # rejected too_long: at most one supervised token left before the cut
            assert len(ids) > max_length and sum(a & b for a, b in zip(mask[: max_length - 1], mask[1:max_length],
                                                                       strict=True)) == 0
            continue
        assert kept["input_ids"] == ids[:max_length] and kept["loss_mask"] == mask[:max_length]
        if len(ids) > max_length:
            counts["rows_clipped"] += 1
            counts["tokens_clipped"] += len(ids) - max_length
            counts["supervised_tokens_clipped"] += sum(mask[max_length:])
    return counts


def clip_counts(counts: dict) -> dict[str, int]:
    return {k: counts[k] for k in CLIP_KEYS}


def test_multi_turn_thinking_rows_report_exact_clipping_in_summary_manifest_and_status(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [*LONG, TOO_LONG])
    tokenize(source, tmp_path / "whole", config(thinking="on", held_out_fraction=0.0, max_length=WHOLE))
    reporter = Reporter()
    result = tokenize(source, tmp_path / "out", config(thinking="on", held_out_fraction=0.3, max_length=MAX_LENGTH),
                      reporter)
    assert result.report.state is State.VERIFIED
    expected = expected_clipping(tmp_path / "whole", tmp_path / "out", MAX_LENGTH)
    whole_rows = [r for r in rows_of(tmp_path / "whole")["train"] if r["source_id"] != "big-prompt"]
    # The data reaches every case: rows cut in their supervised span, one cut after it, rows left whole, a prompt too
    # long.
    [just_over] = [r for r in whole_rows if r["num_tokens"] == MAX_LENGTH + 1]
    assert just_over["loss_mask"][-1] == 0 and any(r["num_tokens"] <= MAX_LENGTH for r in whole_rows)
    assert expected["rows_clipped"] == 12 and expected["supervised_tokens_clipped"] < expected["tokens_clipped"]
    assert result.details.counts["rejected"] == {"too_long": 1} and result.details.counts["rows_out"] == 18

    assert clip_counts(result.details.counts) == expected
    manifest = read_manifest(open_store(tmp_path / "out"))[0]
    assert clip_counts(manifest.counts) == expected and all(type(manifest.counts[k]) is int for k in CLIP_KEYS)
    assert result.details.counts["tokens"] == sum(
        r["num_tokens"] for rows in rows_of(tmp_path / "out").values() for r in rows
    )
    lines = summary_lines(result)
    assert (f"  clipped to tokenize.max_length {MAX_LENGTH}: rows 12; tokens dropped {expected['tokens_clipped']:,}, "
            f"of them supervised {expected['supervised_tokens_clipped']:,}") in lines
    # 12 of 18 rows clipped: one warning naming the setting, the figures and the fix; in the result's warnings too.
    [warning] = [w for w in reporter.warnings if "max_length" in w]
    assert warning.startswith(f"12 of 18 rows (66.7%) were longer than tokenize.max_length {MAX_LENGTH}")
    # of the rows written
    share = 100 * expected["supervised_tokens_clipped"] / sum(r["num_supervised"] for r in whole_rows)
    assert (f"dropping {expected['tokens_clipped']:,} tokens of which {expected['supervised_tokens_clipped']:,} "
            f"supervised ({share:.1f}% of all supervised tokens)") in warning
    assert "raise tokenize.max_length" in warning and warning in result.details.warnings
    assert f"  WARNING: {warning}" in lines

    # `blockdraft status` and its Markdown page show the flat counts.
    page = tmp_path / "PROGRESS.md"
    status = CliRunner().invoke(app, ["status", str(tmp_path / "out"), "--progress", str(page)])
    assert status.exit_code == 0, status.output
    shown = [f"{k}={expected[k]}" for k in CLIP_KEYS]
    assert all(s in status.stdout for s in shown) and all(s in page.read_text() for s in shown)

    # A rerun that finds the output done reports the same figures from the manifest, and warns again.
    again_reporter = Reporter()
    again = tokenize(source, tmp_path / "out", config(thinking="on", held_out_fraction=0.3, max_length=MAX_LENGTH),
                     again_reporter)
    assert again.already_done and clip_counts(again.details.counts) == expected
    assert [w for w in again_reporter.warnings if "max_length" in w] == [warning]


def test_the_warning_comes_only_above_one_percent_of_rows(tmp_path):
    max_length = 80  # above every short row (at most 69 tokens), below the long single-turn ones (98 and more)
    for n_long in (1, 2):
        rows = [conversation(i) for i in range(100 - n_long)] + [
            long_conversation(i, turns=1, words=30) for i in range(n_long)
        ]
        source = write_jsonl(tmp_path / f"in-{n_long}.jsonl", rows)
        tokenize(source, tmp_path / f"whole-{n_long}", config(thinking="on", max_length=WHOLE))
        reporter = Reporter()
        result = tokenize(source, tmp_path / f"out-{n_long}", config(thinking="on", max_length=max_length), reporter)
        expected = expected_clipping(tmp_path / f"whole-{n_long}", tmp_path / f"out-{n_long}", max_length)
        assert result.details.counts["rows_out"] == 100 and expected["rows_clipped"] == n_long
        assert clip_counts(result.details.counts) == expected
        warnings = [w for w in reporter.warnings if "max_length" in w]
        if n_long == 1:  # exactly 1%: counted and shown, not warned about
            assert warnings == [] and not any("max_length" in w for w in result.details.warnings)
            assert any(
                line.startswith(f"  clipped to tokenize.max_length {max_length}: rows 1;")
                for line in summary_lines(result)
            )
        else:
            assert warnings == [clip_warning(result.details.counts, max_length)] and warnings[0].startswith(
                "2 of 100 rows (2.0%)"
            )
    # An output with no rows at all has nothing to warn about.
    assert clip_warning({"rows_out": 0, "rows_clipped": 0}, 4096) is None


def test_clip_counts_add_up_across_workers_and_resumed_shards(tmp_path):
    corpus = tmp_path / "in"
    for f in range(3):  # three shards, each with long multi-turn rows
        write_jsonl(corpus / f"part-{f:02d}.jsonl", [*LONG[2 * f : 2 * f + 2], conversation(f, turns=2), TOO_LONG])
    tokenize(corpus, tmp_path / "whole", config(thinking="on", held_out_fraction=0.0, max_length=WHOLE))
    cfg = config(thinking="on", held_out_fraction=0.0, max_length=MAX_LENGTH, workers=2)
    out = tmp_path / "out"
    first = tokenize(corpus, out, cfg)
    expected = expected_clipping(tmp_path / "whole", out, MAX_LENGTH)
    assert expected["rows_clipped"] == 12 and len(first.details.worker_seconds) == 3
    assert clip_counts(first.details.counts) == expected
    pieces = {p.stem: json.loads(p.read_text())["counts"]["stats"] for p in sorted((out / PIECES_DIR).glob("*.json"))}
    assert {k: sum(s[k] for s in pieces.values()) for k in CLIP_KEYS} == expected and len(pieces) == 3

    # Killed before shard 1 finished: the rerun keeps shards 0 and 2 and adds their recorded counts to shard 1's.
    half_finished(out, "shard-00001")
    resumed = tokenize(corpus, out, config(thinking="on", held_out_fraction=0.0, max_length=MAX_LENGTH))
    assert resumed.details.shards_skipped == 2 and clip_counts(resumed.details.counts) == expected
    assert clip_counts(read_manifest(open_store(out))[0].counts) == expected

