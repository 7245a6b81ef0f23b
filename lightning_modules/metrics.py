"""What the classifier is scored by: its metrics per split, and the names it logs."""

from __future__ import annotations

from torch import nn
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassF1Score,
    MultilabelAveragePrecision,
    MultilabelExactMatch,
    MultilabelF1Score,
)


def split_metrics(num_classes: int, prefix: str, multilabel: bool = False, threshold: float = 0.5) -> MetricCollection:
    if multilabel:  # updated with probabilities and 0/1 targets
        return MetricCollection({
            "acc": MultilabelExactMatch(num_classes, threshold=threshold),  # what the shipped checkpoints monitor
            "map": MultilabelAveragePrecision(num_classes, average="macro"),
            "f1_macro": MultilabelF1Score(num_classes, threshold=threshold, average="macro"),
            "f1_micro": MultilabelF1Score(num_classes, threshold=threshold, average="micro"),
        }, prefix=f"{prefix}/")
    metrics = {
        "acc": MulticlassAccuracy(num_classes, average="micro"),
        "f1_macro": MulticlassF1Score(num_classes, average="macro"),
    }
    if num_classes >= 5:
        metrics["acc_top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
    return MetricCollection(metrics, prefix=f"{prefix}/")


def classifier_metrics(num_classes: int, multilabel: bool, threshold: float) -> tuple[nn.Module, ...]:
    """The classifier's metrics: train/acc, the val/ and test/ collections (split_metrics), the mean val and test
    loss, and the best val/acc so far."""
    train_acc = (MultilabelExactMatch(num_classes, threshold=threshold) if multilabel
                 else MulticlassAccuracy(num_classes, average="micro"))
    # Mean loss over all images of all ranks, synced once at epoch end: ranks may hold different numbers of val/test
    # batches (each image goes to one rank), so a per-step all-reduce (sync_dist) could deadlock.
    eval_loss = nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})
    val_acc_best = MaxMetric()  # best-so-far val/acc, for dashboards and sweeps
    val_acc_best.persistent(True)  # kept in checkpoints, so a resumed run remembers its best
    return (train_acc, split_metrics(num_classes, "val", multilabel, threshold),
            split_metrics(num_classes, "test", multilabel, threshold), eval_loss, val_acc_best)


def logged_names(num_classes: int, multilabel: bool) -> set[str]:
    """The names a classifier of `num_classes` logs (what a ModelCheckpoint or EarlyStopping may monitor)."""
    names = {"train/loss", "train/acc", "val/acc_best"}
    for split in ("val", "test"):
        names |= {f"{split}/loss", *split_metrics(num_classes, split, multilabel).keys()}
    return names
