"""Every callback class of imgcls, one small module each. A run's callbacks, including those the CLI adds without
showing them in `--print_config`, are listed in docs/DESIGN.md, "Callbacks"."""

from training.callbacks.checkpoint import ModelCheckpoint
from training.callbacks.curves import CurvesAcrossResumes
from training.callbacks.exact_resume import ExactResume
from training.callbacks.figures import ValidationFigures
from training.callbacks.freezing import FreezeBackbone
from training.callbacks.non_finite import NonFiniteLossGuard
from training.callbacks.predictions import PredictionWriter
from training.callbacks.preemption import Preemption
from training.callbacks.run_config import RunConfig

__all__ = ["CurvesAcrossResumes", "ExactResume", "FreezeBackbone", "ModelCheckpoint", "NonFiniteLossGuard",
           "PredictionWriter", "Preemption", "RunConfig", "ValidationFigures"]
