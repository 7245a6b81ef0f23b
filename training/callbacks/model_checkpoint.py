"""A run's checkpoints, set by its own key (`Checkpointing`, the `checkpoint:` of every config), as the CLI adds them:
ModelCheckpoint, whose last.ckpt is the state at the end of every validation (a hard link where it can be), and
StepCheckpoint, the crash-recovery saves every N steps that write nothing where that last.ckpt holds the same step.

    checkpoint:
      monitor: val/map
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.trainer.states import TrainerFn

from core.config_types import NonNegativeInt, check_arguments


@dataclass(frozen=True)
class Checkpointing:
    """The run's checkpoints in <run>/checkpoints: the best k by a metric and last.ckpt at every validation
    (`ModelCheckpoint`), and a step checkpoint every N steps (`StepCheckpoint`). A ModelCheckpoint listed in
    trainer.callbacks is another, the user's own, beside these."""

    monitor: str = "val/acc"
    """The metric that ranks the best checkpoints (multi-label: val/map); it names their files."""
    mode: Literal["max", "min"] = "max"
    """max: a higher monitored value is better; min: a lower one (a loss)."""
    save_top_k: NonNegativeInt = 2
    """The best checkpoints kept, besides last.ckpt; 0: none."""
    save_last: bool = True
    """last.ckpt at the end of every validation, what a resume continues from; false: none."""
    every_n_train_steps: NonNegativeInt = 100
    """A step checkpoint every this many optimizer steps (only the newest kept): a kill loses at most as many steps;
    0: none. Raise it where a save costs more."""

    def __post_init__(self) -> None:
        check_arguments("checkpoint", Checkpointing, asdict(self))

    def callbacks(self, folder: Path) -> list[lightning_callbacks.ModelCheckpoint]:
        """The callbacks that keep these checkpoints in `folder` (none for what is 0 or false)."""
        kept = []
        if self.save_top_k or self.save_last:
            kept.append(ModelCheckpoint(
                dirpath=folder, filename=f"epoch{{epoch:03d}}-{self.monitor.replace('/', '_')}{{{self.monitor}:.4f}}",
                auto_insert_metric_name=False, monitor=self.monitor, mode=self.mode, save_top_k=self.save_top_k,
                save_last=self.save_last))
        if self.every_n_train_steps:
            kept.append(StepCheckpoint(dirpath=folder, filename="step{step:07d}", auto_insert_metric_name=False,
                                       every_n_train_steps=self.every_n_train_steps, save_top_k=1, save_last=False))
        return kept


