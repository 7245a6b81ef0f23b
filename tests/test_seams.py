"""Each seam a researcher swaps by `class_path`: its contract, met by the shipped parts and by a user's own
(tests/user_plugins.py, outside the packages)."""

from __future__ import annotations

import csv
import math
from functools import partial
from unittest import mock

import lightning as L
import pytest
import torch
import yaml
from torch import nn

from lightning_modules import BackboneWithHead, ImageClassifier, Recipe
from lightning_modules.losses import BinaryCrossEntropy
from lightning_modules.network import head_parameter_names
from lightning_modules.schedules import WarmupCosine
from tests.helpers import (
    CONFIGS,
    TINY,
    TINY_ARCH,
    killed_and_resumed,
    make_image_folder,
    printed_metrics,
    resume_config,
    run_cli,
)
from tests.user_plugins import FocalLoss, LinearDecay, SmallGeMNet
from training.callbacks import FreezeBackbone
from training.records.report import read_run
from training.resume.lr_plan import rescale_learning_rates

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
    model = ImageClassifier(num_classes=4, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0),
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
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0),
                            optimizer=lambda params: torch.optim.RMSprop(params, lr=0.01),
                            lr_scheduler=partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1))
    assert "optimizer" not in model.hparams and "lr_scheduler" not in model.hparams  # weights_only could not load them
    assert isinstance(model.make_optimizer(), torch.optim.RMSprop)


def test_a_users_scheduler_gets_the_runs_length_from_the_model():
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0),
                            batch_size=256, lr_scheduler=LinearDecay, optimizer=partial(torch.optim.SGD, lr=0.4))
    model.trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False)
    with mock.patch.object(type(model.trainer), "estimated_stepping_batches", 8):
        config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, LinearDecay) and config["lr_scheduler"]["interval"] == "step"
    assert _stepped(optimizer, scheduler, 8) == pytest.approx([0.4 * (1 - s / 8) for s in range(9)])


# ---- network ----------------------------------------------------------------------------------------------------

