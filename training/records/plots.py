"""Plots of a validation for the dashboards: a confusion matrix, per-class precision, recall and F1, and a grid of
the most confident misclassified images, every epoch (multi-label: the per-class scores only)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from PIL import Image, ImageDraw, ImageFont

from training.records.loggers import logger_write


def per_class_scores(matrix: np.ndarray) -> np.ndarray:
    """(C, C) confusion counts (rows: true class) -> (C, 4): precision, recall, F1 and support of each class."""
    tp = np.diag(matrix)
    return scores_from_counts(tp, matrix.sum(axis=0) - tp, matrix.sum(axis=1) - tp)


def scores_from_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """Per-class true positives, false positives and false negatives -> (C, 4): precision, recall, F1, support.

    A class never predicted has precision 0, one never present recall 0 (torchmetrics' convention for average=None).
    """
    tp = np.asarray(tp, dtype=np.float64)
    predicted, present = tp + np.asarray(fp), tp + np.asarray(fn)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, present, out=np.zeros_like(tp), where=present > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=precision + recall > 0)
    return np.stack([precision, recall, f1, present], axis=1)


def per_class_chart(names: list[str], scores: np.ndarray, epoch: int) -> np.ndarray:
    """Grouped bars of precision, recall and F1 per class: (H, W, 3) uint8."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(names) + 2), 3.6))
    x = np.arange(len(names))
    for k, label in enumerate(("precision", "recall", "F1")):
        ax.bar(x + (k - 1) * 0.27, scores[:, k], width=0.27, label=label)
    ax.set_xticks(x, names, rotation=45 if len(names) > 10 else 0, ha="right" if len(names) > 10 else "center")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"val per class, epoch {epoch}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return figure_to_array(fig)


class Mistake(NamedTuple):
    image: torch.Tensor  # (3, H, W), as the model saw it
    true: int
    predicted: int
    confidence: float  # the predicted class's probability


class ConfidentMistakes:
    """The `k` most confident wrong predictions among all the batches shown to `update`, most confident first (ties:
    the one seen first): the model's worst errors across every class, not the first ones in the data's order."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.kept: list[Mistake] = []

    def update(self, images: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor) -> None:
        """One batch: images (B, 3, H, W), class indices (B,), logits (B, C)."""
        confidence, predicted = logits.detach().float().softmax(dim=1).max(dim=1)
        wrong = torch.nonzero(predicted != targets).flatten()
        if self.k <= 0 or not len(wrong):
            return
        wrong = wrong[confidence[wrong].argsort(descending=True, stable=True)][: self.k]
        floor = self.kept[-1].confidence if len(self.kept) == self.k else -1.0
        new = [Mistake(images[i].float().cpu(), int(targets[i]), int(predicted[i]), c)
               for i, c in zip(wrong.tolist(), confidence[wrong].tolist(), strict=True) if c > floor]
        self.kept = sorted(self.kept + new, key=lambda m: -m.confidence)[: self.k]  # stable: earlier ones first


def misclassified_grid(mistakes: list[Mistake], names: list[str], *, cols: int = 4, tile: int = 128) -> np.ndarray:
    """Mistakes as tiles under two caption lines, "true -> predicted" and the confidence: (H, W, 3) uint8.

    Drawn with PIL, not matplotlib: a 16-panel matplotlib figure costs about a CPU-second per validation epoch.
    """
    line = 16
    caption = 2 * line + 2
    font = ImageFont.load_default(size=14)  # Pillow's bundled font: no font files needed
    rows = max(1, -(-len(mistakes) // cols))
    sheet = Image.new("RGB", (cols * tile, rows * (tile + caption)), "white")
    draw = ImageDraw.Draw(sheet)
    for k, (image, true, pred, confidence) in enumerate(mistakes):
        x, y = (k % cols) * tile, (k // cols) * (tile + caption)
        picture = Image.fromarray((to_display(image) * 255).round().astype(np.uint8))
        side = tile - 4
        if max(picture.size) > side:
            picture.thumbnail((side, side))
        elif (scale := side // max(picture.size)) > 1:  # small images: enlarged by whole pixels, not blurred
            picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
        draw.text((x + 4, y + 2), f"{names[true]} -> {names[pred]}"[: tile // 8], fill=(200, 30, 30), font=font)
        draw.text((x + 4, y + 2 + line), f"confidence {confidence:.2f}", fill=(90, 90, 90), font=font)
        sheet.paste(picture, (x + (tile - picture.width) // 2, y + caption + (tile - picture.height) // 2))
    if not mistakes:
        draw.text((4, caption), "no mistakes", fill=(0, 0, 0), font=font)
    return np.asarray(sheet)


def to_display(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) normalised tensor -> (H, W, 3) floats in [0, 1], min-max scaled (the preset's mean/std vary)."""
    array = image.permute(1, 2, 0).numpy()
    low, high = array.min(), array.max()
    return (array - low) / (high - low) if high > low else np.zeros_like(array)


def figure_to_array(fig: plt.Figure) -> np.ndarray:
    """Render a matplotlib figure once, to (H, W, 3) uint8, and close it."""
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


def publish_table(trainer: Trainer, tag: str, names: list[str], scores: np.ndarray, step: int | None = None) -> None:
    """Per-class scores as a table: Markdown text in TensorBoard, a wandb.Table in W&B, at `step` (the trainer's
    global step by default)."""
    step = trainer.global_step if step is None else step
    columns = ["class", "precision", "recall", "f1", "support"]
    rows = [[name, *(round(float(v), 4) for v in row[:3]), int(row[3])]
            for name, row in zip(names, scores, strict=True)]
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            text = "\n".join(["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|",
                              *("| " + " | ".join(map(str, row)) + " |" for row in rows)])
            logger_write(logger, logger.experiment.add_text, tag, text, global_step=step)
        elif isinstance(logger, WandbLogger):
            logger.log_table(key=tag, columns=columns, data=rows, step=step)


def publish(trainer: Trainer, tag: str, image: np.ndarray, step: int | None = None) -> None:
    """Send one (H, W, 3) uint8 picture to every logger that shows images, at `step` (the trainer's global step by
    default), and overwrite `<run>/figures/<name>.png` (`replace_file`). A logger's write that fails stops the fit as
    the logger's own writes do (training/records/loggers.py)."""
    step = trainer.global_step if step is None else step
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger_write(logger, logger.experiment.add_image, tag, image, global_step=step, dataformats="HWC")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[image], step=step)
    out = Path(trainer.default_root_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    replace_file(out / f"{tag.split('/')[-1]}.png", lambda tmp: Image.fromarray(image).save(tmp, format="PNG"))


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path`, then rename it over `path`: the last one stays whole until the new one
    is (a full disk raises OSError and leaves no temporary file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
