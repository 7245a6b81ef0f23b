"""Named transform presets (torchvision transforms v2), chosen by name in the config."""

from __future__ import annotations

from typing import Literal

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Preset = Literal["imagenet", "keras", "none"]
PRESETS: tuple[str, ...] = ("imagenet", "keras", "none")


class ClassificationPresetTrain:
    """Training-time augmentation: PIL image in, float tensor (3, H, W) out."""

    def __init__(self, *, preset: Preset = "imagenet", image_size: int = 224) -> None:
        if preset == "imagenet":
            # RandomResizedCrop works on uint8 before the float conversion: cheaper per pixel.
            steps = [
                v2.PILToTensor(),
                v2.RandomResizedCrop(image_size, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        elif preset == "keras":
            # The Keras ImageDataGenerator recipe of the seed: rotation ±20°, shifts of 0.2, flip, rescale 1/255.
            steps = [
                v2.PILToTensor(),
                v2.Resize((image_size, image_size), antialias=True),
                v2.RandomAffine(degrees=20, translate=(0.2, 0.2)),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
            ]
        elif preset == "none":
            steps = _plain(image_size)
        else:
            raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        self.transforms = v2.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetEval:
    """Evaluation transform: deterministic resize (and crop for `imagenet`)."""

    def __init__(self, *, preset: Preset = "imagenet", image_size: int = 224) -> None:
        if preset == "imagenet":
            # The usual 0.875 crop ratio: resize the short side to size/0.875, then center-crop.
            steps = [
                v2.PILToTensor(),
                v2.Resize(int(round(image_size / 0.875)), antialias=True),
                v2.CenterCrop(image_size),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        elif preset in ("keras", "none"):
            steps = _plain(image_size)
        else:
            raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        self.transforms = v2.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


def _plain(image_size: int) -> list:
    """Resize to a square (so batches stack) and rescale pixels to [0, 1]; no augmentation."""
    return [
        v2.PILToTensor(),
        v2.Resize((image_size, image_size), antialias=True),
        v2.ToDtype(torch.float32, scale=True),
    ]
