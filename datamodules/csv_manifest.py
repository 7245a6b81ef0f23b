"""Single-label images listed in CSV files, one per split: the images stay where they are, in any layout.

    imgcls fit --config configs/quickstart.yaml --data.class_path datamodules.CsvDataModule --data.root my_lists
"""

from __future__ import annotations

import csv
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from core.config_types import OpenUnitInterval
from datamodules.image_data import ImageData
from datamodules.listing import FileSplits, Samples, read_image_list


def read_manifest(file: Path) -> list[tuple[str, str]]:
    """(image path, label) of every row of a split's CSV file: header ``path,label``, a path relative to the file's
    folder (or absolute), one class name per row. Errors name the file, the row and the fix."""
    with open(file, newline="") as f:
        fields = next(csv.reader(f), [])
    if "labels" in fields and "label" not in fields:
        raise ValueError(f"{file} has a labels column (several labels per image): multi-label data goes in a "
                         "labels.csv in each split folder, read by datamodules.ImageFolderDataModule; this "
                         "single-label file needs the header path,label")
    return read_image_list(file, "label", required=True)


class CsvSplits(FileSplits):
    """train.csv, val.csv and test.csv below the root (`read_manifest`); the classes are the labels train.csv uses."""

    def read_classes(self) -> tuple[list[str], bool]:
        train = self.path("train")
        if not train.is_file():
            raise FileNotFoundError(f"{train} does not exist: data.root={self.root} must hold train.csv (header "
                                    "path,label), and optionally val.csv and test.csv")
        classes = sorted({label for _, label in read_manifest(train)})
        if len(classes) < 2:
            raise ValueError(f"{train} uses a single class ({classes[0]}); classification needs two or more")
        return classes, False

    def path(self, split: str) -> Path:
        return self.root / f"{split}.csv"

    def samples(self, split: str) -> Samples:
        file = self.path(split)
        rows = read_manifest(file)
        index = {name: i for i, name in enumerate(self.class_names)}
        unknown = sorted({label for _, label in rows} - index.keys())
        if unknown:
            raise ValueError(f"{file} uses label(s) {unknown[:10]} that train.csv never does; the model has one output "
                             "per class of train.csv")
        return [(path, index[label]) for path, label in rows]


@dataclass(eq=False, repr=False)
class CsvDataModule(ImageData):
    """Single-label images listed in CSV manifests under `root`: ``train.csv``, ``val.csv`` (optional: else
    ``val_split`` of train is held out) and ``test.csv`` (optional), each with the header ``path,label``: the image's
    path relative to `root` (or absolute) and its class name. The classes are the labels train.csv uses, sorted;
    val.csv and test.csv may use only those. Multi-label data keeps its own layout (a ``labels.csv`` with a
    ``labels`` column in each split folder), read by `ImageFolderDataModule`.
    """

    root: str | None = None
    """The folder of the CSV files. May be null for ``predict`` from a checkpoint, which carries the classes."""
    _: KW_ONLY
    val_split: OpenUnitInterval = 0.1
    """Fraction of train.csv held out, seeded and stratified by class, when there is no val.csv."""
    split_seed: int = 0
    """Seed of that split; the same split on every process and every run."""

    def listing(self) -> CsvSplits | None:
        return CsvSplits(Path(self.root).expanduser(), self.val_split, self.split_seed) if self.root else None
