"""The training loop and the wiring of a whole job."""

from llmtrain.training.run import run
from llmtrain.training.trainer import Trainer, TrainingDiverged, TrainResult

__all__ = ["TrainResult", "Trainer", "TrainingDiverged", "run"]
