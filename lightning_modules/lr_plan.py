"""The learning-rate plan of a fit, `ImageClassifier.lr_plan`: the optimizer's lr, given per 256 images, scaled to the
global batch (world size x per-device batch x accumulation) and per param group, and the scheduler built for the
run's length. The model asks it in `configure_optimizers`; a resume restores it (`training.resume.LrPlanAcrossResumes`:
the saved rates rescaled to another global batch, the schedule re-planned for another length)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_modules.optim import unset_arguments
from lightning_modules.schedules import WarmupCosine
from lightning_modules.settings import LrScaling


class LrPlan:
    """How a fit's learning rates follow its global batch and its length.

    Args:
        scheduler: `model.lr_scheduler`, a callable optimizer -> LRScheduler, given the run's length where it takes it.
        lr_scaling: `model.recipe.lr_scaling`: the optimizer's lr (per 256 images) times global batch / 256 (linear),
            its square root (sqrt) or 1 (none).
        backbone_lr_ratio: `model.recipe.backbone_lr_ratio`: the backbone groups' lr / the head's.
        batch_size: images per device and step (`model.batch_size`, linked from the DataModule).
    """

    def __init__(self, scheduler: Callable, *, lr_scaling: LrScaling, backbone_lr_ratio: float,
                 batch_size: int) -> None:
        self.scheduler_factory = scheduler
        self.lr_scaling, self.backbone_lr_ratio, self.batch_size = lr_scaling, backbone_lr_ratio, batch_size
        self.total_steps: int | None = None  # the length the schedule follows: this fit's, or re-planned on a resume

    def global_batch(self, trainer) -> tuple[int, int, int]:
        """(world size, per-device batch, accumulation); without a Trainer: one process that does not accumulate."""
        if trainer is None:
            return 1, self.batch_size, 1
        return trainer.world_size, self.batch_size, trainer.accumulate_grad_batches

    def scale(self, trainer) -> float:
        """Multiplier from the optimizer's lr (per 256 images) to the learning rate actually used."""
        ratio = math.prod(self.global_batch(trainer)) / 256
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_scaling]

    def multipliers(self, trainer, groups: list[dict]) -> list[float]:
        """Per param group: the scale, times backbone_lr_ratio for the backbone's."""
        return [self.scale(trainer) * (1.0 if g["is_head"] else self.backbone_lr_ratio) for g in groups]

    def scale_groups(self, optimizer: torch.optim.Optimizer, trainer) -> torch.optim.Optimizer:
        """Each group's lr (per 256 images) times its multiplier: the peak rates a scheduler then starts from."""
        for group, multiplier in zip(optimizer.param_groups, self.multipliers(trainer, optimizer.param_groups),
                                     strict=True):
            group["lr"] = group["lr"] * multiplier
        return optimizer

    def length(self, trainer) -> tuple[int, int]:
        """(optimizer steps of a fit from its start, optimizer steps per epoch); a resumed fit's own length is the
        resume's (training/resume/lr_plan.py)."""
        total_steps = max(1, int(trainer.estimated_stepping_batches))
        # Optimizer steps per epoch from the loader, not total_steps / max_epochs: with max_steps and no max_epochs,
        # "epoch" would be the whole run, and warm-up with it.
        if trainer.train_dataloader is None and trainer.state.fn == "fit":
            trainer.fit_loop.setup_data()  # max_steps runs: estimated_stepping_batches does not build it
        batches, epochs = trainer.num_training_batches, trainer.max_epochs
        if math.isfinite(batches):
            per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
        else:  # no loader yet (an iterable of unknown length): the configured epochs
            per_epoch = total_steps // epochs if epochs and epochs > 0 else total_steps
        return total_steps, max(1, min(total_steps, per_epoch))

    def scheduler(self, optimizer: torch.optim.Optimizer, trainer, optimizer_name: str):
        """`model.lr_scheduler` over the scaled `optimizer` for this fit's length, announced in one line with the
        peak lr and how it was scaled."""
        multipliers = self.multipliers(trainer, optimizer.param_groups)
        head = next(i for i, g in enumerate(optimizer.param_groups) if g["is_head"])
        peak = optimizer.param_groups[head]["lr"]  # read before the scheduler sets the first step's rate
        self.total_steps, steps_per_epoch = self.length(trainer)
        scheduler = self.build(optimizer, trainer, total_steps=self.total_steps, steps_per_epoch=steps_per_epoch)
        warmup = getattr(scheduler, "warmup_steps", None)
        world, batch, accumulate = self.global_batch(trainer)
        rank_zero_info(
            f"{optimizer_name} lr {peak / multipliers[head]:g} per 256 images x {self.scale(trainer):.4g} "
            f"({self.lr_scaling} scaling, global batch {world} x {batch} x {accumulate}) = {peak:.4g} for the head "
            f"(peak); {type(scheduler).__name__} over {self.total_steps} steps"
            + (f", {warmup} of warm-up" if warmup else ""))
        return scheduler

    def build(self, optimizer: torch.optim.Optimizer, trainer, *, total_steps: int, steps_per_epoch: int):
        """`model.lr_scheduler(optimizer)`, given the run's length where it takes it; an absolute `max_lr` the config
        gave (OneCycleLR's) is per 256 images like the optimizer's lr: multiplied per group as the groups' lrs were."""
        length = {"total_steps": total_steps, "steps_per_epoch": steps_per_epoch}
        extra = unset_arguments(self.scheduler_factory, length)
        max_lr = (getattr(self.scheduler_factory, "keywords", None) or {}).get("max_lr")
        if max_lr is not None:
            multipliers = self.multipliers(trainer, optimizer.param_groups)
            peaks = max_lr if isinstance(max_lr, list | tuple) else [max_lr] * len(multipliers)
            extra["max_lr"] = [lr * m for lr, m in zip(peaks, multipliers, strict=True)]
        return self.scheduler_factory(optimizer, **extra)

    def replanned(self, optimizer: torch.optim.Optimizer, trainer, *, step: int, total_steps: int,
                  steps_per_epoch: int):
        """The scheduler a fit of `total_steps` has at optimizer `step` had it been planned that long from its start:
        built anew (from the groups' initial_lr: their peaks) and stepped `step` times; None where `model.lr_scheduler`
        takes no total_steps (the restored one then continues as saved)."""
        if "total_steps" not in unset_arguments(self.scheduler_factory, {"total_steps": total_steps}):
            return None
        scheduler = self.build(optimizer, trainer, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        with warnings.catch_warnings():  # stepped without an optimizer step, on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            for _ in range(step):
                scheduler.step()
        return scheduler

    @staticmethod
    def name_of(scheduler) -> str:
        """How a line names `scheduler`: the recipe's as "the cosine", any other by its class."""
        return "the cosine" if isinstance(scheduler, WarmupCosine) else type(scheduler).__name__
