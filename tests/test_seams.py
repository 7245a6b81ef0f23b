"""Each seam a researcher swaps by `class_path`: its contract, met by the shipped parts and by a user's own
(tests/user_plugins.py, outside the packages)."""

from __future__ import annotations

import math
import signal
from functools import partial
from unittest import mock

import lightning as L
import pytest
import torch
import yaml
from torch import nn

from lightning_modules import BackboneWithHead, ImageClassifier
from lightning_modules.losses import BinaryCrossEntropy
from lightning_modules.optim import rescale_learning_rates
from lightning_modules.schedules import WarmupCosine
from tests.helpers import CONFIGS, TINY, kill_args, make_image_folder, max_diff, run_cli, shipped_config
from tests.user_plugins import FocalLoss, LinearDecay

LOSSES = [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1), BinaryCrossEntropy(0.1, 0.2),
          FocalLoss(2.0)]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: type(loss).__name__)
def test_a_loss_meets_the_contract(loss):
    """lightning_modules/losses.py: (B, C) logits against class indices, and against mixed rows, give a finite
    scalar with a gradient."""
    logits = torch.randn(6, 4, requires_grad=True)
    indices = torch.tensor([0, 1, 2, 3, 0, 1])
    mixed = 0.7 * nn.functional.one_hot(indices, 4).float() + 0.3 * nn.functional.one_hot(indices.roll(1), 4).float()
    for target in (indices, mixed):
        value = loss(logits, target)
        assert value.ndim == 0 and torch.isfinite(value)
        (grad,) = torch.autograd.grad(value, logits)
        assert grad.abs().sum() > 0


def test_the_model_trains_and_evaluates_with_the_loss_it_is_given():
    """train/loss and val/loss are the injected loss, not a cross-entropy of the model's own."""
    model = ImageClassifier(num_classes=4, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            loss=FocalLoss(gamma=2.0))
    logits, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    torch.testing.assert_close(model.loss(logits, y), FocalLoss(2.0)(logits, y))
    assert "loss" not in model.hparams  # an object from Python: not in the weights_only checkpoint


def test_a_users_loss_by_class_path_alone(tmp_path):
    images = make_image_folder(tmp_path / "images", {"a": 8, "b": 8}, size=32)
    run = tmp_path / "run"
    config = tmp_path / "focal.yaml"
    config.write_text(yaml.safe_dump({"model": {"loss": {"class_path": "tests.user_plugins.FocalLoss",
                                                         "init_args": {"gamma": 1.5}}}}))
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config), *TINY,
            "--data.root", str(images), "--data.batch_size", "4", "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(run))
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["loss"] == {"class_path": "tests.user_plugins.FocalLoss",
                                                 "init_args": {"gamma": 1.5}}
    model = ImageClassifier.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu",
                                                 weights_only=True)
    assert isinstance(model.criterion, FocalLoss) and model.criterion.gamma == 1.5


# ---- optimizer and learning-rate schedule ---------------------------------------------------------------------

