"""The eval stage: `run(config, input, output, reporter, *, prompts, max_new_tokens) -> StageResult` with an
`EvalReport` as its details; `summary_lines` is what the CLI prints of one."""

from __future__ import annotations

from blockdraft.stages.eval.metrics import (
    Divergence,
    DrafterMetrics,
    GreedyMetrics,
    divergence_tolerance,
    first_divergence,
)
from blockdraft.stages.eval.report import REPORT_NAME, EvalReport, Lossless, PromptRow, summary_lines
from blockdraft.stages.eval.stage import KIND, evaluate, run

__all__ = [
    "KIND", "REPORT_NAME", "Divergence", "DrafterMetrics", "EvalReport", "GreedyMetrics", "Lossless", "PromptRow",
    "divergence_tolerance", "evaluate", "first_divergence", "run", "summary_lines",
]
