"""The samples of an image-folder tree: its classes, each split's (path, target) pairs, and a validation share held
out of train/ when there is no val/."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datamodules.images import LABELS_CSV, find_classes, read_labels_csv, scan_split


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
