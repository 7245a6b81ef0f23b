"""The datasets behind the loaders: samples drawn by (index, seed) for exact resumes, (path, target) pairs held in
numpy arrays so that forked loader workers copy nothing, and the collate functions of their batches."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from core.seeding import seeded_cpu_draws
from datamodules.decoding import read_image


class _ArraySequence(Sequence):
    """A read-only sequence over numpy arrays: slices give lists, and it equals any sequence of the same items."""

    def _item(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        return self._item(range(len(self))[index])  # negative indices, numpy ints, IndexError past the end

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None


class PathArray(_ArraySequence):
    """Paths held as one uint8 array of their encoded bytes and an int64 array of offsets: two objects however many
    paths, so that loader workers reading them copy nothing. A list of str is copied into every forked worker as it
    is read, since reading writes each object's reference count (pytorch/pytorch#13246)."""

    def __init__(self, paths: Iterable[str]) -> None:
        encoded = [os.fsencode(p) for p in paths]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)  # path i is data[offsets[i]:offsets[i + 1]]
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _item(self, index: int) -> str:
        return os.fsdecode(self.data[self.offsets[index]:self.offsets[index + 1]].tobytes())


class SampleArray(_ArraySequence):
    """(path, class index) pairs, as torchvision's ImageFolder.samples, read from a PathArray and an int64 array."""

    def __init__(self, paths: PathArray, targets: np.ndarray) -> None:
        self.paths, self.targets = paths, targets

    def __len__(self) -> int:
        return len(self.targets)

    def _item(self, index: int) -> tuple[str, int | np.ndarray]:
        target = self.targets[index]
        return self.paths[index], target if target.ndim else int(target)


class UnreadableImageError(ValueError):
    """An image that could not be read during training (it broke after the start-of-fit scan)."""


class SeededImages(Dataset):
    """(image, target) samples drawn by index, or by (index, seed) as the training sampler yields them
    (`SeededDraws`): the transform's random draws then come from that seed alone, inside a forked generator, so
    the process's own random state is left as it was and a resumed run draws what the uninterrupted one drew.

    A subclass holds `targets` (int64 class indices, or (N, C) uint8 multi-hot rows) and `transform`, and reads
    sample `index` in `_image(index)` (a decoded uint8 (3, H, W) image, or what the transform decodes itself);
    `transform` None (augment_on_device) returns what was read, with the draw's seed for `DeviceBatches.augment`.
    """

    targets: np.ndarray
    transform = None

    def __len__(self) -> int:
        return len(self.targets)

    def _image(self, index: int):
        raise NotImplementedError

    def _name(self, index: int) -> str:
        """How errors name sample `index` (its path)."""
        raise NotImplementedError

    def _load(self, index: int):
        # A file that broke after the start-of-fit scan: name it, instead of a bare PIL error from a worker. The
        # transform is inside too: with data.fast_decode it decodes the JPEG.
        try:
            image = self._image(index)
            return self.transform(image) if self.transform is not None else image
        except Exception as err:
            raise UnreadableImageError(f"cannot read image {self._name(index)}: {err}; remove or replace it "
                                       "(data.bad_images: skip drops unreadable files at the start of fit)") from err

    def __getitem__(self, item: int | tuple[int, int]) -> tuple:
        index, seed = item if isinstance(item, tuple) else (item, None)
        target = self.targets[index]
        target = torch.from_numpy(target.astype(np.float32)) if target.ndim else int(target)
        if seed is None:
            return self._load(index), target
        if self.transform is None:  # augment_on_device: the seed travels with the file to `DeviceBatches.augment`
            return self._load(index), target, seed
        with seeded_cpu_draws(seed):
            return self._load(index), target


class SeededItems(Dataset):
    """Any map-style dataset of (image, target), indexed by (index, seed) pairs: each item is drawn with torch's
    global generator seeded by its seed, inside a forked generator. The base DataModule wraps a training set that is
    not a `SeededImages` in it; its random transforms must draw from torch's generator (torchvision's do)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def targets(self):
        return self.dataset.targets  # for data.sampler: balanced

    def __getitem__(self, item: int | tuple[int, int]):
        index, seed = item if isinstance(item, tuple) else (item, None)
        if seed is None:
            return self.dataset[index]
        with seeded_cpu_draws(seed):
            return self.dataset[index]


class ImageFiles(SeededImages):
    """(image, target) pairs from (path, target) pairs, stored in numpy arrays (`paths`, `targets`). A target is a
    class index, or for multi-label data a multi-hot row of 0/1 per class (given as a numpy array), which the
    dataset returns as a float tensor.

    `read` decodes a path (`read_image`), or only reads it (`read_encoded`, for ``augment_on_device``); `transform`
    None leaves its result as it is.
    """

    def __init__(self, samples: Iterable[tuple[str, int | np.ndarray]], transform, read=read_image) -> None:
        samples = list(samples)
        self.paths = PathArray(p for p, _ in samples)
        if samples and isinstance(samples[0][1], np.ndarray):  # (N, C) uint8: 1 byte per label
            self.targets = np.stack([t for _, t in samples]).astype(np.uint8)
        else:
            self.targets = np.fromiter((t for _, t in samples), np.int64, len(samples))
        self.transform = transform
        self.read = read

    @property
    def samples(self) -> SampleArray:
        return SampleArray(self.paths, self.targets)

    def _image(self, index: int):
        return self.read(self.paths[index])

    def _name(self, index: int) -> str:
        return self.paths[index]


class PredictImages(ImageFiles):
    """(image, index) for unlabeled images; the index maps back to `paths` when predictions are written."""

    def __init__(self, paths: list[str], transform, read=read_image) -> None:
        super().__init__([(p, i) for i, p in enumerate(paths)], transform, read)


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """(3, H, W) images -> a (B, 3, H, W) batch, channels_last when the images are stored HWC (interleaved).

    torch.stack would copy interleaved images into planar NCHW element by element (far slower than copying whole
    rows; benchmarks/input_pipeline.py), and the model converts the batch back to channels_last; stacking their HWC
    views copies them whole instead.
    """
    if images[0].stride(0) == 1:  # channels innermost: HWC, possibly a crop of a larger image
        return torch.stack([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
    return torch.stack(images)


def _stack_targets(targets: tuple) -> torch.Tensor:
    """Class indices -> (B,) int64; multi-hot rows -> (B, C) float32."""
    return torch.stack(targets) if isinstance(targets[0], torch.Tensor) else torch.tensor(targets)


def collate_images(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, targets = zip(*batch, strict=True)
    return stack_images(list(images)), _stack_targets(targets)


def collate_encoded(batch: list[tuple]) -> tuple:
    """Encoded files differ in length (and decoded ones in size): a list of them, the targets stacked, and the
    training draws' seeds (int64) when the sampler gave them."""
    images, targets, *seeds = zip(*batch, strict=True)
    return (list(images), _stack_targets(targets), *(torch.tensor(s) for s in seeds))
