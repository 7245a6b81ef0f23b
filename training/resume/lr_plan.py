"""LrPlanAcrossResumes: a resumed fit's learning rates follow its own global batch and its own length.

The model's learning-rate plan (`ImageClassifier.lr_plan`, lightning_modules/lr_plan.py) scales the optimizer's lr to
the global batch and builds the scheduler for the run's length. Lightning then loads the checkpoint's optimizer and
scheduler states over what it built, and those carry the saved run's scale and length. This callback saves both in
every checkpoint of a fit (`lr_scale`, `lr_plan`) and, on a resume:

- on another global batch (another world size after an elastic restart, other accumulation), multiplies every learning
  rate the checkpoint's optimizer and scheduler states carry by the ratio of the two scales, before Lightning loads
  them, and says so in one line;
- on another length (max_epochs, max_steps, batch size, world size, accumulation or limit_train_batches), builds the
  scheduler anew for the new length and steps it to the resume step, the lr a fit planned that long from its start has
  there, so it ends at its end value on the run's last step; one line says so. A scheduler that takes no total_steps
  continues as saved, also said in one line.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

# The learning rates an optimizer's param groups and a scheduler's state carry (OneCycleLR: max_lr and min_lr in the
# groups; CyclicLR: max_lrs; ReduceLROnPlateau: min_lrs; CosineAnnealingLR: eta_min), rescaled on a resume.
LR_KEYS = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min"})


@runtime_checkable
class ResumablePlan(Protocol):
    """What a resume asks of a model's `lr_plan` (lightning_modules.lr_plan.LrPlan is one); a model without one is
    left alone."""

    lr_scaling: str  # named in the rescaling line
    total_steps: int | None  # the length the schedule follows: saved, and set to the resumed fit's

    def global_batch(self, trainer) -> tuple[int, int, int]: ...  # (world size, per-device batch, accumulation)

    def scale(self, trainer) -> float: ...  # the optimizer's lr (per 256 images) -> the lr used at this global batch

    def length(self, trainer) -> tuple[int, int]: ...  # (steps of a fit from its start, steps per epoch)

    def replanned(self, optimizer, trainer, *, step: int, total_steps: int, steps_per_epoch: int): ...

    def name_of(self, scheduler) -> str: ...


class LrPlanAcrossResumes(Callback):
    """Saves the model's learning-rate plan in every checkpoint and restores it on a resume (see the module)."""

    def __init__(self) -> None:
        self._saved: tuple[dict | None, int] = (None, 0)  # the checkpoint's lr_plan and global step, until train start

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        plan = plan_of(pl_module)
        if plan is None:
            return
        checkpoint["lr_scale"] = plan.scale(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            checkpoint["lr_plan"] = {"total_steps": plan.total_steps or plan.length(trainer)[0]}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # Lightning calls this before it loads the optimizer and scheduler states from `checkpoint`.
        plan = plan_of(pl_module)
        if plan is None:
            return
        self._saved = (checkpoint.get("lr_plan"), checkpoint.get("global_step", 0))
        saved = checkpoint.get("lr_scale")
        if saved is None or trainer.state.fn != TrainerFn.FITTING:
            return
        factor = plan.scale(trainer) / saved
        if math.isclose(factor, 1.0):
            return
        rescale_learning_rates(checkpoint, factor)
        world, batch, accumulate = plan.global_batch(trainer)
        rank_zero_info(f"resuming on a global batch of {world} x {batch} x {accumulate}: learning rates rescaled "
                       f"x{factor:.4g} ({plan.lr_scaling} scaling: {saved:.4g} -> {plan.scale(trainer):.4g} per the lr "
                       "of 256 images)")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After ExactResume's on_train_start, which restarts an epoch on another world size (resumed_length counts it).
        (saved, step), self._saved = self._saved, (None, 0)
        plan = plan_of(pl_module)
        if plan is None or saved is None:
            return
        total_steps, steps_per_epoch = plan.length(trainer)
        plan.total_steps = resumed_length(trainer, steps_per_epoch) or total_steps
        if saved["total_steps"] == plan.total_steps:
            return
        config = trainer.lr_scheduler_configs[0]
        change = f"lr schedule: {saved['total_steps']} -> {plan.total_steps} optimizer steps"
        scheduler = plan.replanned(config.scheduler.optimizer, trainer, step=step, total_steps=plan.total_steps,
                                   steps_per_epoch=steps_per_epoch)
        if scheduler is None:
            rank_zero_info(f"{change}; {plan.name_of(config.scheduler)} takes no total_steps, so it continues as saved")
            return
        config.scheduler = scheduler
        rank_zero_info(f"{change}; {plan.name_of(scheduler)} follows the new length from step {step}")


def plan_of(pl_module: LightningModule) -> ResumablePlan | None:
    plan = getattr(pl_module, "lr_plan", None)
    return plan if isinstance(plan, ResumablePlan) else None


def resumed_length(trainer: Trainer, steps_per_epoch: int) -> int | None:
    """The optimizer steps a resumed fit will have taken at its end, once its checkpoint and data position are
    restored (at train start): those taken, the rest of the epoch in progress (all of it where the epoch restarts on
    another world size) and `steps_per_epoch` for each later epoch; None for a run set by max_steps alone.
    Lightning's estimate, max_epochs x the steps of an epoch now, is wrong once an epoch's steps changed (another batch
    size or world size): the schedule would end early and train the last epochs at lr 0, or end above it."""
    loop, max_epochs = trainer.fit_loop, trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or not math.isfinite(trainer.num_training_batches):
        return None
    epochs = loop.epoch_progress.current
    if epochs.started > epochs.processed:  # saved inside an epoch, which goes on from the batches it has done
        done = loop.epoch_loop.batch_progress.current.processed  # an optimizer step each `accumulate` and at the end
        this = steps_per_epoch - done // trainer.accumulate_grad_batches if done < trainer.num_training_batches else 0
    else:
        this = steps_per_epoch
    later = max(0, max_epochs - trainer.current_epoch - 1) * steps_per_epoch
    total = trainer.global_step + (this + later if trainer.current_epoch < max_epochs else 0)
    return max(1, min(total, trainer.max_steps) if trainer.max_steps >= 0 else total)


def rescale_learning_rates(checkpoint: dict, factor: float) -> None:
    """Multiply every learning rate a checkpoint's optimizer and scheduler states carry by `factor`, in place: each
    of LR_KEYS in the param groups and the scheduler states, nested schedulers (SequentialLR's) included."""
    for state in checkpoint.get("optimizer_states", []):
        for group in state["param_groups"]:
            _rescale(group, factor)
    for state in checkpoint.get("lr_schedulers", []):
        _rescale(state, factor)


def _rescale(state: dict, factor: float) -> None:
    for key, value in state.items():
        if key in LR_KEYS and isinstance(value, int | float | torch.Tensor) and not isinstance(value, bool):
            state[key] = value * factor
        elif key in LR_KEYS and isinstance(value, list | tuple):
            state[key] = type(value)(v * factor for v in value)
        elif key == "_schedulers":  # SequentialLR, ChainedScheduler: their schedulers' states
            for inner in value:
                _rescale(inner, factor)
