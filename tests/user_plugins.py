"""A user's own data source, outside the packages, as docs/EXTENDING.md shows one: plugged in by
`--data.class_path tests.user_plugins.TensorData` alone."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from datamodules import ClassificationData


class Flipped(Dataset):
    """(image, target) pairs of a TensorDataset, each image flipped left-right at random (torch's generator)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        self.data = TensorDataset(images, targets)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        image, target = self.data[index]
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), target


class TensorData(ClassificationData):
    """Two classes of noise images held in memory, dark and bright.

    Args:
        images: images per split.
        image_size: side of the square images.
        **kwargs: the loader settings of ClassificationData (batch_size, num_workers, ...).
    """

    def __init__(self, images: int = 32, image_size: int = 32, **kwargs) -> None:
        super().__init__(**kwargs)
        self.images, self.image_size = images, image_size
        self.class_names = ["dark", "bright"]

    def _split(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        targets = torch.arange(self.images) % 2
        images = torch.rand(self.images, 3, self.image_size, self.image_size, generator=generator) * 0.5
        return images + 0.5 * targets[:, None, None, None], targets  # (N, 3, S, S) floats in [0, 1], (N,)

    def setup(self, stage: str) -> None:
        self.train_set = Flipped(*self._split(0))  # drawn by (index, seed): the base class seeds each flip
        self.val_set = self.test_set = TensorDataset(*self._split(1))
