"""What a tokenize run reports: its summary (the `details` of its StageResult) and the lines that tell a person about
it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from blockdraft.errors import ArtifactError, first_few
from blockdraft.stages import StageResult
from blockdraft.stages.tokenize.shard import CLIP_KEYS

COUNT_KEYS = ("rows_in", "turns_in", "rows_out", "train_rows", "held_out_rows", "tokens", "supervised_tokens",
              "rejected_rows", "rejected_turns", *CLIP_KEYS, "input_files_failed")


@dataclass
class TokenizeSummary:
    """What a tokenize run left at the destination beyond its report: the manifest's counts, shards and template.

    A shard is one task: an input file, or a part of a large one (`input_files` files in `shards_total` shards).
    `shards_skipped`: shards kept from an earlier run (all of them when the output was already done). `max_length`: the
    `tokenize.max_length` rows were clipped to (`counts` says how many and what it cut off). Timings (seconds)
    are of this call: `shard_phase_seconds` wall time of the shards it ran; per shard it ran, `worker_seconds` (wall)
    and `worker_cpu_seconds` (CPU) inside the worker and `worker_peak_rss_mib`, that worker's peak resident memory; per
    worker process that ran shards (by pid), `process_cpu_seconds`, the CPU seconds of its shards.
    """

    counts: dict[str, Any]
    shards_total: int
    shards_skipped: int
    template_sha256: str
    template_matches_target: bool | None
    warnings: list[str] = field(default_factory=list)
    max_length: int = 0
    shard_phase_seconds: float = 0.0
    worker_seconds: list[float] = field(default_factory=list)
    worker_cpu_seconds: list[float] = field(default_factory=list)
    worker_peak_rss_mib: list[float] = field(default_factory=list)
    input_files: int = 0
    process_cpu_seconds: dict[int, float] = field(default_factory=dict)


class InputFilesFailed(ArtifactError):
    """Input files that could not be decoded whole were left out of a committed artifact; `result` is that run's result
    (its manifest names them under `counts.failed_inputs`)."""

    def __init__(self, result: StageResult) -> None:
        failed: dict[str, Any] = result.details.counts.get("failed_inputs", {})
        causes = first_few([f"{key}: {f['reason']} ({f['detail']})" for key, f in sorted(failed.items())],
                           "the manifest's counts.failed_inputs lists them all")
        super().__init__(
            f"{len(failed)} of {result.details.input_files} input files could not be read whole and were left out of "
            f"the artifact at {result.url} (its manifest lists them under counts.failed_inputs, the quarantine holds a "
            f"line each): {causes}; replace or remove them and rerun (the other files' shards are kept)"
        )
        self.result = result


def merge_counts(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' row statistics summed: every count in COUNT_KEYS, and rejections by reason, rows by thinking mode;
    and the input files left out whole, by key (`failed_inputs`: reason, detail, rows read before the fault)."""
    total: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    thinking: Counter[str] = Counter()
    failed: dict[str, Any] = {}
    for s in stats:
        c = dict(s)
        rejected.update(c.pop("rejected"))
        thinking.update(c.pop("thinking"))
        failed.update(c.pop("failed_inputs"))
        total.update(c)
    return {**{k: total.get(k, 0) for k in COUNT_KEYS}, "rejected": dict(sorted(rejected.items())),
            "thinking": dict(sorted(thinking.items())), "failed_inputs": dict(sorted(failed.items()))}


def clip_warning(counts: dict[str, Any], max_length: int) -> str | None:
    """The one warning line when more than 1% of the rows written were clipped to `max_length`, else None."""
    rows, clipped = counts.get("rows_out", 0), counts.get("rows_clipped", 0)
    if clipped * 100 <= rows:
        return None
    dropped = counts.get("supervised_tokens_clipped", 0)
    supervised = counts.get("supervised_tokens", 0) + dropped  # before clipping
    return (
        f"{clipped:,} of {rows:,} rows ({100 * clipped / rows:.1f}%) were longer than tokenize.max_length {max_length} "
        f"and were clipped, dropping {counts.get('tokens_clipped', 0):,} tokens of which {dropped:,} supervised "
        f"({100 * dropped / max(supervised, 1):.1f}% of all supervised tokens); raise tokenize.max_length "
        "(--max-length) to keep them whole"
    )


def summary_lines(result: StageResult) -> list[str]:
    """The counts, and what was read back and verified at the destination (never what a worker claimed)."""
    summary: TokenizeSummary = result.details
    c = summary.counts
    report = result.report
    lines = []
    if result.already_done:
        lines.append("nothing to do: the output is already a verified artifact of this config and these inputs")
    lines += [
        f"{report.state.value} at {result.url}: {report.summary()} (manifest "
        f"{report.manifest_sha256[:12] if report.manifest_sha256 else '-'})",
        f"  conversations in {c.get('rows_in', 0):,}; rows out {c.get('rows_out', 0):,} "
        f"(train {c.get('train_rows', 0):,}, held-out {c.get('held_out_rows', 0):,}); "
        f"tokens {c.get('tokens', 0):,}, supervised {c.get('supervised_tokens', 0):,}",
        f"  thinking mode per row: {', '.join(f'{k} {v:,}' for k, v in c.get('thinking', {}).items()) or '-'}; "
        f"template sha256 {summary.template_sha256[:12]}",
    ]
    lines.append(f"  clipped to tokenize.max_length {summary.max_length}: rows {c['rows_clipped']:,}; tokens dropped "
                 f"{c['tokens_clipped']:,}, of them supervised {c['supervised_tokens_clipped']:,}")
    rejected = c.get("rejected", {})
    if rejected:
        reasons = ", ".join(f"{k} {v:,}" for k, v in rejected.items())
        lines.append(f"  rejected {sum(rejected.values()):,} (quarantine/*.jsonl): {reasons}")
    failed = c.get("failed_inputs", {})
    if failed:
        files = ", ".join(f"{key} ({f['reason']})" for key, f in sorted(failed.items()))
        lines.append(f"  input files left out, not readable whole {len(failed)}: {files}")
    lines.append(f"  shards {summary.shards_total} from {summary.input_files} input files ({summary.shards_skipped} "
                 f"resumed from matching records); {result.seconds:.1f} s")
    lines += [f"  WARNING: {message}" for message in summary.warnings]
    return lines
