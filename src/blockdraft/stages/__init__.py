"""The pipeline's stages, one package each: generate, tokenize, train, eval, export.

Each exposes `run(config, input, output, reporter=None, *, force=False, **options) -> StageResult` (checked by
tests/test_architecture.py). A stage reads its input through `blockdraft.store.inputs.open_input` and writes its output
through `blockdraft.store.output.StageOutput`, so what a stage reports is what its destination holds. Stages import from
`model`, `decode`, `data`, `store` and `config`, never from one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockdraft.store.artifact import VerifyReport


@dataclass
class StageResult:
    """What one stage run left at its destination, as read back from there.

    `already_done`: the output was already there for this config and these inputs, so nothing ran. `seconds`: wall
    time of this call. `details`: the stage's own summary (counts, timings, metrics), typed by the stage.
    """

    stage: str
    url: str
    report: VerifyReport
    already_done: bool = False
    seconds: float = 0.0
    details: Any = None


__all__ = ["StageResult"]