class ModelCheckpoint(lightning_callbacks.ModelCheckpoint):
    """Lightning's ModelCheckpoint, whose `last.ckpt` is the state at the end of every validation, a hard link to the
    best-k file of the same step when there is one (why Lightning's own last.ckpt is not enough:
    docs/FAULT_TOLERANCE.md, "Checkpoint integrity"). Linking needs a CheckpointIO with `link_checkpoint` (this
    module's); else last.ckpt is written."""

    validated_step: int | None = None  # the global step of this fit's newest validation, in this process
    validated: dict[str, dict] | None = None  # a saved file -> {step, metrics} of the validation of its weights

    @property
    def state_key(self) -> str:
        # Lightning's key (class, monitor, mode, intervals) refuses a second callback of the same settings: the file
        # names tell the run's from a user's own that ranks by the same metric.
        return f"{super().state_key}[{self.filename}]"

    # Lightning saves at the end of the training epoch when validation runs once per epoch (inside that epoch), else
    # at the end of each validation; last.ckpt follows in the same hook when nothing was saved at this step yet.
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._save_last_if_missed(trainer, on_epoch_end=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.validated_step = trainer.global_step
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_missed(trainer, on_epoch_end=False)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # Noted before the write, so that the file holds its own entry (state_dict): a resumed fit knows it too.
        if self.validated_step == trainer.global_step:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if getattr(v, "numel", lambda: 1)() == 1}
            self.validated = {**self._kept(), filepath: {"step": trainer.global_step, "metrics": metrics}}
        super()._save_checkpoint(trainer, filepath)

    def _kept(self) -> dict[str, dict]:
        """The entries of the files this callback still keeps: the best k and last.ckpt."""
        keep = {*self.best_k_models, self.best_model_path, self.last_model_path}
        return {path: entry for path, entry in (self.validated or {}).items() if path in keep}

    def best_validation(self) -> dict | None:
        """{step, metrics} of the validation of the best checkpoint's weights, run in this fit or the one it resumed
        (validating the file again would only repeat them); None where this callback did not see it."""
        return (self.validated or {}).get(self.best_model_path)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "validated": self._kept()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.validated = state_dict.get("validated")
        # A best-k file is written before last.ckpt is linked to it, so its state (and last.ckpt's, the same file)
        # can name no last checkpoint yet. A fit resumed in the same folder continues that run and replaces its
        # last.ckpt; Lightning, finding the file unnamed, wrote last-v1.ckpt beside it, as beside another run's.
        same_run = state_dict.get("dirpath", self.dirpath) == self.dirpath
        if self.save_last is True and same_run and "{" not in self.CHECKPOINT_NAME_LAST:
            self.last_model_path = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)

    def _save_last_if_missed(self, trainer, *, on_epoch_end: bool) -> None:
        if (self.save_last is True and not self.skips(trainer)
                and self._should_save_on_train_epoch_end(trainer) == on_epoch_end):
            self._save_last_checkpoint(trainer, monitor_candidates(trainer))

    def skips(self, trainer) -> bool:
        """Whether this callback saves nothing now: not fitting, a sanity check or fast_dev_run, or saved at this
        step already."""
        return (bool(trainer.fast_dev_run) or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or self._last_global_step_saved == trainer.global_step)

    def _save_last_checkpoint(self, trainer, monitor_candidates: dict) -> None:
        io = trainer.strategy.checkpoint_io
        fresh = self._last_checkpoint_saved and self._last_global_step_saved == trainer.global_step
        # A sharded checkpoint (a folder, training.distributed.fsdp) is written by the strategy, not by the
        # CheckpointIO: in full.
        sharded = fresh and Path(self._last_checkpoint_saved).is_dir()
        if self.save_last is not True or not fresh or sharded or not hasattr(io, "link_checkpoint"):
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        previous, self.last_model_path = self.last_model_path, path
        if trainer.is_global_zero:
            io.link_checkpoint(self._last_checkpoint_saved, path)
        trainer.strategy.barrier()
        if previous and previous != path and self.owns(trainer, previous):
            trainer.strategy.remove_checkpoint(previous)

    def owns(self, trainer, path: str) -> bool:
        """Whether `path` is a file of this callback's folder that it may replace: not the one the fit resumed from."""
        path = Path(path).absolute()
        if trainer.ckpt_path is not None and path == Path(trainer.ckpt_path).absolute():
            return False
        return Path(self.dirpath).absolute() in path.parents


class StepCheckpoint(lightning_callbacks.ModelCheckpoint):
    """Lightning's ModelCheckpoint for the saves every `every_n_train_steps` that bound what a kill loses, minus the
    ones that would repeat a checkpoint of the same step: at a step that a validation follows (an epoch's end), where
    the run's `ModelCheckpoint` (this module's, `save_last: true`) writes last.ckpt at that validation's end, it writes
    nothing, and its newest file stays. A kill still loses at most N steps: last.ckpt holds that step.

    ExactResume defers a step save at a batch that a validation follows until the validation has ended; the step
    validated last tells such a deferred save from one at a batch's end.
    """

    _validated_step: int | None = None  # the global step of this fit's newest validation

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._validated_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._validated_step == trainer.global_step and any(
                isinstance(c, ModelCheckpoint) and c.save_last is True for c in trainer.checkpoint_callbacks):
            return  # last.ckpt of this step is written at the end of the validation that just ran
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def monitor_candidates(trainer) -> dict[str, torch.Tensor]:
    """The values a checkpoint's file name may hold: the logged metrics, `epoch` and `step` (as ints)."""
    metrics = dict(trainer.callback_metrics)
    for key, value in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
        logged = metrics.get(key)
        metrics[key] = logged.int() if isinstance(logged, torch.Tensor) else torch.tensor(value)
    return metrics

