"""The LightningDataModule for folders of images: train/, val/ and optional test/, one sub-folder per class (or a
labels.csv per split folder for multi-label data). The CLI's default data source.

    imgcls fit --config configs/quickstart.yaml --data.root /path/to/images
"""

from __future__ import annotations

from pathlib import Path

from datamodules.files import ImageFileData, Samples
from datamodules.images import is_multilabel
from datamodules.splits import read_class_names, split_samples


class ImageFolderDataModule(ImageFileData):
    """Image-folder data with ImageFolder semantics (classes are the sorted sub-folder names), or multi-label data.

    Multi-label: each split folder holds its images (in any sub-folders) and ``labels.csv`` with the columns
    ``path`` (relative to the split folder) and ``labels`` (separated by spaces or ``|``; empty for none). The
    classes are the labels that ``train/labels.csv`` uses, sorted, and each target is a multi-hot row. The model
    then has sigmoid outputs and a binary cross-entropy per class (linked by the CLI as ``model.multilabel``).
    Single-label data listed in a CSV file instead of class folders: `datamodules.CsvDataModule`.

    Args:
        root: folder holding ``train/``, ``val/`` (optional: else ``val_split`` of train) and ``test/`` (optional).
            May be null for ``predict`` from a checkpoint, which carries the class names.
        **kwargs: ``val_split`` and ``split_seed`` (`ImageFileData`), the transform settings (`ImageData`: preset,
            image_size, ...) and the loader settings (`ClassificationData`: batch_size, num_workers, sampler, ...).
    """

    def __init__(self, root: str | None = "data/digits", **kwargs) -> None:
        super().__init__(root=root, **kwargs)

    def read_classes(self) -> tuple[list[str], bool]:
        multilabel = self.root.is_dir() and is_multilabel(self.root)  # train/labels.csv
        return read_class_names(self.root, multilabel), multilabel

    def split_path(self, split: str) -> Path:
        return self.root / split

    def samples_of(self, split: str) -> Samples:
        return split_samples(self.root / split, self.class_names, self.multilabel)
