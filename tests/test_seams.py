"""Each seam a researcher swaps by `class_path`: its contract, met by the shipped parts and by a user's own
(tests/user_plugins.py, outside the packages)."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch import nn

from lightning_modules import ImageClassifier
from lightning_modules.losses import BinaryCrossEntropy
from tests.helpers import CONFIGS, TINY, make_image_folder, run_cli
from tests.user_plugins import FocalLoss

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
    model = ImageClassifier(num_classes=4, arch="resnet18", head_hidden=0, loss=FocalLoss(gamma=2.0))
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
