"""The LightningDataModule for folders of images: train/, val/ and optional test/, one sub-folder per class (or a
labels.csv per split folder for multi-label data). The CLI's default data source.

    imgcls fit --config configs/quickstart.yaml --data.root /path/to/images
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from core.config_types import OpenUnitInterval
from datamodules.image_data import ImageData
from datamodules.listing import FileSplits, Samples, is_multilabel, read_class_names, split_samples


class FolderSplits(FileSplits):
    """train/, val/ and test/ below the root: class folders (ImageFolder semantics: the classes are train/'s sorted
    sub-folder names), or a labels.csv in each (multi-label)."""

    def read_classes(self) -> tuple[list[str], bool]:
        multilabel = self.root.is_dir() and is_multilabel(self.root)  # train/labels.csv
        return read_class_names(self.root, multilabel), multilabel

    def path(self, split: str) -> Path:
        return self.root / split

    def samples(self, split: str) -> Samples:
        return split_samples(self.root / split, self.class_names, self.multilabel)


@dataclass(eq=False, repr=False)
class ImageFolderDataModule(ImageData):
    """Image-folder data with ImageFolder semantics (classes are the sorted sub-folder names), or multi-label data.

    Multi-label: each split folder holds its images (in any sub-folders) and ``labels.csv`` with the columns
    ``path`` (relative to the split folder) and ``labels`` (separated by spaces or ``|``; empty for none). The
    classes are the labels that ``train/labels.csv`` uses, sorted, and each target is a multi-hot row. The model
    then has sigmoid outputs and a binary cross-entropy per class (linked by the CLI as ``model.multilabel``).
    Single-label data listed in a CSV file instead of class folders: `datamodules.CsvDataModule`.
    """

    root: str | None = "data/digits"
    """Folder holding ``train/``, ``val/`` (optional: else ``val_split`` of train) and ``test/`` (optional). May be
    null for ``predict`` from a checkpoint, which carries the class names."""
    _: KW_ONLY
    val_split: OpenUnitInterval = 0.1
    """Fraction of train/ held out, seeded (and stratified by class, single-label), when there is no val/."""
    split_seed: int = 0
    """Seed of that split; the same split on every process and every run."""

    def listing(self) -> FolderSplits | None:
        return FolderSplits(Path(self.root).expanduser(), self.val_split, self.split_seed) if self.root else None
