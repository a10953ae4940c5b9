"""The export stage: `run(config, input, output, reporter, *, force, eval) -> StageResult` with an `ExportResult`
(serving settings, provenance) as its details; `export_drafter` writes a drafter held in memory as an export;
`rewrite_card` writes an existing export's model card again."""

from __future__ import annotations

from blockdraft.stages.export.card import CARD_NAME
from blockdraft.stages.export.stage import (
    SERVING_NAME,
    ExportResult,
    export_drafter,
    rewrite_card,
    run,
    serving_lines,
    serving_settings,
)

__all__ = ["CARD_NAME", "SERVING_NAME", "ExportResult", "export_drafter", "rewrite_card", "run", "serving_lines",
           "serving_settings"]
