"""The export stage: `run(config, input, output, reporter, *, target) -> StageResult` with an `ExportResult` (serving
settings, provenance) as its details; `export_drafter` writes a drafter held in memory as an export."""

from __future__ import annotations

from blockdraft.stages.export.stage import SERVING_NAME, ExportResult, export_drafter, run, serving_lines, serving_settings

__all__ = ["SERVING_NAME", "ExportResult", "export_drafter", "run", "serving_lines", "serving_settings"]
