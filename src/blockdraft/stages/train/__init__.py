"""The train stage: `run(config, input, output, reporter) -> StageResult` (details: TrainResult). The `blockdraft train`
command starts it through `blockdraft.stages.train.launch.launch`, which starts torchrun for several drafter devices."""

from blockdraft.stages.train.checkpoint import resolved_training_config, save_checkpoint
from blockdraft.stages.train.stage import TrainResult, run

__all__ = ["TrainResult", "resolved_training_config", "run", "save_checkpoint"]
