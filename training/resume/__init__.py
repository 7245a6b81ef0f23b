"""Resume and fault tolerance, in one room (docs/FAULT_TOLERANCE.md): why a resume was refused, and what makes one
exact.

- checkpoints.py: the checkpoints a resume can trust (atomic writes, safe loads, intact files) and the one a fit
  resumes from (`resolve_resume`);
- agreement.py: a fit's start on every rank (`AgreedResume`, the Trainer's base): rank 0 holds the run folder
  (hold.py: one writer per run), the ranks agree on rank 0's checkpoint before any of them reads one, then rank 0
  tidies the folders; a write that fails stops the fit in one line (disk.py);
- disk.py: the room a run's checkpoints need, checked at a fit's start (`DiskSpace`), and the line of a failed write;
- same_run.py: a fit continues a checkpoint only when it is the same run, unfinished (its refusals);
- exact.py: the exact continuation of a run (`ExactResume`);
- lr_plan.py: the model's learning-rate plan saved and restored on another global batch or length
  (`LrPlanAcrossResumes`);
- preemption.py, non_finite.py, curves.py: the guards the CLI adds to every run (`fault_callbacks` below), and what
  they share (faults.py).

The model and the DataModule keep only their own state, through Lightning's hooks (the DataModule's count of
training batches, its loaders' positions; the model's weights and metrics).

The Lightning internals this room reads; the private ones are each named with its reason in tests/test_internals.py's
FENCE:
- `FitLoop._combined_loader_states_to_load`, `FitLoop._data_fetcher` (exact.py): the restored loader position,
  applied to a fresh iterator;
- `_TrainingEpochLoop._should_check_val_fx` (exact.py): whether a validation follows this batch;
- `ModelCheckpoint._last_global_step_saved` (exact.py): the step each ModelCheckpoint last saved at;
- `Trainer._run` (agreement.py): the run folder is held, and the ranks agree on the resume checkpoint, between the
  process group's start and the first read;
- the loops' progress counters, `fit_loop.epoch_progress` and `fit_loop.epoch_loop.batch_progress` (exact.py,
  lr_plan.py): where in its epoch a resumed fit starts;
- `trainer.lr_scheduler_configs` (lr_plan.py): the restored scheduler, replaced by the re-planned one;
- the checkpoint's layout, `optimizer_states` and `lr_schedulers` (lr_plan.py: the rates rescaled in them);
- the order of Lightning's hooks: a callback's `on_load_checkpoint` runs before the optimizer and scheduler states are
  loaded (lr_plan.py rescales them there), its `on_train_start` after the loops and those states are restored
  (exact.py, then lr_plan.py, in `fault_callbacks`'s order).
"""

from training.resume.curves import CurvesAcrossResumes
from training.resume.disk import DiskSpace
from training.resume.exact import ExactResume
from training.resume.lr_plan import LrPlanAcrossResumes
from training.resume.non_finite import NonFiniteLossGuard
from training.resume.preemption import Preemption

__all__ = ["CurvesAcrossResumes", "DiskSpace", "ExactResume", "LrPlanAcrossResumes", "NonFiniteLossGuard", "Preemption"]


def fault_callbacks() -> list:
    """The fault guards the CLI adds to every run, after the configured callbacks (LrPlanAcrossResumes after
    ExactResume, whose restart of an epoch on another world size the resumed length counts)."""
    return [ExactResume(), LrPlanAcrossResumes(), Preemption(), NonFiniteLossGuard(), CurvesAcrossResumes(),
            DiskSpace()]
