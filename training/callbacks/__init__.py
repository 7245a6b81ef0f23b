"""The callbacks a config names (`trainer.callbacks`), one small module each. The fault guards the CLI adds to every
run are in training/resume/; docs/DESIGN.md, "Callbacks", lists every callback a run has."""

from training.callbacks.checkpoint import ModelCheckpoint, StepCheckpoint
from training.callbacks.ema import EMA
from training.callbacks.figures import ValidationFigures
from training.callbacks.freezing import FreezeBackbone
from training.callbacks.predictions import PredictionWriter
from training.callbacks.run_config import RunConfig

__all__ = ["EMA", "FreezeBackbone", "ModelCheckpoint", "PredictionWriter", "RunConfig", "StepCheckpoint",
           "ValidationFigures"]
