"""Resume and fault tolerance, in one room (docs/FAULT_TOLERANCE.md): the checkpoints a resume can trust and the one
every rank loads (checkpoints.py), the exact continuation of a run (exact.py), the learning rates of a resume on
another global batch or length (lr_plan.py), the guards the CLI adds to every run (preemption.py, non_finite.py,
curves.py; `fault_callbacks` below) and what they share (faults.py).

The Lightning internals this room reads, each named with its reason in tests/test_internals.py's FENCE:
- `FitLoop._combined_loader_states_to_load`, `FitLoop._data_fetcher` (exact.py): the restored loader position,
  applied to a fresh iterator;
- `_TrainingEpochLoop._should_check_val_fx` (exact.py): whether a validation follows this batch;
- `ModelCheckpoint._last_global_step_saved` (exact.py): the step each ModelCheckpoint last saved at;
- `Trainer._run` (training/trainer.py): the ranks agree on the resume checkpoint between the process group's start
  and the first read.
"""

from training.resume.curves import CurvesAcrossResumes
from training.resume.exact import ExactResume
from training.resume.lr_plan import LrPlanAcrossResumes
from training.resume.non_finite import NonFiniteLossGuard
from training.resume.preemption import Preemption

__all__ = ["CurvesAcrossResumes", "ExactResume", "LrPlanAcrossResumes", "NonFiniteLossGuard", "Preemption"]


def fault_callbacks() -> list:
    """The fault guards the CLI adds to every run, after the configured callbacks (LrPlanAcrossResumes after
    ExactResume, whose restart of an epoch on another world size the resumed length counts)."""
    return [ExactResume(), LrPlanAcrossResumes(), Preemption(), NonFiniteLossGuard(), CurvesAcrossResumes()]