def _stepped(optimizer, scheduler, steps: int) -> list[float]:
    """The first group's lr before each of `steps` optimizer steps, and after the last."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [*lrs, optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize(("warmup_epochs", "steps_per_epoch", "total_steps"), [(1, 3, 6), (0, 5, 5), (0.5, 4, 10)])
def test_warmup_cosine_is_a_linear_warm_up_then_a_cosine_to_zero(warmup_epochs, steps_per_epoch, total_steps):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = WarmupCosine(optimizer, warmup_epochs=warmup_epochs, total_steps=total_steps,
                             steps_per_epoch=steps_per_epoch)
    w = int(warmup_epochs * steps_per_epoch)
    expected = [2.0 * ((s + 1) / w if s < w else 0.5 * (1 + math.cos(math.pi * (s - w) / (total_steps - w))))
                for s in range(total_steps + 1)]
    assert _stepped(optimizer, scheduler, total_steps) == pytest.approx(expected)
    assert scheduler.warmup_steps == w


def _optimizer_and_scheduler(kind: str, lr: float = 0.1):
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.ones_like(p)
    if kind == "sgd+warmup_cosine":
        optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": lr / 10}], lr=lr)
        return optimizer, WarmupCosine(optimizer, warmup_epochs=1, total_steps=12, steps_per_epoch=4)
    optimizer = torch.optim.RMSprop([{"params": params[:1]}, {"params": params[1:]}], lr=lr)
    return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[lr, lr / 10], total_steps=12)


@pytest.mark.parametrize("kind", ["sgd+warmup_cosine", "rmsprop+one_cycle"])
def test_the_world_size_rescale_doubles_every_learning_rate_of_any_optimizer_and_scheduler(kind):
    """rescale_learning_rates x2 on a checkpoint taken mid-run continues exactly as the same run at twice the rates:
    every lr key of the param groups (lr, initial_lr, max_lr, min_lr) and of the scheduler states, nested ones
    included."""
    optimizer, scheduler = _optimizer_and_scheduler(kind)
    _stepped(optimizer, scheduler, 5)
    checkpoint = {"optimizer_states": [optimizer.state_dict()], "lr_schedulers": [scheduler.state_dict()]}
    rescale_learning_rates(checkpoint, 2.0)
    resumed, resumed_scheduler = _optimizer_and_scheduler(kind)
    resumed.load_state_dict(checkpoint["optimizer_states"][0])
    resumed_scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    double, double_scheduler = _optimizer_and_scheduler(kind, lr=0.2)
    _stepped(double, double_scheduler, 5)
    assert _stepped(resumed, resumed_scheduler, 7) == pytest.approx(_stepped(double, double_scheduler, 7))
    for resumed_group, double_group in zip(resumed.param_groups, double.param_groups, strict=True):
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            assert resumed_group.get(key) == pytest.approx(double_group.get(key))


def test_a_python_optimizer_and_scheduler_are_left_out_of_the_hyperparameters():
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            optimizer=lambda params: torch.optim.RMSprop(params, lr=0.01),
                            lr_scheduler=partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1))
    assert "optimizer" not in model.hparams and "lr_scheduler" not in model.hparams  # weights_only could not load them
    assert isinstance(model.make_optimizer(), torch.optim.RMSprop)


def test_a_users_scheduler_gets_the_runs_length_from_the_model():
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            batch_size=256, lr_scheduler=LinearDecay, optimizer=partial(torch.optim.SGD, lr=0.4))
    model.trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False)
    with mock.patch.object(type(model.trainer), "estimated_stepping_batches", 8):
        config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, LinearDecay) and config["lr_scheduler"]["interval"] == "step"
    assert _stepped(optimizer, scheduler, 8) == pytest.approx([0.4 * (1 - s / 8) for s in range(9)])


ONE_CYCLE = {"optimizer": {"class_path": "torch.optim.RMSprop", "init_args": {"lr": 0.01, "momentum": 0.9}},
             "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.OneCycleLR", "init_args": {"max_lr": 0.02}}}


def test_rmsprop_with_one_cycle_by_class_path_alone_fits_and_resumes_after_kill9_to_identical_weights(tmp_path):
    """torch's RMSprop and OneCycleLR, named in YAML only: OneCycleLR gets the run's total_steps from the model, the
    checkpoint holds both as class_path and init_args (load_from_checkpoint rebuilds them), and a run SIGKILLed
    mid-epoch 1 resumes to the weights of the run that never was."""
    data = make_image_folder(tmp_path / "images", {"a": 8, "b": 8}, size=32)
    cfg = shipped_config()
    cfg["trainer"].update(precision="32-true", deterministic=True, max_epochs=2, accelerator="cpu",
                          enable_progress_bar=False, enable_model_summary=False)
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "Rich" not in c["class_path"]]
    cfg["model"]["net"]["init_args"].update(arch="resnet18", head_hidden=32)
    cfg["model"]["levers"]["channels_last"] = False
    cfg["model"].update(**ONE_CYCLE)
    cfg["data"].update(root=str(data), batch_size=4, num_workers=0, image_size=32)
    config = tmp_path / "one_cycle.yaml"
    config.write_text(yaml.safe_dump(cfg))

    def fit(run, *extra, check=True):
        return run_cli("fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / run), *extra,
                       check=check, timeout=300)

    reference = fit("reference")
    assert "RMSprop lr 0.01 per 256 images" in reference.stdout + reference.stderr
    killed = fit("killed", *kill_args(6, "train"), check=False)  # 4 steps an epoch: mid-epoch 1
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    fit("killed")  # auto_resume, as shipped
    ckpt = {run: torch.load(tmp_path / run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
            for run in ("reference", "killed")}
    assert max_diff(ckpt["reference"]["state_dict"], ckpt["killed"]["state_dict"]) == 0.0
    saved = ckpt["killed"]["hyper_parameters"]
    assert saved["optimizer"]["class_path"] == "torch.optim.RMSprop" and saved["optimizer"]["init_args"]["lr"] == 0.01
    assert saved["lr_scheduler"]["init_args"]["max_lr"] == 0.02
    assert ckpt["killed"]["lr_schedulers"][0]["total_steps"] == 8  # from the model: 2 epochs of 4 steps
    model = ImageClassifier.load_from_checkpoint(tmp_path / "killed" / "checkpoints" / "last.ckpt",
                                                 map_location="cpu", weights_only=True)
    assert isinstance(model.make_optimizer(), torch.optim.RMSprop)
