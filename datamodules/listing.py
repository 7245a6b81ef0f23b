"""Which images a data source has, split by split: the image files below a folder, the classes and samples of an
image-folder tree (class folders, or a labels.csv per split), image lists in CSV files, and `FileSplits`, the splits
a source lists (`ImageData.listing` returns one), with a seeded validation share held out of train when there is no
val split."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
from torchvision.datasets.folder import make_dataset

IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def is_image_file(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(IMG_EXTENSIONS)


def list_images(folder: str | os.PathLike) -> list[str]:
    """Every image below `folder`, nested folders included, in a stable (sorted) order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if is_image_file(f))
    return found


def find_classes(split_dir: Path) -> list[str]:
    """Class names of an ImageFolder split: its sub-folders, sorted (torchvision semantics). Not torchvision's
    find_classes, which counts hidden folders (.ipynb_checkpoints, .cache) as classes."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} is not a folder; expected one sub-folder per class")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class folders; expected {split_dir}/<class>/<image>.jpg")
    return classes


def scan_split(split_dir: Path, classes: list[str]) -> list[tuple[str, int]]:
    """(path, class index) for every image of `split_dir`, nested folders included (torchvision's make_dataset); each
    class folder must hold at least one image, named in our message rather than torchvision's list of classes."""
    samples = make_dataset(str(split_dir), {name: i for i, name in enumerate(classes)}, extensions=IMG_EXTENSIONS,
                           allow_empty=True)
    counts = np.bincount([target for _, target in samples], minlength=len(classes))
    for name, count in zip(classes, counts, strict=True):
        if not count:
            raise FileNotFoundError(
                f"class folder {split_dir / name} holds no images ({', '.join(IMG_EXTENSIONS)}); "
                "add images or remove the folder"
            )
    return samples


LABELS_CSV = "labels.csv"  # a multi-label split: path,labels rows beside its images


def is_multilabel(root: Path) -> bool:
    """A multi-label dataset has `train/labels.csv`; a single-label one has class folders only."""
    return (root / "train" / LABELS_CSV).is_file()


def read_image_list(file: Path, column: str, *, required: bool) -> list[tuple[str, str]]:
    """(image path, its `column` cell) of every row of an image-list CSV with the header ``path,<column>``: paths
    relative to the file's folder (or absolute), each listed once and present; a `required` cell must not be empty.
    Errors name the file, the row and the fix."""
    rows, seen = [], set()
    with open(file, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"path", column} <= set(reader.fieldnames):
            raise ValueError(f"{file} must start with the header path,{column} (found {reader.fieldnames})")
        for line, row in enumerate(reader, start=2):
            rel, cell = (row["path"] or "").strip(), (row[column] or "").strip()
            if not rel or (required and not cell):
                raise ValueError(f"{file} line {line}: the {'path' if not rel else column} is empty")
            path = file.parent / rel
            if rel in seen:
                raise ValueError(f"{file} line {line}: {rel} is listed twice; give each image one row")
            if not path.is_file():
                raise FileNotFoundError(f"{file} line {line}: {path} does not exist; fix the path (relative to "
                                        f"{file.parent}) or remove the row")
            seen.add(rel)
            rows.append((str(path), cell))
    if not rows:
        raise ValueError(f"{file} lists no images")
    return rows


def read_labels_csv(split_dir: Path) -> list[tuple[str, list[str]]]:
    """(image path, its labels) of every row of `split_dir/labels.csv`: columns `path` (relative to `split_dir`) and
    `labels` (separated by spaces or `|`; empty for an image with none). Errors name the file, the row and the fix."""
    file = split_dir / LABELS_CSV
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; a multi-label split lists its images there "
                                "(columns path,labels; labels separated by spaces or |)")
    return [(path, sorted(set(cell.replace("|", " ").split())))
            for path, cell in read_image_list(file, "labels", required=False)]


def read_class_names(root: Path, multilabel: bool) -> list[str]:
    """The classes of an image-folder tree: train/'s class folders (which val/ and test/ must match), or the labels
    that train/labels.csv uses, sorted."""
    if not root.is_dir():
        raise FileNotFoundError(f"data.root={root} does not exist; run `imgcls demo-data {root}` "
                                "or point data.root at a folder with train/ and val/")
    if multilabel:  # the labels that train/labels.csv uses, sorted
        classes = sorted({label for _, labels in read_labels_csv(root / "train") for label in labels})
        if len(classes) < 2:
            raise ValueError(f"{root / 'train' / LABELS_CSV} uses {len(classes)} label(s) ({classes}); "
                             "multi-label classification needs two or more")
        return classes
    classes = find_classes(root / "train")
    if len(classes) < 2:
        raise ValueError(f"{root / 'train'} has a single class ({classes[0]}); classification needs two or "
                         "more")
    for split in ("val", "test"):
        split_dir = root / split
        if split_dir.is_dir():
            other = find_classes(split_dir)
            if other != classes:
                missing, extra = sorted(set(classes) - set(other)), sorted(set(other) - set(classes))
                raise ValueError(
                    f"{split}/ classes differ from train/ (root: {root}): "
                    f"missing from {split}/: {missing or 'none'}, not in train/: {extra or 'none'}"
                )
    return classes


def split_samples(split_dir: Path, class_names: list[str], multilabel: bool) -> list[tuple[str, int | np.ndarray]]:
    """(path, class index) for a split's class folders, or (path, multi-hot row) for its labels.csv."""
    if not multilabel:
        return scan_split(split_dir, class_names)
    index = {name: i for i, name in enumerate(class_names)}
    rows = read_labels_csv(split_dir)
    unknown = sorted({label for _, labels in rows for label in labels} - index.keys())
    if unknown:
        raise ValueError(f"{split_dir / LABELS_CSV} uses label(s) {unknown[:10]} that train/{LABELS_CSV} never "
                         f"does; the model has one output per label of train/")
    samples = []
    for path, labels in rows:
        row = np.zeros(len(index), np.uint8)
        row[[index[label] for label in labels]] = 1
        samples.append((path, row))
    return samples


def hold_out(train: list[tuple], val_split: float, seed: int, class_names: list[str], multilabel: bool,
             train_dir: Path) -> tuple[list[tuple], list[tuple]]:
    """(train, val): a seeded `val_split` share of `train` held out, stratified by class (single-label), so that every
    rank and every run gets the same split; `train_dir` is named in the errors."""
    from sklearn.model_selection import train_test_split  # here: importing it is a large share of start-up

    if multilabel:  # label sets do not stratify: a seeded random split
        train_idx, val_idx = train_test_split(range(len(train)), test_size=val_split,
                                              random_state=seed)
        return [train[i] for i in sorted(train_idx)], [train[i] for i in sorted(val_idx)]
    targets = [t for _, t in train]
    try:
        train_idx, val_idx = train_test_split(
            range(len(train)), test_size=val_split, stratify=targets, random_state=seed
        )
    except ValueError as err:  # sklearn: a class too small to appear on both sides
        raise ValueError(
            f"data.val_split={val_split} of {train_dir} leaves a class empty ({err}); "
            "add a val/ folder or images, or change data.val_split"
        ) from None
    kept = {train[i][1] for i in val_idx}
    if len(kept) < len(class_names):
        empty = [class_names[c] for c in range(len(class_names)) if c not in kept]
        raise ValueError(f"data.val_split={val_split} of {train_dir} leaves class(es) {empty} "
                         "with no validation image; raise data.val_split or add a val/ folder")
    return [train[i] for i in sorted(train_idx)], [train[i] for i in sorted(val_idx)]


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
