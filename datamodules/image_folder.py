"""The LightningDataModule for folders of images: train/, val/ and optional test/, one sub-folder per class.

    imgcls fit --config configs/quickstart.yaml --data.root /path/to/images
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset

from datamodules.images import find_classes, list_images, read_image, scan_split
from datamodules.presets import (
    PRESETS,
    ClassificationPresetEval,
    ClassificationPresetTrain,
    Preset,
    float_transform,
)


class ImageFiles(Dataset):
    """(image, class index) pairs from a list of (path, class index)."""

    def __init__(self, samples: list[tuple[str, int]], transform) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        return self.transform(read_image(path)), target


class PredictImages(Dataset):
    """(image, index) for unlabeled images; the index maps back to `paths` when predictions are written."""

    def __init__(self, paths: list[str], transform) -> None:
        self.paths = paths
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(read_image(self.paths[index])), index


def default_num_workers(devices_per_node: int = 1) -> int:
    """Loader processes per device: the CPUs this process may use, shared by the devices, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // max(1, devices_per_node)))


class ImageFolderDataModule(L.LightningDataModule):
    """Image-folder data with ImageFolder semantics (classes are the sorted sub-folder names).

    Args:
        root: folder holding ``train/``, ``val/`` (optional: else ``val_split`` of train) and ``test/`` (optional).
            May be null for ``predict`` from a checkpoint, which carries the class names.
        batch_size: images per device and step; the global batch is world size x batch_size x accumulation.
        num_workers: loader processes per device; null derives it from the CPU count.
        val_split: fraction of ``train/`` held out, stratified and seeded, when there is no ``val/``.
        split_seed: seed of that split; the same split on every process and every run.
        preset: transform preset, one of ``imagenet``, ``keras``, ``none``.
        image_size: side of the square image fed to the network.
        prefetch_factor: batches each worker loads ahead.
        persistent_workers: keep loader processes alive between epochs.
        pin_memory: page-locked host memory for faster copies; null means "when training on CUDA".
        predict_dir: folder of images (nested folders allowed) for ``imgcls predict``.
        normalize_on_device: workers yield uint8 batches and the float conversion and normalization run after the
            copy to the device (same values, 4x fewer bytes moved); false yields float batches from the workers.
    """

    def __init__(
        self,
        root: str | None = "data/digits",
        batch_size: int = 64,
        num_workers: int | None = None,
        val_split: float = 0.1,
        split_seed: int = 0,
        preset: Preset = "imagenet",
        image_size: int = 224,
        prefetch_factor: int = 2,
        persistent_workers: bool = True,
        pin_memory: bool | None = None,
        predict_dir: str | None = None,
        normalize_on_device: bool = True,
    ) -> None:
        super().__init__()
        _check_args(batch_size, num_workers, val_split, preset, image_size)
        self.save_hyperparameters()
        self.root = Path(root).expanduser() if root is not None else None
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_split = val_split
        self.split_seed = split_seed
        self.preset = preset
        self.image_size = image_size
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.predict_dir = Path(predict_dir).expanduser() if predict_dir is not None else None
        self.normalize_on_device = normalize_on_device
        self.float_transform = float_transform(preset)  # uint8 (B, 3, H, W) -> float32 (B, 3, H, W)
        # Class names are read now (a directory listing, cheap) so that the CLI can link them into the model.
        self.class_names: list[str] | None = self._read_class_names() if self.root is not None else None
        self.train_set = self.val_set = self.test_set = self.predict_set = None

    @property
    def num_classes(self) -> int | None:
        return len(self.class_names) if self.class_names is not None else None

    def _read_class_names(self) -> list[str]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.root={self.root} does not exist; run `imgcls demo-data {self.root}` "
                                    "or point data.root at a folder with train/ and val/")
        classes = find_classes(self.root / "train")
        if len(classes) < 2:
            raise ValueError(f"{self.root / 'train'} has a single class ({classes[0]}); classification needs two or more")
        for split in ("val", "test"):
            split_dir = self.root / split
            if split_dir.is_dir():
                other = find_classes(split_dir)
                if other != classes:
                    missing, extra = sorted(set(classes) - set(other)), sorted(set(other) - set(classes))
                    raise ValueError(
                        f"{split}/ classes differ from train/ (root: {self.root}): "
                        f"missing from {split}/: {missing or 'none'}, not in train/: {extra or 'none'}"
                    )
        return classes

    # ---- datasets -------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        uint8 = self.normalize_on_device
        train_tf = ClassificationPresetTrain(preset=self.preset, image_size=self.image_size, uint8_output=uint8)
        eval_tf = ClassificationPresetEval(preset=self.preset, image_size=self.image_size, uint8_output=uint8)
        if stage == "predict":
            if self.predict_dir is None:
                raise ValueError("data.predict_dir is not set; pass --data.predict_dir FOLDER_OF_IMAGES")
            if not self.predict_dir.is_dir():
                raise FileNotFoundError(f"data.predict_dir={self.predict_dir} is not a folder")
            paths = list_images(self.predict_dir)
            if not paths:
                raise FileNotFoundError(f"data.predict_dir={self.predict_dir} holds no images")
            self.predict_set = PredictImages(paths, eval_tf)
            return
        if self.root is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root FOLDER")
        if stage in ("fit", "validate"):
            train, val = self._train_val_samples()
            self.train_set = ImageFiles(train, train_tf)
            self.val_set = ImageFiles(val, eval_tf)
        if stage == "test":
            test_dir = self.root / "test"
            if not test_dir.is_dir():
                raise FileNotFoundError(f"{test_dir} does not exist; `imgcls test` needs a test/ split")
            self.test_set = ImageFiles(scan_split(test_dir, self.class_names), eval_tf)

    def _train_val_samples(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        train = scan_split(self.root / "train", self.class_names)
        if (self.root / "val").is_dir():
            return train, scan_split(self.root / "val", self.class_names)
        # Seeded and stratified, over a sorted file list: every rank and every run gets the same split.
        targets = [t for _, t in train]
        try:
            train_idx, val_idx = train_test_split(
                range(len(train)), test_size=self.val_split, stratify=targets, random_state=self.split_seed
            )
        except ValueError as err:  # sklearn: a class too small to appear on both sides
            raise ValueError(
                f"data.val_split={self.val_split} of {self.root / 'train'} leaves a class empty ({err}); "
                "add a val/ folder or images, or change data.val_split"
            ) from None
        kept = {train[i][1] for i in val_idx}
        if len(kept) < len(self.class_names):
            empty = [self.class_names[c] for c in range(len(self.class_names)) if c not in kept]
            raise ValueError(f"data.val_split={self.val_split} leaves class(es) {empty} with no validation image; "
                             "raise data.val_split or add a val/ folder")
        return [train[i] for i in sorted(train_idx)], [train[i] for i in sorted(val_idx)]

    # ---- loaders --------------------------------------------------------------------------------------------

    def _loader(self, dataset: Dataset, *, shuffle: bool, drop_last: bool = False) -> DataLoader:
        trainer = self.trainer
        workers = self.num_workers
        if workers is None:
            workers = default_num_workers(trainer.num_devices if trainer is not None else 1)
        on_cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=on_cuda if self.pin_memory is None else self.pin_memory,
            persistent_workers=self.persistent_workers and workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        # drop_last keeps every step's batch (and so BatchNorm statistics and the LR scale) the same size.
        return self._loader(self.train_set, shuffle=True, drop_last=len(self.train_set) > self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, shuffle=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """uint8 images -> float32, normalized, on the device; the second element (targets or indices) is kept."""
        x, y = batch
        if x.dtype == torch.uint8:
            x = self.float_transform(x)
        return x, y


def _check_args(batch_size, num_workers, val_split, preset, image_size) -> None:
    """Reject bad config values up front, naming the key."""
    if batch_size < 1:
        raise ValueError(f"data.batch_size={batch_size} must be at least 1")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers} must be >= 0 (or null for automatic)")
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"data.val_split={val_split} must be between 0 and 1")
    if preset not in PRESETS:
        raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
    if image_size < 32:
        raise ValueError(f"data.image_size={image_size} is below 32, too small for a ResNet (5 stride-2 stages)")
