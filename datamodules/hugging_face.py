"""Hugging Face `datasets` as a data source (the ``hf`` extra: ``pip install 'imgcls[hf]'``): a dataset saved with
``save_to_disk``, or a local folder that the ``imagefolder`` builder reads. Nothing is downloaded.

    imgcls fit --config configs/quickstart.yaml --data.class_path datamodules.HFDataModule --data.root my_dataset
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import numpy as np

from core.config_types import OpenUnitInterval
from datamodules.datasets import SeededImages
from datamodules.decoding import decode_bytes
from datamodules.image_data import ImageData, Transforms
from datamodules.listing import hold_out

VAL_SPLITS = ("validation", "val", "valid")  # the names a validation split goes by on the Hub


def _datasets():
    try:
        import datasets  # an optional extra, and a slow import: only for this source
    except ImportError:
        raise ImportError("datamodules.HFDataModule reads Hugging Face datasets, which is not installed; "
                          "pip install 'imgcls[hf]'") from None
    return datasets


def load_splits(root: Path) -> dict:
    """The splits at `root` by name: a `save_to_disk` folder (a DatasetDict, or one Dataset, taken as train), else a
    folder of images read by the `imagefolder` builder (train/, validation/ or val/, test/ of class folders)."""
    datasets = _datasets()
    if not root.is_dir():
        raise FileNotFoundError(f"data.root={root} does not exist; point it at a dataset saved with save_to_disk or "
                                "a folder of images (train/, validation/, test/ of class folders)")
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        loaded = datasets.load_from_disk(str(root))
    else:
        loaded = datasets.load_dataset("imagefolder", data_dir=str(root))
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


class HFImages(SeededImages):
    """The rows of a Hugging Face dataset as (image, target) pairs: the image column's file bytes, decoded as
    `read_image` decodes files (or left encoded for fast_decode and augment_on_device), the label column's class."""

    def __init__(self, dataset, image_column: str, targets: np.ndarray, transform, *, encoded: bool = False,
                 rows: np.ndarray | None = None, split: str = "train") -> None:
        datasets = _datasets()
        # The file's bytes, not the PIL image `datasets` would decode: the same pixels as the other sources.
        self.dataset = dataset.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
        self.image_column, self.transform, self.encoded, self.split = image_column, transform, encoded, split
        self.rows = np.arange(len(dataset), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        self.targets = targets[self.rows]

    def _cell(self, index: int) -> dict:
        return self.dataset[int(self.rows[index])][self.image_column]  # {"bytes": ..., "path": ...}

    def _image(self, index: int):
        cell = self._cell(index)
        data = cell["bytes"] if cell["bytes"] is not None else Path(cell["path"]).read_bytes()
        return decode_bytes(data, encoded=self.encoded)

    def _name(self, index: int) -> str:
        return f"row {int(self.rows[index])} of split {self.split} ({self._cell(index).get('path')})"


@dataclass(eq=False, repr=False)
class HFDataModule(ImageData):
    """A Hugging Face dataset with an image column (an ``Image`` feature) and a label column (a ``ClassLabel``,
    whose names are the class names), read from `root`: a folder written by ``save_to_disk`` (a ``DatasetDict`` with
    a ``train`` split, a ``validation`` or ``val`` split (optional: else ``val_split`` of train is held out) and a
    ``test`` split (optional), or a single ``Dataset``, taken as train), or a folder of images that the
    ``imagefolder`` builder reads. Images are decoded from their stored bytes exactly as files are, and a bad image
    fails when it is read, naming its row (there is no start scan of the rows).
    """

    root: str | None = None
    """The dataset's folder. May be null for ``predict`` from a checkpoint, which carries the class names."""
    _: KW_ONLY
    image_column: str = "image"
    """The column of the images."""
    label_column: str = "label"
    """The column of the labels; a ``ClassLabel`` (``dataset.class_encode_column(name)`` makes one of a column of
    strings)."""
    val_split: OpenUnitInterval = 0.1
    """Fraction of train held out, seeded and stratified by class, when there is no validation split."""
    split_seed: int = 0
    """Seed of that split; the same split on every process and every run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.folder = Path(self.root).expanduser() if self.root else None
        self.splits: dict | None = None
        if self.folder is not None:  # memory-mapped Arrow files: opening them reads no image
            self.splits = load_splits(self.folder)
            self.class_names = self._read_class_names()

    def _read_class_names(self) -> list[str]:
        if "train" not in self.splits:
            raise ValueError(f"the dataset at {self.folder} has the splits {sorted(self.splits)}, and no train split")
        features = self.splits["train"].features
        for column in (self.image_column, self.label_column):
            if column not in features:
                raise ValueError(f"the dataset at {self.folder} has no column {column!r} (its columns: "
                                 f"{', '.join(features)}); set data.image_column and data.label_column")
        label = features[self.label_column]
        names = getattr(label, "names", None)
        if type(label).__name__ != "ClassLabel" or not names:
            raise ValueError(f"data.label_column={self.label_column!r} of {self.folder} is {label}, not a ClassLabel: "
                             f"save the dataset after dataset.class_encode_column({self.label_column!r})")
        if len(names) < 2:
            raise ValueError(f"the dataset at {self.folder} has a single class ({names}); classification needs two or "
                             "more")
        return list(names)

    def _split(self, name: str, transform, encoded: bool, rows: np.ndarray | None = None) -> HFImages:
        dataset = self.splits[name]
        if dataset.features.get(self.label_column) != self.splits["train"].features[self.label_column]:
            raise ValueError(f"split {name} of {self.folder} has other classes than train: "
                             f"{dataset.features.get(self.label_column)}")
        targets = np.fromiter(dataset[self.label_column], np.int64, len(dataset))
        return HFImages(dataset, self.image_column, targets, transform, encoded=encoded, rows=rows, split=name)

    def setup_datasets(self, stage: str, transforms: Transforms) -> None:
        if self.folder is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root DATASET_FOLDER")
        if stage in ("fit", "validate") and self.train_set is None:
            val = next((name for name in VAL_SPLITS if name in self.splits), None)
            rows = None
            if val is None:  # a seeded, stratified share of train, as the image folder holds out
                train = self.splits["train"]
                pairs = list(enumerate(np.fromiter(train[self.label_column], np.int64, len(train)).tolist()))
                kept, held = hold_out(pairs, self.val_split, self.split_seed, self.class_names, False,
                                      self.folder / "train")
                rows = {"train": np.array([i for i, _ in kept]), "val": np.array([i for i, _ in held])}
            self.train_set = self._split("train", transforms.train, transforms.train_encoded,
                                         rows["train"] if rows else None)
            self.val_set = self._split(val or "train", transforms.eval, transforms.eval_encoded,
                                       rows["val"] if rows else None)
        if stage == "test":
            if "test" not in self.splits:
                raise FileNotFoundError(f"the dataset at {self.folder} has no test split (its splits: "
                                        f"{', '.join(self.splits)}); `imgcls test` needs one")
            self.test_set = self._split("test", transforms.eval, transforms.eval_encoded)
