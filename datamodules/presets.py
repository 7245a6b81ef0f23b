"""Named transform presets (torchvision transforms v2), chosen by name in the config."""

from __future__ import annotations

from typing import Literal

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Preset = Literal["imagenet", "keras", "none"]
PRESETS: tuple[str, ...] = ("imagenet", "keras", "none")


def float_transform(preset: Preset) -> v2.Compose:
    """The last, per-pixel stage of every preset: uint8 (..., 3, H, W) -> float32 in [0, 1], normalized for imagenet.

    The DataModule runs it on whole batches after the host-to-device copy, so workers ship uint8 (4x fewer bytes
    through shared memory and the copy) and the arithmetic runs on the accelerator.
    """
    _check_preset(preset)
    steps = [v2.ToDtype(torch.float32, scale=True)]
    if preset == "imagenet":
        steps.append(v2.Normalize(IMAGENET_MEAN, IMAGENET_STD))
    return v2.Compose(steps)


class ClassificationPresetTrain:
    """Training-time augmentation: PIL image or uint8 tensor in, float tensor (3, H, W) out.

    With ``uint8_output=True`` it stops before `float_transform` and returns the uint8 tensor (3, H, W).
    """

    def __init__(self, *, preset: Preset = "imagenet", image_size: int = 224, uint8_output: bool = False) -> None:
        _check_preset(preset)
        if preset == "imagenet":
            # RandomResizedCrop works on uint8 before the float conversion: cheaper per pixel.
            steps = [
                v2.PILToTensor(),
                v2.RandomResizedCrop(image_size, antialias=True),
                v2.RandomHorizontalFlip(),
            ]
        elif preset == "keras":
            # The classic Keras ImageDataGenerator recipe: rotation ±20°, shifts of 0.2, flip, rescale 1/255.
            steps = [
                v2.PILToTensor(),
                v2.Resize((image_size, image_size), antialias=True),
                v2.RandomAffine(degrees=20, translate=(0.2, 0.2)),
                v2.RandomHorizontalFlip(),
            ]
        else:
            steps = _plain(image_size)
        self.transforms = v2.Compose(steps if uint8_output else [*steps, *float_transform(preset).transforms])

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetEval:
    """Evaluation transform: deterministic resize (and crop for `imagenet`); ``uint8_output`` as for training."""

    def __init__(self, *, preset: Preset = "imagenet", image_size: int = 224, uint8_output: bool = False) -> None:
        _check_preset(preset)
        if preset == "imagenet":
            # The usual 0.875 crop ratio: resize the short side to size/0.875, then center-crop.
            steps = [
                v2.PILToTensor(),
                v2.Resize(int(round(image_size / 0.875)), antialias=True),
                v2.CenterCrop(image_size),
            ]
        else:
            steps = _plain(image_size)
        self.transforms = v2.Compose(steps if uint8_output else [*steps, *float_transform(preset).transforms])

    def __call__(self, img):
        return self.transforms(img)


def _plain(image_size: int) -> list:
    """Resize to a square (so batches stack); no augmentation. `float_transform` rescales pixels to [0, 1]."""
    return [v2.PILToTensor(), v2.Resize((image_size, image_size), antialias=True)]


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
