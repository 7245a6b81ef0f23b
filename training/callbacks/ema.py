"""An exponential moving average of the weights as torchvision's classification reference keeps one: Lightning's
`WeightAveraging`, copying the weights through the LR warm-up and averaging them from its end, with one line at the
fit's start when the decay is too slow for the run.

torchvision's train.py resets the average's count at every update of the warm-up epochs
(`model_ema.n_averaged.fill_(0)`), so the average follows the weights until the warm-up ends and starts averaging
there, instead of carrying the random initial weights. The average forgets `1 - decay` of itself per update: its
horizon is about `update_every_n_steps / (1 - decay)` optimizer steps, and a run that averages over few horizons
ends with an average still weighted towards where it started. torchvision rescales its decay by the run's length for
this (for ImageNet's size); here `decay: null` fits it to the run's own steps (`fitting_decay`), and a configured
decay that does not fit gets a line naming one that does.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.swa_utils import get_ema_multi_avg_fn

from core.config_types import NonNegativeInt, PositiveInt, UnitIntervalRightOpen, check_arguments

HORIZONS = 10  # a decay fits a run that averages over this many horizons: its starting point then weighs e^-10


def horizon(decay: float, every: int = 1) -> float:
    """Optimizer steps over which an average updated every `every` steps with `decay` forgets all but 1/e of itself."""
    return every / (1.0 - decay)


def fits(decay: float, steps: float, every: int = 1) -> bool:
    """Whether the horizon fits HORIZONS times into `steps` averaged optimizer steps (to a float's rounding)."""
    return HORIZONS * every <= steps * (1.0 - decay) * (1 + 1e-9)


def fitting_decay(steps: int, every: int = 1) -> float:
    """The slowest decay whose horizon fits HORIZONS times into `steps` averaged optimizer steps, rounded down to two
    significant digits of 1 - decay (0 where the run is shorter than HORIZONS updates)."""
    rate = HORIZONS * every / max(1, steps)
    if rate >= 1:
        return 0.0
    digits = 1 - math.floor(math.log10(rate))
    return math.floor((1 - rate) * 10**digits) / 10**digits


class EMA(WeightAveraging):
    """An EMA of the weights (and BatchNorm statistics), which validation runs and checkpoints save as the model's
    `state_dict` (the trained weights as `current_model_state`), as Lightning's `EMAWeightAveraging`; but the average
    only copies the weights until `update_starting_at_step`, the end of the LR warm-up by default, as torchvision's
    reference does, and averages from there. At the fit's start, one line names a decay that fits when this one's
    horizon does not fit `HORIZONS` times into the steps the run averages over. A resumed fit continues the average
    exactly: it is checkpointed, and whether an update copies or averages follows the step.

    Args:
        decay: weight of the old average at each update; null: the slowest that fits the run (`fitting_decay`),
            said in one line at the fit's start.
        update_every_n_steps: optimizer steps between updates.
        update_starting_at_step: the first optimizer step (0-based) whose update averages; the updates before it copy
            the weights. null: the end of the LR warm-up, the scheduler's `warmup_steps` (WarmupCosine's; 0 for a
            scheduler that declares none).
        device: where the average is kept; null: the model's device ("cpu" spares the accelerator's memory).
        use_buffers: average the buffers (BatchNorm statistics) too, rather than copy them.
    """

    def __init__(self, decay: UnitIntervalRightOpen | None = 0.999, update_every_n_steps: PositiveInt = 1,
                 update_starting_at_step: NonNegativeInt | None = None, device: str | None = None,
                 use_buffers: bool = True) -> None:
        check_arguments("EMA", EMA.__init__, dict(decay=decay, update_every_n_steps=update_every_n_steps,
                                                  update_starting_at_step=update_starting_at_step))
        super().__init__(device=device, use_buffers=use_buffers, multi_avg_fn=self._update)
        self.decay, self.update_every_n_steps = decay, update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.start_step, self.run_decay = update_starting_at_step or 0, decay  # resolved at the fit's start
        self._average = get_ema_multi_avg_fn(decay or 0.0)
        self._copying = True

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % self.update_every_n_steps == 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.update_starting_at_step is None:
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            self.start_step = max((getattr(s, "warmup_steps", 0) for s in schedulers), default=0)
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            return
        averaged, every = max(0, int(total) - self.start_step), self.update_every_n_steps
        span = f"this run averages over {averaged} (from step {self.start_step} of {int(total)})"
        if self.decay is None:
            self.run_decay = fitting_decay(averaged, every)
            self._average = get_ema_multi_avg_fn(self.run_decay)
            rank_zero_info(f"EMA: decay {self.run_decay:g} every {every} step(s), fitted to the run: it forgets over "
                           f"about {horizon(self.run_decay, every):.0f} optimizer steps, and {span}")
        elif not fits(self.decay, averaged, every):
            rank_zero_info(
                f"EMA: decay {self.decay} every {every} step(s) forgets over about {horizon(self.decay, every):.0f} "
                f"optimizer steps, and {span}: fewer than {HORIZONS} horizons, so the average keeps the weights it "
                f"starts from; EMA's decay {fitting_decay(averaged, every):g} fits (init_args.decay, or null)")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        self._copying = trainer.global_step - 1 < self.start_step  # the step index WeightAveraging updates after
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _update(self, averaged: list[torch.Tensor], current: list[torch.Tensor], n_averaged: torch.Tensor) -> None:
        """AveragedModel's multi_avg_fn: the weights copied during the warm-up, the EMA after it."""
        if not self._copying:
            self._average(averaged, current, n_averaged)
            return
        for average, weight in zip(averaged, current, strict=True):
            average.copy_(weight)
