"""Image files listed with their targets below a root, split by split: what the image folder and the CSV manifests
share (`ImageData.listing` returns one; `ImageData.setup_datasets` builds the datasets of its samples)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datamodules.splits import hold_out

Samples = list[tuple[str, int | np.ndarray]]  # (path, class index or multi-hot row)


class FileSplits:
    """The splits of image files below `root`. A subclass says where a split lives (`path`), reads the classes
    (`read_classes`, at construction: the CLI links them into the model) and lists a split's (path, target) pairs
    (`samples`); this class holds a seeded `val_split` share of train out when there is no val split."""

    def __init__(self, root: Path, val_split: float, split_seed: int) -> None:
        self.root, self.val_split, self.split_seed = root, val_split, split_seed
        self.class_names, self.multilabel = self.read_classes()

    def read_classes(self) -> tuple[list[str], bool]:
        """(the class names in target order, whether the data is multi-label)."""
        raise NotImplementedError

    def path(self, split: str) -> Path:
        """Where split `split` ("train", "val", "test") lives, present or not."""
        raise NotImplementedError

    def samples(self, split: str) -> Samples:
        """The (path, target) pairs of a split that is present."""
        raise NotImplementedError

    def has(self, split: str) -> bool:
        return self.path(split).exists()

    def train_val(self) -> tuple[Samples, Samples]:
        """The train and val samples: val's own, or val_split of train held out (stratified by class, single-label),
        the same on every process and every run."""
        train = self.samples("train")
        if self.has("val"):
            return train, self.samples("val")
        return hold_out(train, self.val_split, self.split_seed, self.class_names, self.multilabel, self.path("train"))

    def all(self) -> dict[str, Samples]:
        """(path, target) pairs of train, val and test if present, as fit and test list them: what `imgcls
        prepare-data` converts."""
        train, val = self.train_val()
        return {"train": train, "val": val, **({"test": self.samples("test")} if self.has("test") else {})}
