"""Multi-label classification: labels.csv data, the sigmoid/BCE model, its metrics, the per-class figures, predict."""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.demo import build_multilabel_demo_data
from datamodules.image_folder import ImageFolderDataModule
from datamodules.listing import read_labels_csv
from lightning_modules import BackboneWithHead, Recipe
from lightning_modules.classifier import ImageClassifier
from tests.helpers import CONFIGS, TINY, TINY_ARCH, make_image_folder
from training.records.plots import per_class_scores, scores_from_counts


def _write_split(folder: Path, rows: list[tuple[str, str]], size: int = 32) -> None:
    """Images named in `rows` ((relative path, labels cell)) and their labels.csv."""
    rng = np.random.default_rng(0)
    from PIL import Image

    for rel, _ in rows:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / rel)
    with open(folder / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "labels"), *rows])


@pytest.fixture
def small(tmp_path) -> Path:
    _write_split(tmp_path / "train", [("a.png", "cat dog"), ("sub/b.png", "dog|bird"), ("c.png", ""),
                                      ("d.png", "bird")])
    _write_split(tmp_path / "val", [("e.png", "cat"), ("f.png", "cat | dog")])
    return tmp_path


def test_labels_csv_takes_spaces_bars_and_empty_cells(small):
    rows = read_labels_csv(small / "train")
    assert rows == [(str(small / "train/a.png"), ["cat", "dog"]), (str(small / "train/sub/b.png"), ["bird", "dog"]),
                    (str(small / "train/c.png"), []), (str(small / "train/d.png"), ["bird"])]


@pytest.mark.parametrize(("content", "message"), [
    ("file,labels\na.png,cat\n", "must start with the header path,labels"),
    ("path,labels\nmissing.png,cat\n", "line 2: .*missing.png does not exist"),
    ("path,labels\na.png,cat\na.png,dog\n", "line 3: a.png is listed twice"),
    ("path,labels\n", "lists no images"),
])
def test_a_bad_labels_csv_is_named_with_its_line(small, content, message):
    (small / "train" / "labels.csv").write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_labels_csv(small / "train")


def test_the_datamodule_reads_multi_hot_targets_and_batches_them(small):
    data = ImageFolderDataModule(root=str(small), batch_size=4, num_workers=0, image_size=32, scan_cache=False)
    assert data.multilabel and data.class_names == ["bird", "cat", "dog"]
    data.setup("fit")
    assert data.train_set.targets.tolist() == [[0, 1, 1], [1, 0, 1], [0, 0, 0], [1, 0, 0]]
    assert data.val_set.targets.tolist() == [[0, 1, 0], [0, 1, 1]]
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == (2, 3, 32, 32) and y.dtype == torch.float32 and y.tolist() == [[0, 1, 0], [0, 1, 1]]


def test_multi_label_data_refuses_what_needs_one_label_per_image(small):
    (small / "val" / "labels.csv").write_text("path,labels\ne.png,cat fish\n")
    with pytest.raises(ValueError, match=r"uses label\(s\) \['fish'\] that train/labels.csv never does"):
        ImageFolderDataModule(root=str(small), num_workers=0, scan_cache=False).setup("fit")
    with pytest.raises(ValueError, match="data.sampler=balanced .* is multi-label"):
        ImageFolderDataModule(root=str(small), sampler="balanced")
    with pytest.raises(ValueError, match="mix single-label targets; this data is multi-label"):
        ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0), multilabel=True,
                        recipe=Recipe(mixup_alpha=0.2))


def test_without_val_a_seeded_share_of_train_is_held_out(small):
    import shutil

    shutil.rmtree(small / "val")
    splits = []
    for _ in range(2):
        data = ImageFolderDataModule(root=str(small), val_split=0.25, num_workers=0, scan_cache=False)
        data.setup("fit")
        splits.append((list(data.train_set.paths), list(data.val_set.paths)))
    assert splits[0] == splits[1] and len(splits[0][1]) == 1 and len(splits[0][0]) == 3


def test_the_loss_and_metrics_are_per_label():
    torch.manual_seed(0)
    # The default cross-entropy scores one class per image: on multi-label data a binary cross-entropy per class.
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0),
                            multilabel=True, threshold=0.5)
    logits = torch.randn(4, 3)
    y = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.float32)
    torch.testing.assert_close(model.loss(logits, y), torch.nn.functional.binary_cross_entropy_with_logits(logits, y))
    perfect = (y * 2 - 1) * 3  # sigmoid 0.95 on every label present, 0.05 on every other
    model.val_metrics.update(perfect.sigmoid(), y.int())
    scores = {k: float(v) for k, v in model.val_metrics.compute().items()}
    assert scores == {"val/acc": 1.0, "val/map": 1.0, "val/f1_macro": 1.0, "val/f1_micro": 1.0}
    model.val_metrics.reset()
    one_wrong = perfect.clone()
    one_wrong[0, 2] = -3  # image 0 misses its third label
    model.val_metrics.update(one_wrong.sigmoid(), y.int())
    scores = {k: float(v) for k, v in model.val_metrics.compute().items()}
    assert scores["val/acc"] == 0.75  # exact match: 3 of 4 images have every label right
    # micro F1: 5 of the 6 labels found, none wrongly: 2 * 5 / (2 * 5 + 0 + 1)
    assert scores["val/f1_micro"] == pytest.approx(10 / 11)
    # AP of the third class: its other positive ranks first, then the missed one ties with its 2 negatives: precision
    # 2/4 at full recall, AP (1 + 0.5) / 2; the other classes stay perfect
    assert scores["val/map"] == pytest.approx((1 + 1 + 0.75) / 3)


def test_per_class_scores_from_counts_agree_with_the_confusion_matrix():
    """Against scikit-learn's own precision, recall and F1 of the predictions the matrix counts (a class never
    predicted scores 0, as torchmetrics' average=None does)."""
    from sklearn.metrics import precision_recall_fscore_support

    matrix = np.array([[5, 1, 0], [2, 3, 1], [0, 0, 4], [1, 0, 0]])[:, :3]  # class 3 (row 4) is never predicted
    matrix = np.pad(matrix, ((0, 0), (0, 1)))
    truth = np.repeat(np.arange(4), matrix.sum(1))
    predicted = np.concatenate([np.repeat(np.arange(4), row) for row in matrix])
    expected = np.stack(precision_recall_fscore_support(truth, predicted, labels=range(4), zero_division=0), axis=1)
    np.testing.assert_allclose(per_class_scores(matrix), expected)
    scores = scores_from_counts(np.array([3, 0]), np.array([1, 0]), np.array([0, 2]))
    np.testing.assert_allclose(scores, [[0.75, 1.0, 6 / 7, 3], [0, 0, 0, 2]])


@pytest.mark.slow
def test_fit_on_composited_digits_learns_and_predict_writes_the_labels_above_the_threshold(tmp_path):
    from training.cli.app import cli_main

    root = build_multilabel_demo_data(tmp_path / "digits", size=32, counts={"train": 400, "val": 100, "test": 10})
    run = tmp_path / "run"
    cli = cli_main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config",
                    str(CONFIGS / "recipes" / "multilabel.yaml"), *TINY, "--data.root", str(root),
                    "--data.batch_size", "32", "--trainer.max_epochs", "4", "--trainer.default_root_dir", str(run),
                    "--trainer.enable_progress_bar", "false"])
    assert cli.model.hparams.multilabel and cli.model.class_names == [str(d) for d in range(10)]
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert {"val/acc", "val/map", "val/f1_macro", "val/f1_micro", "val/loss"} <= metrics.keys()
    # Chance: a random ranking scores each class's share of images, ~0.2 here (2 digits of 10 per image on average).
    prevalence = np.mean([len(labels) for _, labels in read_labels_csv(root / "val")]) / 10
    assert metrics["val/map"] > prevalence + 0.05, (metrics, prevalence)
    # The per-class figure counts every label of the val split.
    support = np.loadtxt(run / "figures" / "per_class.csv", delimiter=",")[:, 3]
    truth = np.zeros(10)
    for _, labels in read_labels_csv(root / "val"):
        truth[[int(label) for label in labels]] += 1
    np.testing.assert_array_equal(support, truth)
    assert not (run / "figures" / "confusion_matrix.csv").exists()  # single-label only

    images = make_image_folder(tmp_path / "predict", {"x": 3}, splits=(".",), size=32)
    cli_main(["predict", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--data.root", "null",
              "--data.predict_dir", str(images), "--data.image_size", "32", "--data.num_workers", "0",
              "--model.threshold", "0.3", "--trainer.default_root_dir", str(tmp_path / "pred"),
              "--trainer.enable_progress_bar", "false"])
    rows = list(csv.DictReader(open(tmp_path / "pred" / "predictions.csv")))
    assert len(rows) == 3 and set(rows[0]) == {"path", "labels", "top5"}
    for row in rows:
        probs = {name: float(p) for name, p in (item.split(":") for item in row["top5"].split())}
        above = sorted(name for name, p in probs.items() if p >= 0.3)
        listed = row["labels"].split("|") if row["labels"] else []
        # every label listed is at or above the threshold; every top-5 class above it is listed
        assert set(above) <= set(listed) and all(name not in probs or probs[name] >= 0.3 for name in listed)
