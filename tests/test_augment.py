"""Automatic augmentation and random erasing (torchvision v2), on uint8 images until the float stage."""

from __future__ import annotations

import types

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from datamodules import ImageFolderDataModule
from datamodules.presets import (
    AUTO_AUGMENTS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    ClassificationPresetEval,
    ClassificationPresetTrain,
    auto_augment_transform,
    float_stage,
    normalization,
)
from tests.helpers import make_image_folder


def _image(size: int = 48) -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randint(0, 256, (3, size, size), dtype=torch.uint8)


@pytest.mark.parametrize("policy", [p for p in AUTO_AUGMENTS if p != "none"])
def test_each_policy_changes_the_pixels_and_keeps_uint8(policy):
    x = _image()
    plain = ClassificationPresetTrain(preset="none", image_size=48, uint8_output=True)
    augmented = ClassificationPresetTrain(preset="none", image_size=48, uint8_output=True, auto_augment=policy)
    assert isinstance(augmented.transforms.transforms[-1], type(auto_augment_transform(policy)))
    changed = 0
    for seed in range(8):
        torch.manual_seed(seed)
        out = augmented(x)
        assert out.dtype == torch.uint8 and out.shape == (3, 48, 48)
        changed += not torch.equal(out, plain(x))
    assert changed >= 4, f"{policy} left the image as it was in {8 - changed} of 8 draws"


def test_the_magnitude_setting_reaches_each_policy_and_null_keeps_torchvisions_default():
    assert auto_augment_transform("randaugment", 5).magnitude == 5
    assert auto_augment_transform("randaugment").magnitude == 9
    assert auto_augment_transform("augmix", 1).severity == 1
    assert auto_augment_transform("trivialaugment", 11).num_magnitude_bins == 11
    assert auto_augment_transform("none") is None


def test_random_erasing_fills_a_box_with_the_pixel_that_normalises_to_zero():
    x = torch.full((3, 32, 32), 255, dtype=torch.uint8)  # white: no pixel equals the fill before erasing
    erase = ClassificationPresetTrain(preset="imagenet", image_size=32, uint8_output=True, random_erasing=1.0)
    torch.manual_seed(0)
    out = erase(x)
    assert out.dtype == torch.uint8
    fill = torch.tensor([round(255 * m) for m in IMAGENET_MEAN], dtype=torch.uint8)
    box = (out == fill[:, None, None]).all(dim=0)  # (H, W)
    rows, cols = box.any(dim=1).nonzero(), box.any(dim=0).nonzero()
    assert 0 < box.sum() < 32 * 32
    assert box.sum() == len(rows) * len(cols)  # one rectangle
    normalised = float_stage(*normalization("imagenet"))(out.unsqueeze(0))[0]
    assert normalised[:, box].abs().max() <= 0.5 / 255 / min(IMAGENET_STD)  # 0 up to the uint8 rounding
    assert torch.equal(ClassificationPresetTrain(preset="none", image_size=32, uint8_output=True,
                                                 random_erasing=1.0)(x).amin(), torch.tensor(0, dtype=torch.uint8))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"auto_augment": "cutout"},
     "data.train_transform.auto_augment='cutout' is unknown; choose one of none, trivialaugment"),
    ({"random_erasing": 1.5}, "data.train_transform.random_erasing=1.5 is a probability"),
    ({"auto_augment": "autoaugment", "auto_augment_magnitude": 3}, "no meaning for autoaugment"),
])
def test_bad_augmentation_settings_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassificationPresetTrain(preset="imagenet", image_size=32, **kwargs)


def test_torchvisions_order_crop_flip_policy_erasing_then_the_float_stage():
    preset = ClassificationPresetTrain(preset="imagenet", image_size=32, auto_augment="randaugment",
                                       random_erasing=0.5)
    assert [type(t).__name__ for t in preset.transforms.transforms] == [
        "RandomResizedCropFlip", "RandAugment", "RandomErasing", "ToDtype", "Normalize"]
    out = preset(_image())
    assert out.dtype == torch.float32 and out.shape == (3, 32, 32)


def test_the_datamodule_trains_at_train_image_size_and_evaluates_at_eval_image_size(tmp_path):
    """FixRes: smaller training crops than evaluation images; the augmentation keys reach the training transform."""
    root = make_image_folder(tmp_path / "images", {"a": 4, "b": 4}, size=48)
    data = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0,
                                 train_transform=ClassificationPresetTrain(image_size=32, auto_augment="trivialaugment",
                                                                           random_erasing=0.25),
                                 eval_transform=ClassificationPresetEval(image_size=40))
    data.setup("fit")
    x_train, _ = next(iter(data.train_dataloader()))
    x_val, _ = next(iter(data.val_dataloader()))
    assert (x_train.shape[-1], x_val.shape[-1]) == (32, 40)
    assert x_train.dtype == x_val.dtype == torch.uint8  # the float stage runs after the copy to the device
    steps = [type(t).__name__ for t in data.train_set.transform.transforms.transforms]
    assert steps == ["RandomResizedCropFlip", "TrivialAugmentWide", "RandomErasing"]
    assert data.train_set.transform.transforms.transforms[-1].p == 0.25
    with pytest.raises(ValueError, match="data.eval_transform.image_size=16 is below 32"):
        ImageFolderDataModule(root=str(root), eval_transform=ClassificationPresetEval(image_size=16))
    with pytest.raises(ValueError, match="data.train_transform.auto_augment='flip' is unknown"):
        ImageFolderDataModule(root=str(root), train_transform=ClassificationPresetTrain(auto_augment="flip"))


def test_progressive_resizing_follows_its_schedule_on_training_batches_only(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 4, "b": 4}, size=64)
    data = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=64,
                                 progressive_resizing={0: 32, 2: 48, 4: 64})
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape[-1] == 64 and x.dtype == torch.uint8  # the loaders keep producing full-size crops
    data.trainer = types.SimpleNamespace(training=True, current_epoch=0, precision_plugin=Precision())
    sides = []
    for epoch in range(6):
        data.trainer.current_epoch = epoch
        out, _ = data.on_after_batch_transfer((x, y), 0)
        sides.append(out.shape[-1])
        assert out.dtype == torch.float32
    assert sides == [32, 32, 48, 48, 64, 64]
    data.trainer.current_epoch, data.trainer.training = 0, False  # validation keeps its size
    assert data.on_after_batch_transfer((x, y), 0)[0].shape[-1] == 64
    with pytest.raises(ValueError, match=r"data.progressive_resizing has entries \{3: 96\}"):
        ImageFolderDataModule(root=str(root), image_size=64, progressive_resizing={0: 32, 3: 96})
