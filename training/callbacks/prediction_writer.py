"""PredictionWriter: `predictions.csv` at the end of `imgcls predict`, the ranks' parts gathered on rank 0."""

from __future__ import annotations

import csv
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Writes `predictions.csv` (path, label, class name, confidence, top-5) at the end of `imgcls predict`; for a
    multi-label model (path, labels at or above `model.threshold`, top-5).

    Under DDP the ranks' parts travel to rank 0 through the process group (no shared disk needed: each node may have
    its own run directory), and rank 0 writes them in dataset order, without the duplicates that the distributed
    sampler pads with.
    """

    def __init__(self, output_dir: str | None = None, filename: str = "predictions.csv") -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir
        self.filename = filename

    def _out_dir(self, trainer: Trainer) -> Path:
        return Path(self.output_dir or trainer.default_root_dir)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        part = _prediction_rows(predictions)
        parts = gather_to_rank_zero(part) if trainer.world_size > 1 else [part]
        if not trainer.is_global_zero:
            return
        merged = {row[0]: row for rows in parts for row in rows}  # a padded duplicate overwrites its identical twin
        paths = trainer.datamodule.predict_set.paths
        names = pl_module.class_names
        out = self._out_dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / self.filename, "w", newline="") as f:
            writer = csv.writer(f)
            if pl_module.hparams.get("multilabel"):
                # labels: every class at or above the threshold, `|`-separated as labels.csv reads them (empty for
                # none); scores: the probabilities of the 5 likeliest classes, for a look below the threshold.
                threshold = pl_module.threshold
                writer.writerow(["path", "labels", "top5"])
                for index in sorted(merged):
                    probs = merged[index][1]
                    order = sorted(range(len(probs)), key=lambda c: -probs[c])
                    labels = "|".join(names[c] for c in sorted(order) if probs[c] >= threshold)
                    top5 = " ".join(f"{names[c]}:{probs[c]:.4f}" for c in order[:5])
                    writer.writerow([paths[index], labels, top5])
            else:
                writer.writerow(["path", "label", "class_name", "confidence", "top5"])
                for index in sorted(merged):
                    _, label, name, conf, top_labels, top_probs = merged[index]
                    top5 = " ".join(f"{names[c]}:{p:.4f}" for c, p in zip(top_labels, top_probs, strict=True))
                    writer.writerow([paths[index], label, name, f"{conf:.6f}", top5])
        print(f"wrote {len(merged)} predictions to {out / self.filename}")


def _prediction_rows(predictions: list[dict]) -> list[tuple]:
    """predict_step outputs -> (index, label, class name, confidence, top-5 labels, top-5 probabilities) rows, or
    (index, every class's probability) rows for a multi-label model."""
    rows = []
    for batch in predictions:
        if "probs" in batch:
            rows += [(int(i), p.tolist()) for i, p in zip(batch["index"], batch["probs"], strict=True)]
            continue
        for i in range(len(batch["index"])):
            rows.append((int(batch["index"][i]), int(batch["label"][i]), batch["class_name"][i],
                         float(batch["confidence"][i]), batch["top5_labels"][i].tolist(),
                         batch["top5_probs"][i].tolist()))
    return rows


def gather_to_rank_zero(obj):
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere): through the process group, not the disk.

    gloo takes the objects as pickled CPU bytes; NCCL stages them on the current device, which Lightning has set.
    """
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts
