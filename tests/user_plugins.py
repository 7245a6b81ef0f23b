"""A researcher's own parts, outside the packages, plugged in by `class_path` alone: a network, a loss, a schedule
(tests/test_seams.py), a data source (tests/test_data_sources.py) and transforms (tests/test_transforms.py), as
docs/EXTENDING.md shows them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torchvision.transforms.v2 import functional as TF

from datamodules import ClassificationData


class GeM(nn.Module):
    """Generalised-mean pooling (Radenovic et al., 2018): (B, C, H, W) -> (B, C), mean of x ** p, p learnt."""

    def __init__(self, p: float = 3.0) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=1e-6).pow(self.p).mean(dim=(2, 3)).pow(1 / self.p)


class SmallGeMNet(nn.Module):
    """A small conv backbone, then its own head: GeM pooling and a linear layer."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width),
                                      nn.ReLU())
        self.pool = GeM()
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))  # (B, 3, H, W) -> (B, 2 * width) -> (B, num_classes)

    def head_modules(self) -> list[nn.Module]:
        return [self.pool, self.classifier]


class FocalLoss(nn.Module):
    """Focal loss (Lin et al., 2017) on class indices or soft targets: cross-entropy weighted by (1 - p_t) ** gamma."""

    def __init__(self, gamma: float = 2.0) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=1)
        soft = F.one_hot(target, logits.shape[1]).float() if target.ndim == 1 else target.float()
        weight = (1 - log_p.exp()) ** self.gamma
        return -(soft * weight * log_p).sum(dim=1).mean()


class LinearDecay(torch.optim.lr_scheduler.LambdaLR):
    """From each group's lr down to 0 at the run's last step; `total_steps` comes from the model."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int | None = None) -> None:
        super().__init__(optimizer, lambda step: max(0.0, 1 - step / total_steps))

class ChannelJitter(nn.Module):
    """Shifts each colour channel of a uint8 (3, H, W) image by a random offset in [-strength, strength] (torch's
    generator), clamped to [0, 255]: a training step inside a torchvision v2 Compose."""

    def __init__(self, strength: int = 20) -> None:
        super().__init__()
        self.strength = strength

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        offset = torch.randint(-self.strength, self.strength + 1, (3, 1, 1))
        return (image.to(torch.int16) + offset).clamp(0, 255).to(torch.uint8)


class SquareResize(nn.Module):
    """An evaluation transform: the whole image resized to `size` x `size` (uint8 out). It states what export and
    serving need: image_size, and the mean and std of the float stage that follows."""

    def __init__(self, size: int = 32, mean: float = 0.5, std: float = 0.25) -> None:
        super().__init__()
        self.image_size, self.mean, self.std = size, [mean] * 3, [std] * 3

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return TF.resize(image, [self.image_size, self.image_size], antialias=True)


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
        self.predict_set = Named(self._split(2)[0])


class Named(Dataset):
    """(image, index) pairs for predict, each named in predictions.csv by `paths`."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images
        self.paths = [f"tensor_{i:03d}" for i in range(len(images))]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], index
