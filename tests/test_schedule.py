"""The learning-rate schedule across resumes that change the run's length (lightning_modules/schedules.py, the model's
lr plan and training/resume/lr_plan.py): from the step a fit resumes at, the lr is what a fit planned that long from
the start has there, so every run ends at the schedule's end value. In-process fits of a small network, a few steps
each, with the callback the CLI adds to every run."""

from __future__ import annotations

import logging
import math
from functools import partial
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_modules import ImageClassifier
from lightning_modules.schedules import WarmupCosine, warmup_cosine
from tests.user_plugins import LinearDecay, SmallGeMNet
from training.resume.lr_plan import LrPlanAcrossResumes, ResumablePlan, plan_of, resumed_length

BATCH = 4
PEAK = 0.1 * BATCH / 256  # the optimizer's lr per 256 images, at this batch (linear scaling)


class Lrs(Callback):
    """The head's lr of every optimizer step, as the step starts (what LearningRateMonitor logs)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        group = next(g for g in trainer.optimizers[0].param_groups if g["is_head"])
        self.steps.append((trainer.global_step, group["lr"]))


def fit(folder, *, scheduler, ckpt_path=None, callbacks=(), **limits):
    """Fit the small network on 4 batches of images per epoch; the lrs it saw and the scheduler it ended with."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, 3, 16, 16), torch.randint(0, 3, (4 * BATCH,)))
    model = ImageClassifier(num_classes=3, net=SmallGeMNet, batch_size=BATCH, lr_scheduler=scheduler,
                            optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    lrs = Lrs()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=folder,
                        callbacks=[lrs, LrPlanAcrossResumes(), *callbacks,
                                   ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)],
                        **limits)
    trainer.fit(model, DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_path)
    return lrs.steps, trainer.lr_scheduler_configs[0].scheduler


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old_epochs=st.integers(1, 2), more=st.integers(1, 3), warmup=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
       by=st.sampled_from(["max_epochs", "max_steps"]))
def test_a_resume_with_another_length_follows_the_schedule_of_the_new_length_to_its_end(tmp_path_factory, old_epochs,
                                                                                         more, warmup, by):
    """Raised max_epochs or max_steps; another world size is tests/test_distributed_multiprocess.py's."""
    folder = tmp_path_factory.mktemp("run")
    scheduler = partial(WarmupCosine, warmup_epochs=warmup)
    start, total = 4 * old_epochs, 4 * (old_epochs + more)  # 4 optimizer steps per epoch
    fit(folder, scheduler=scheduler, **{by: start if by == "max_steps" else old_epochs})
    steps, last = fit(folder, scheduler=scheduler, ckpt_path=str(folder / "last.ckpt"),
                      **{by: total if by == "max_steps" else old_epochs + more})
    assert [s for s, _ in steps] == list(range(start, total))
    warmup_steps = min(int(warmup * 4), total)
    assert [lr for _, lr in steps] == pytest.approx([PEAK * warmup_cosine(s, total, warmup_steps)
                                                     for s in range(start, total)], rel=1e-6)
    assert last.get_last_lr()[0] == 0.0  # the end value, after the run's last step


