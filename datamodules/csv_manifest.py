"""Single-label images listed in CSV files, one per split: the images stay where they are, in any layout.

    imgcls fit --config configs/quickstart.yaml --data.class_path datamodules.CsvDataModule --data.root my_lists
"""

from __future__ import annotations

import csv
from pathlib import Path

from datamodules.files import ImageFileData, Samples
from datamodules.images import read_image_list


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


class CsvDataModule(ImageFileData):
    """Single-label images listed in CSV manifests under `root`: ``train.csv``, ``val.csv`` (optional: else
    ``val_split`` of train is held out) and ``test.csv`` (optional), each with the header ``path,label``: the image's
    path relative to `root` (or absolute) and its class name. The classes are the labels train.csv uses, sorted;
    val.csv and test.csv may use only those. Multi-label data keeps its own layout (a ``labels.csv`` with a
    ``labels`` column in each split folder), read by `ImageFolderDataModule`.

    Args:
        root: the folder of the CSV files. May be null for ``predict`` from a checkpoint, which carries the classes.
        **kwargs: ``val_split`` and ``split_seed`` (`ImageFileData`), the transform settings (`ImageData`: preset,
            image_size, ...) and the loader settings (`ClassificationData`: batch_size, num_workers, sampler, ...).
    """

    def __init__(self, root: str | None = None, **kwargs) -> None:
        super().__init__(root=root, **kwargs)

    def read_classes(self) -> tuple[list[str], bool]:
        train = self.split_path("train")
        if not train.is_file():
            raise FileNotFoundError(f"{train} does not exist: data.root={self.root} must hold train.csv (header "
                                    "path,label), and optionally val.csv and test.csv")
        classes = sorted({label for _, label in read_manifest(train)})
        if len(classes) < 2:
            raise ValueError(f"{train} uses a single class ({classes[0]}); classification needs two or more")
        return classes, False

    def split_path(self, split: str) -> Path:
        return self.root / f"{split}.csv"

    def samples_of(self, split: str) -> Samples:
        file = self.split_path(split)
        rows = read_manifest(file)
        index = {name: i for i, name in enumerate(self.class_names)}
        unknown = sorted({label for _, label in rows} - index.keys())
        if unknown:
            raise ValueError(f"{file} uses label(s) {unknown[:10]} that train.csv never does; the model has one output "
                             "per class of train.csv")
        return [(path, index[label]) for path, label in rows]
