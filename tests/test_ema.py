"""training.callbacks.EMA: the average copies the weights through the LR warm-up and averages after it, as
torchvision's reference; a decay too slow for the run gets one line naming one that fits."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_modules.schedules import WarmupCosine
from training.callbacks import EMA
from training.callbacks.ema import HORIZONS, fits, fitting_decay, horizon

STEPS_PER_EPOCH = 5


class _Linear(L.LightningModule):
    """A linear classifier with the recipe's schedule: one epoch of warm-up, then a cosine."""

    def __init__(self, warmup_epochs: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.warmup_epochs = warmup_epochs

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = WarmupCosine(optimizer, self.warmup_epochs, total_steps=total, steps_per_epoch=STEPS_PER_EPOCH)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _Weights(L.Callback):
    """After every training batch (after the EMA's update): (step, the average's weight, the trained weight)."""

    def __init__(self, ema: EMA) -> None:
        self.ema, self.seen = ema, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        average = self.ema._average_model.module.net.weight
        self.seen.append((trainer.global_step, average.detach().clone(), pl_module.net.weight.detach().clone()))


def _fit(ema: EMA, epochs: int, *callbacks: L.Callback, module: L.LightningModule | None = None) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4 * STEPS_PER_EPOCH, 4), torch.arange(4 * STEPS_PER_EPOCH) % 2
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[ema, *callbacks])
    trainer.fit(module or _Linear(), DataLoader(TensorDataset(x, y), batch_size=4))


def test_the_average_copies_the_weights_through_the_warm_up_and_averages_after_it():
    ema = EMA(decay=0.5)
    weights = _Weights(ema)
    _fit(ema, 2, weights)
    assert ema.start_step == STEPS_PER_EPOCH  # the scheduler's warm-up: one epoch
    for step, average, trained in weights.seen[:STEPS_PER_EPOCH]:
        assert torch.equal(average, trained), step
    previous = weights.seen[STEPS_PER_EPOCH - 1][1]
    for step, average, trained in weights.seen[STEPS_PER_EPOCH:]:
        assert not torch.equal(average, trained), step
        torch.testing.assert_close(average, 0.5 * previous + 0.5 * trained)
        previous = average


def test_without_a_warm_up_the_average_starts_at_the_first_step():
    ema = EMA(decay=0.5)
    weights = _Weights(ema)
    torch.manual_seed(0)
    _fit(ema, 1, weights, module=_Linear(warmup_epochs=0))
    assert ema.start_step == 0
    (_, a0, t0), (_, a1, t1), *_ = weights.seen
    assert torch.equal(a0, t0)  # the first update starts the average at the weights
    assert not torch.equal(a1, t1)
    torch.testing.assert_close(a1, 0.5 * a0 + 0.5 * t1)


def test_an_explicit_start_step_and_update_interval_are_obeyed():
    ema = EMA(decay=0.5, update_every_n_steps=2, update_starting_at_step=2)
    weights = _Weights(ema)
    _fit(ema, 1, weights)
    (_, a1, t1), (_, a2, _), (_, a3, t3), (_, a4, _), (_, a5, t5) = weights.seen
    assert torch.equal(a1, t1) and torch.equal(a2, a1)  # step index 0 copies; 1 is not an update
    torch.testing.assert_close(a3, 0.5 * a1 + 0.5 * t3)  # step index 2: the first average
    assert torch.equal(a4, a3)
    torch.testing.assert_close(a5, 0.5 * a3 + 0.5 * t5)


def _lines(caplog) -> list[str]:
    """The EMA's messages, each checked to be one line."""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("EMA:")]
    assert all("\n" not in line for line in lines), lines
    return lines


@pytest.mark.parametrize("decay", [0.99, 0.9])  # horizons of 100 and 10 steps: 0.9's fits 4.5 times into 45, not 10
def test_a_decay_too_slow_for_the_run_gets_one_line_naming_one_that_fits(caplog, decay):
    caplog.set_level(logging.INFO)
    epochs = 10
    averaged = (epochs - 1) * STEPS_PER_EPOCH  # after the one-epoch warm-up
    _fit(EMA(decay=decay), epochs)
    line, = _lines(caplog)
    suggested = fitting_decay(averaged)
    assert f"averages over {averaged} (from step {STEPS_PER_EPOCH} of {epochs * STEPS_PER_EPOCH})" in line
    assert line.endswith(f"EMA's decay {suggested:g} fits (init_args.decay, or null)")
    caplog.clear()
    _fit(EMA(decay=suggested), epochs)
    assert _lines(caplog) == []  # the decay it names fits the same run


def test_a_null_decay_is_fitted_to_the_run_and_said(caplog):
    caplog.set_level(logging.INFO)
    ema, epochs = EMA(decay=None), 10
    weights = _Weights(ema)
    _fit(ema, epochs, weights)
    averaged = (epochs - 1) * STEPS_PER_EPOCH
    assert ema.run_decay == fitting_decay(averaged) > 0
    line, = _lines(caplog)
    assert line.startswith(f"EMA: decay {ema.run_decay:g} every 1 step(s), fitted to the run")
    (_, before, _), (_, after, trained) = weights.seen[-2:]
    torch.testing.assert_close(after, ema.run_decay * before + (1 - ema.run_decay) * trained)


@pytest.mark.parametrize("steps", [11, 45, 180, 1_000, 123_456, 750_000])
@pytest.mark.parametrize("every", [1, 32])
def test_the_fitting_decay_fits_and_is_nearly_the_slowest_that_does(steps, every):
    decay = fitting_decay(steps, every)
    if HORIZONS * every >= steps:
        assert decay == 0.0
        return
    assert fits(decay, steps, every)
    assert HORIZONS * horizon(decay, every) > 0.85 * steps  # two significant digits of 1 - decay, rounded down


@pytest.mark.parametrize("every", [1, 4])
def test_a_decay_fits_from_ten_horizons_on(every):
    assert not fits(0.9, HORIZONS * 10 * every - 1, every) and fits(0.9, HORIZONS * 10 * every, every)


def test_a_bad_decay_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"EMA.decay=1.0 must be in \[0, 1\)"):
        EMA(decay=1.0)