class Crash(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:  # Lightning runs ModelCheckpoints last: the step's file is written
            raise Crash


def test_a_resume_that_changes_nothing_keeps_the_saved_schedule_and_says_nothing(tmp_path, caplog):
    scheduler = partial(WarmupCosine, warmup_epochs=1.0)
    straight, _ = fit(tmp_path / "straight", scheduler=scheduler, max_epochs=3)
    every5 = ModelCheckpoint(dirpath=tmp_path / "crashed", filename="step{step}",
                             auto_insert_metric_name=False, every_n_train_steps=5)
    with pytest.raises(Crash):  # after the checkpoint of step 5
        fit(tmp_path / "crashed", scheduler=scheduler, max_epochs=3, callbacks=[every5, CrashAt(5)])
    with caplog.at_level(logging.INFO):
        resumed, _ = fit(tmp_path / "crashed", scheduler=scheduler, max_epochs=3,
                         ckpt_path=str(tmp_path / "crashed" / "step5.ckpt"))
    assert resumed == straight[5:]  # the same lrs, bit for bit
    assert "lr schedule" not in caplog.text


def test_a_users_scheduler_gets_the_new_length_where_it_takes_total_steps_else_continues_as_saved(tmp_path, caplog):
    """tests/user_plugins.LinearDecay takes total_steps; torch's StepLR does not."""
    with caplog.at_level(logging.INFO):
        fit(tmp_path / "linear", scheduler=LinearDecay, max_epochs=1)
        steps, last = fit(tmp_path / "linear", scheduler=LinearDecay, max_epochs=2,
                          ckpt_path=str(tmp_path / "linear" / "last.ckpt"))
    assert "lr schedule: 4 -> 8 optimizer steps; LinearDecay follows the new length from step 4" in caplog.text
    assert [lr for _, lr in steps] == pytest.approx([PEAK * (1 - s / 8) for s in range(4, 8)], rel=1e-6)
    assert last.get_last_lr()[0] == 0.0
    step_lr = partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    fit(tmp_path / "step", scheduler=step_lr, max_epochs=1)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        steps, _ = fit(tmp_path / "step", scheduler=step_lr, max_epochs=2,
                       ckpt_path=str(tmp_path / "step" / "last.ckpt"))
    assert "lr schedule: 4 -> 8 optimizer steps; StepLR takes no total_steps, so it continues as saved" in caplog.text
    assert [lr for _, lr in steps] == pytest.approx([PEAK * 0.5 ** (s // 3) for s in range(4, 8)], rel=1e-6)


def test_the_schedule_is_one_function_of_the_step_and_the_length():
    assert [warmup_cosine(s, 8, 2) for s in (0, 1, 2, 8, 9)] == [0.5, 1.0, 1.0, 0.0, 0.0]
    assert warmup_cosine(5, 8, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 6)))


def _restored(*, step: int, epoch: int, inside: int | None, batches: int = 10, accumulate: int = 4,
              max_epochs: int = 3, max_steps: int = -1) -> SimpleNamespace:
    """A trainer as a resumed fit's train start sees it: `inside` batches done of epoch `epoch` in progress, or
    None at an epoch's end (Lightning's progress counters: started > processed inside an epoch)."""
    progress = SimpleNamespace(started=epoch + 1, processed=epoch if inside is not None else epoch + 1)
    batch = SimpleNamespace(processed=inside if inside is not None else batches)
    loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=progress),
                           epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=batch)))
    return SimpleNamespace(fit_loop=loop, max_epochs=max_epochs, max_steps=max_steps, global_step=step,
                           current_epoch=epoch, num_training_batches=batches, accumulate_grad_batches=accumulate)


@pytest.mark.parametrize(("trainer", "length"), [
    # 10 batches, a step each 4 and at the epoch's last: 3 steps an epoch, 9 in all
    (_restored(step=3, epoch=1, inside=None), 9),  # at epoch 1's start (after epoch 0)
    (_restored(step=4, epoch=1, inside=5), 9),  # 5 batches into epoch 1: steps at its batches 8 and 10 left
    (_restored(step=4, epoch=1, inside=6), 9),  # mid-window: the same two left
    (_restored(step=6, epoch=1, inside=10), 9),  # after its last batch, before its end
    (_restored(step=3, epoch=1, inside=None, max_steps=7), 7),
    (_restored(step=3, epoch=1, inside=None, max_epochs=-1, max_steps=7), None),  # max_steps alone: Lightning's own
    # trained at another batch: 20 steps taken in epochs 0 and 1, 3 an epoch now
    (_restored(step=20, epoch=2, inside=None), 23),
])
def test_a_resumed_fits_length_counts_the_steps_its_data_has_left(trainer, length):
    assert resumed_length(trainer, steps_per_epoch=3) == length


def test_the_models_lr_plan_is_one_a_resume_can_restore():
    """training.resume.lr_plan reads the model's plan by its contract alone (it imports nothing of the model)."""
    model = ImageClassifier(num_classes=3, net=SmallGeMNet, batch_size=BATCH)
    assert isinstance(model.lr_plan, ResumablePlan)
    assert plan_of(model) is model.lr_plan
    assert plan_of(L.LightningModule()) is None  # a module without a plan: its checkpoints are left alone