class _NoHead(nn.Module):
    """A network that declares no head: all of it is the head."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("net", [partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=8), SmallGeMNet, _NoHead],
                         ids=["BackboneWithHead", "SmallGeMNet", "no declaration"])
def test_a_network_meets_the_contract(net):
    """lightning_modules/network.py: built with num_classes, (B, 3, H, W) -> (B, num_classes) logits; its declared
    head holds parameters and is not the whole network."""
    built = net(5)
    assert built.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    head = head_parameter_names(built)
    everything = {name for name, _ in built.named_parameters()}
    assert head and head <= everything and (head < everything) == (net is not _NoHead)


def test_the_declared_head_drives_param_groups_freezing_and_frozen_batchnorm():
    """SmallGeMNet's head is its GeM pooling and classifier: those alone are the head's groups, learn at the head's lr,
    stay trainable under FreezeBackbone, while every backbone BatchNorm is held in eval mode."""
    model = ImageClassifier(num_classes=3, net=SmallGeMNet, recipe=Recipe(lr_scaling="none", backbone_lr_ratio=0.1),
                            optimizer=partial(torch.optim.SGD, lr=0.5))
    head = {id(p) for m in model.net.head_modules() for p in m.parameters()}
    groups = model.make_optimizer().param_groups
    for group in groups:
        assert {id(p) in head for p in group["params"]} == {group["is_head"]}
        assert group["lr"] == pytest.approx(0.5 if group["is_head"] else 0.05)
    assert {id(p) for g in groups if g["is_head"] for p in g["params"]} == head  # the GeM exponent included
    freeze, trainer = FreezeBackbone(epochs=1), mock.Mock(current_epoch=0)
    freeze.setup(trainer, model, "fit")
    assert {n for n, p in model.net.named_parameters() if p.requires_grad} == {"pool.p", "classifier.weight",
                                                                                "classifier.bias"}
    model.train()
    freeze.on_train_batch_start(trainer, model, None, 0)
    assert [m.training for m in model.net.features if isinstance(m, nn.BatchNorm2d)] == [False, False]
    trainer.current_epoch = 1  # the thaw; Lightning restored each module's mode after validating: no model.train()
    freeze.on_train_epoch_start(trainer, model)
    freeze.on_train_batch_start(trainer, model, None, 0)
    assert all(p.requires_grad for p in model.net.parameters())
    assert all(m.training for m in model.net.features if isinstance(m, nn.BatchNorm2d))


def test_a_network_without_the_declaration_is_all_head_and_refuses_what_needs_a_backbone():
    model = ImageClassifier(num_classes=3, net=_NoHead)
    assert all(g["is_head"] for g in model.make_optimizer().param_groups)
    expected = r"declares none: add a method head_modules\(self\) -> list\[nn.Module\] returning its head"
    with pytest.raises(ValueError, match=r"^FreezeBackbone\(epochs=1\) needs the network's backbone, and _NoHead "
                                         + expected):
        FreezeBackbone(epochs=1).setup(mock.Mock(current_epoch=0), model, "fit")
    with pytest.raises(ValueError, match=r"^model.recipe.backbone_lr_ratio=0.1 needs .*" + expected):
        ImageClassifier(num_classes=3, net=_NoHead, recipe=Recipe(backbone_lr_ratio=0.1))


def test_every_part_a_users_own_by_yaml_alone_fits_resumes_bitwise_validates_and_predicts(tmp_path):
    """tests/user_plugins.py's in-memory TensorData, SmallGeMNet (its own GeM pooling and head) and FocalLoss,
    together and named in YAML only, the backbone frozen for epoch 0 and at a tenth of the head's lr: a run SIGKILLed
    mid-epoch 0 resumes to the weights of the run that never was; its checkpoint holds the network as class_path and
    init_args, and alone (no config) it validates to the val/acc the fit logged and the run's config gives, and
    predicts."""
    cfg = resume_config(every_n_train_steps=2)
    cfg["model"]["net"] = {"class_path": "tests.user_plugins.SmallGeMNet", "init_args": {"width": 8}}
    cfg["model"]["loss"] = {"class_path": "tests.user_plugins.FocalLoss", "init_args": {"gamma": 2.0}}
    cfg["model"]["recipe"]["backbone_lr_ratio"] = 0.1
    cfg["freeze"] = {"epochs": 1}  # training.callbacks.FreezeBackbone
    cfg["data"] = {"class_path": "tests.user_plugins.TensorData",
                   "init_args": {"images": 16, "image_size": 32, "batch_size": 4, "num_workers": 0}}
    config = tmp_path / "users_parts.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert killed_and_resumed(config, tmp_path, kill_after=3, resumes_from=2) == 0.0  # 4 steps an epoch, 2 epochs
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["net"] == {"class_path": "tests.user_plugins.SmallGeMNet",
                                                "init_args": {"width": 8}}
    assert "net.pool.p" in saved["state_dict"]
    common = ["--ckpt_path", str(last), "--trainer.default_root_dir", str(tmp_path / "killed"),
              "--trainer.enable_progress_bar", "false"]
    scores = [printed_metrics(run_cli("validate", *config_args, *common).stdout)["val/acc"]
              for config_args in ([], ["--config", str(tmp_path / "killed" / "config.yaml")])]
    logged = dict(read_run(tmp_path / "killed")["val/acc"])  # last.ckpt: the weights of the last validation
    # The same answer: the run's data class and its arguments come from the checkpoint.
    assert scores[0] == scores[1] == pytest.approx(logged[max(logged)], abs=1e-6)
    run_cli("predict", *common)
    with open(tmp_path / "killed" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == [f"tensor_{i:03d}" for i in range(16)]
    assert {r["class_name"] for r in rows} <= {"dark", "bright"}


def test_a_network_from_python_is_saved_as_its_class_and_arguments():
    """A class or a partial of one: its class_path and init_args, from which a checkpoint rebuilds it; any other
    callable is left out of the hyperparameters (a weights_only checkpoint cannot hold it)."""
    model = ImageClassifier(num_classes=3, net=partial(SmallGeMNet, width=4))
    assert model.hparams["net"] == {"class_path": "tests.user_plugins.SmallGeMNet", "init_args": {"width": 4}}
    rebuilt = ImageClassifier(num_classes=3, net=model.hparams["net"])
    assert isinstance(rebuilt.net, SmallGeMNet) and rebuilt.net.classifier.in_features == 8
    assert "net" not in ImageClassifier(num_classes=3, net=lambda n: SmallGeMNet(n, width=4)).hparams
    with pytest.raises(ValueError, match="model.net: os.system is not an nn.Module class of an imported module"):
        ImageClassifier(num_classes=3, net={"class_path": "os.system", "init_args": {}})
