"""The `generate` stage: `run(config, input, output, reporter) -> StageResult` with a `GenerateSummary` as its
details."""

from __future__ import annotations

from blockdraft.stages.generate.shards import SHARDS_DIR
from blockdraft.stages.generate.stage import FAILURES_NAME, KIND, SETTINGS_NAME, GenerateSummary, run, summary_lines

__all__ = ["FAILURES_NAME", "KIND", "SETTINGS_NAME", "SHARDS_DIR", "GenerateSummary", "run", "summary_lines"]
