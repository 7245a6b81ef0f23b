"""The callbacks a config names (`trainer.callbacks`, or a key of their own: `checkpoint`, `freeze`), one small module
each. The fault guards the CLI adds to every run are in training/resume/; docs/DESIGN.md, "Callbacks", lists every
callback a run has."""

from training.callbacks.ema import EMA
from training.callbacks.freezing import FreezeBackbone
from training.callbacks.model_checkpoint import ModelCheckpoint, StepCheckpoint
from training.callbacks.prediction_writer import PredictionWriter
from training.callbacks.run_config import RunConfig
from training.callbacks.validation_figures import ValidationFigures

__all__ = ["EMA", "FreezeBackbone", "ModelCheckpoint", "PredictionWriter", "RunConfig", "StepCheckpoint",
           "ValidationFigures"]
