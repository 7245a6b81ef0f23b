"""Image files listed with their targets below a root: what the image folder and the CSV manifest share."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.config_types import OpenUnitInterval, check_arguments
from datamodules.datasets import ImageFiles
from datamodules.image_data import ImageData, Transforms
from datamodules.splits import hold_out

Samples = list[tuple[str, int | np.ndarray]]  # (path, class index or multi-hot row)


class ImageFileData(ImageData):
    """Image files below `root`, each with its target. A subclass says where a split lives (`split_path`), lists its
    (path, target) pairs (`samples_of`) and reads the classes (`read_classes`, at construction: the CLI links them
    into the model); this class holds a validation share of train out when there is no val split, scans the files
    once (data.bad_images) and builds the datasets.

    Args:
        root: the folder of the splits. May be null for ``predict`` from a checkpoint, which carries the classes.
        val_split: fraction of the train split held out, seeded (and stratified by class, single-label), when there
            is no val split.
        split_seed: seed of that split; the same split on every process and every run.
        **kwargs: the transform settings of `ImageData` and the loader settings of `ClassificationData`.
    """

    def __init__(self, root: str | None = None, val_split: OpenUnitInterval = 0.1, split_seed: int = 0,
                 **kwargs) -> None:
        check_arguments("data", ImageFileData.__init__, locals())
        super().__init__(**kwargs)
        self.root = Path(root).expanduser() if root else None
        self.val_split, self.split_seed = val_split, split_seed
        # Read now (a listing, cheap) so that the CLI can link them into the model.
        if self.root is not None:
            self.class_names, self.multilabel = self.read_classes()
        if self.multilabel and self.sampling == "balanced":
            raise ValueError(f"data.sampler=balanced weights each image by its class, and {self.root} is multi-label; "
                             "use data.sampler: random")

    # ---- what a subclass says -----------------------------------------------------------------------------

    def read_classes(self) -> tuple[list[str], bool]:
        """(the class names in target order, whether the data is multi-label)."""
        raise NotImplementedError

    def split_path(self, split: str) -> Path:
        """Where split `split` ("train", "val", "test") lives, present or not."""
        raise NotImplementedError

    def samples_of(self, split: str) -> Samples:
        """The (path, target) pairs of a split that is present."""
        raise NotImplementedError

    # ---- what this class does with it ---------------------------------------------------------------------

    def setup_datasets(self, stage: str, transforms: Transforms) -> None:
        if self.root is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root FOLDER")
        if stage in ("fit", "validate") and self.train_set is None:  # built once: `fit` validates again at its end
            train, val = self._train_val_samples()
            train, val = self.drop_bad(train, val, folder=self.root, scan="train-val")  # one scan, one message
            self.train_set = ImageFiles(train, transforms.train, transforms.read(train=True))
            self.val_set = ImageFiles(val, transforms.eval, transforms.read(train=False))
        if stage == "test":
            where = self.split_path("test")
            if not where.exists():
                raise FileNotFoundError(f"{where} does not exist; `imgcls test` needs a test split")
            (test,) = self.drop_bad(self.samples_of("test"), folder=self.root, scan="test")
            self.test_set = ImageFiles(test, transforms.eval, transforms.read(train=False))

    def split_samples(self) -> dict[str, Samples]:
        """(path, target) pairs of train, val (its own, or val_split of train) and test if present, as fit and test
        list them: what `imgcls prepare-data` converts."""
        train, val = self._train_val_samples()
        test = {"test": self.samples_of("test")} if self.split_path("test").exists() else {}
        return {"train": train, "val": val, **test}

    def _train_val_samples(self) -> tuple[Samples, Samples]:
        train = self.samples_of("train")
        if self.split_path("val").exists():
            return train, self.samples_of("val")
        return hold_out(train, self.val_split, self.split_seed, self.class_names, self.multilabel,
                        self.split_path("train"))
