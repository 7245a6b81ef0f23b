"""The recipe's learning-rate schedule: a linear warm-up, then a cosine decay to zero, stepped every optimizer step.

The whole schedule is `warmup_cosine(step, total, warmup)`, a pure function of the step and the run's length (as
nanoGPT's `get_lr`), in torch's `LambdaLR`. Its state in a checkpoint is the step count alone, never the length: a
fit resumed with another length (a larger `max_epochs`, another batch or world size) follows the schedule of the new
length from the step it resumes at, and one that changes nothing continues bitwise. Any other scheduler arrives by
`class_path` (`model.lr_scheduler`); the model passes the run's length to those that take it (see optim.py).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from core.config_types import NonNegativeFloat, PositiveInt, check_arguments


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The lr at optimizer step `step` (0-based) of a run of `total` steps, as a fraction of the peak: linear from
    1/warmup to 1 over the first `warmup` steps, then a cosine from 1 down to 0, which it reaches at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class WarmupCosine(LambdaLR):
    """Linear warm-up over `warmup_epochs` (fractions allowed; 0: none), then a cosine decay to zero at the run's end.

    Args:
        optimizer: the optimizer whose every param group it schedules (each from its own peak lr).
        warmup_epochs: warm-up length in epochs of optimizer steps.
        total_steps: optimizer steps of the whole run; the model passes it when left unset.
        steps_per_epoch: optimizer steps per epoch (one pass over the loader); the model passes it when left unset.
    """

    PLAN = ("total_steps", "warmup_steps")  # the run's length: the run's own, never restored from a checkpoint

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_epochs: NonNegativeFloat = 1.0,
                 total_steps: PositiveInt | None = None, steps_per_epoch: PositiveInt | None = None) -> None:
        check_arguments("model.lr_scheduler", WarmupCosine.__init__, locals())
        if total_steps is None or steps_per_epoch is None:
            raise ValueError("model.lr_scheduler: WarmupCosine needs total_steps and steps_per_epoch (the model passes "
                             "both; give them when building it yourself)")
        self.total_steps = total_steps
        self.warmup_steps = min(int(warmup_epochs * steps_per_epoch), total_steps)
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        return warmup_cosine(step, self.total_steps, self.warmup_steps)

    def state_dict(self) -> dict:
        return {key: value for key, value in super().state_dict().items() if key not in self.PLAN}
