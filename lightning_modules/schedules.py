"""The recipe's learning-rate schedule: a linear warm-up, then a cosine decay to zero, stepped every optimizer step.

It is torch's own schedulers chained (`LinearLR`, then `CosineAnnealingLR`, by `SequentialLR`), so its state is
torch's too: a checkpoint holds it, and a resume continues it bitwise. Any other scheduler arrives the same way,
by `class_path` (`model.lr_scheduler`); the model passes the run's length to those that take it (see optim.py).

    step s < W (warm-up steps):  lr = peak * (s + 1) / W
    step s >= W:                 lr = peak * 0.5 * (1 + cos(pi * (s - W) / (T - W)))      T: total optimizer steps
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from core.config_types import NonNegativeFloat, PositiveInt, check_arguments


class WarmupCosine(SequentialLR):
    """Linear warm-up over `warmup_epochs` (fractions allowed; 0: none), then a cosine decay to zero at the run's end.

    Args:
        optimizer: the optimizer whose every param group it schedules (each from its own peak lr).
        warmup_epochs: warm-up length in epochs of optimizer steps.
        total_steps: optimizer steps of the whole run; the model passes it when left unset.
        steps_per_epoch: optimizer steps per epoch (one pass over the loader); the model passes it when left unset.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_epochs: NonNegativeFloat = 1.0,
                 total_steps: PositiveInt | None = None, steps_per_epoch: PositiveInt | None = None) -> None:
        check_arguments("model.lr_scheduler", WarmupCosine.__init__, locals())
        if total_steps is None or steps_per_epoch is None:
            raise ValueError("model.lr_scheduler: WarmupCosine needs total_steps and steps_per_epoch (the model passes "
                             "both; give them when building it yourself)")
        self.warmup_steps = min(int(warmup_epochs * steps_per_epoch), total_steps)
        cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - self.warmup_steps), eta_min=0.0)
        if self.warmup_steps == 0:
            super().__init__(optimizer, [cosine], milestones=[])
            return
        w = self.warmup_steps  # (s + 1) / W over s = 0 .. W - 1
        warmup = LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0, total_iters=max(1, w - 1))
        super().__init__(optimizer, [warmup, cosine], milestones=[w])
