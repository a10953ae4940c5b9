"""The train stage: `run(config, input, output, reporter) -> StageResult` (details: TrainResult); `launch` is the
`blockdraft train` command's entry, which starts torchrun for several drafter devices."""

from blockdraft.stages.train.checkpoint import resolved_training_config, save_checkpoint
from blockdraft.stages.train.launch import Launched, launch
from blockdraft.stages.train.stage import TrainResult, run

__all__ = ["Launched", "TrainResult", "launch", "resolved_training_config", "run", "save_checkpoint"]
