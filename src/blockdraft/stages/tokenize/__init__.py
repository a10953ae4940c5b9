"""The `tokenize` stage: `run(config, input, output, reporter) -> StageResult` with a `TokenizeSummary` as its details;
`InputFilesFailed` (with that result) when input files could not be read whole."""

from __future__ import annotations

from blockdraft.stages.tokenize.report import InputFilesFailed, TokenizeSummary, summary_lines
from blockdraft.stages.tokenize.resume import finished_shard_entries
from blockdraft.stages.tokenize.stage import run

__all__ = ["InputFilesFailed", "TokenizeSummary", "finished_shard_entries", "run", "summary_lines"]
