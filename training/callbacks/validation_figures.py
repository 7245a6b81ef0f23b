"""ValidationFigures: a confusion matrix, per-class scores and misclassified images for the dashboards."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.classification import MulticlassConfusionMatrix, MultilabelStatScores

from training.records.plots import (
    ConfidentMistakes,
    figure_to_array,
    misclassified_grid,
    per_class_chart,
    per_class_scores,
    publish,
    publish_table,
    replace_file,
    scores_from_counts,
)
from training.resume.faults import WriteError


class ValidationFigures(Callback):
    """Logs `val/confusion_matrix`, `val/per_class` and `val/misclassified` to TensorBoard and W&B, and keeps the
    latest of each as a PNG in `<run>/figures/` (for CSV-only runs and `imgcls report`), the matrix also as
    `confusion_matrix.csv` and the per-class precision, recall, F1 and support as `per_class.csv` (a text table in
    TensorBoard, a table in W&B; the chart is drawn for up to 40 classes).

    The confusion matrix is a torchmetrics metric, so under DDP it counts every rank's images; the misclassified
    grid shows the `max_images` most confident mistakes that rank 0 sees, across all classes, each captioned
    "true -> predicted" with its confidence (cheap: no extra forward pass, the logits are taken from the model's own
    forward through a hook).

    A figure that cannot be written (a full disk) is skipped with one line, and the fit goes on; the logger's images
    are the logger's writes, which stop the fit when they fail (training/records/loggers.py).

    Drawing takes a fraction of a second, which matters only when epochs are short: during a fit, a validation's
    figures are drawn while the time spent drawing, this one's expected cost included (the previous drawing's), stays
    within `time_budget` of the time since the fit started. The first validation is always drawn, and so is the last
    one, when the fit ends; the counts of a skipped one are not kept. `validate` and `test` always draw.

    Args:
        max_images: misclassified images in the grid.
        every_n_epochs: log every n-th validation epoch.
        time_budget: the fraction of a fit's wall time that drawing may take; null draws every validation.
    """

    def __init__(self, max_images: int = 16, every_n_epochs: int = 1, time_budget: float | None = 0.02) -> None:
        if time_budget is not None and not 0 < time_budget <= 1:
            raise ValueError(f"ValidationFigures: time_budget must be in (0, 1] or null, not {time_budget}")
        self.max_images = max_images
        self.every_n_epochs = every_n_epochs
        self.time_budget = time_budget
        self._started = time.monotonic()  # the fit's start (on_fit_start), for the budget
        self._spent = self._last_cost = 0.0  # seconds spent drawing in this fit, and the last drawing's
        self._pending: tuple[Callable[..., None], int, int] | None = None  # (draw, epoch, step) not drawn yet
        self._logits: torch.Tensor | None = None
        self._hook = None
        self._mistakes = ConfidentMistakes(max_images)
        self.confusion: MulticlassConfusionMatrix | None = None
        self.label_counts: MultilabelStatScores | None = None  # multi-label: per class tp, fp, tn, fn, support

    def _active(self, trainer: Trainer) -> bool:
        return not trainer.sanity_checking and trainer.current_epoch % self.every_n_epochs == 0

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active(trainer):
            return
        if pl_module.hparams.get("multilabel"):
            if self.label_counts is None:
                self.label_counts = MultilabelStatScores(pl_module.hparams.num_classes,
                                                         threshold=pl_module.threshold, average=None)
            self.label_counts = self.label_counts.to(pl_module.device)
            self.label_counts.reset()
        elif self.confusion is None:
            self.confusion = MulticlassConfusionMatrix(pl_module.hparams.num_classes)
        if self.confusion is not None:
            self.confusion = self.confusion.to(pl_module.device)
            self.confusion.reset()
        self._mistakes = ConfidentMistakes(self.max_images)

        def keep_logits(module, args, output):
            # Under DDP, Lightning routes validation_step through the module's __call__ too (it returns None).
            if isinstance(output, torch.Tensor):
                self._logits = output.detach()  # (B, num_classes)

        self._hook = pl_module.register_forward_hook(keep_logits)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._hook is None or self._logits is None:
            return
        x, y = batch
        if pl_module.hparams.get("multilabel"):
            self.label_counts.update(self._logits.sigmoid(), y.int())
            self._logits = None
            return
        self.confusion.update(self._logits.argmax(dim=1), y)
        if trainer.is_global_zero:
            self._mistakes.update(x, y, self._logits)
        self._logits = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started, self._spent, self._last_cost, self._pending = time.monotonic(), 0.0, 0.0, None

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        names = pl_module.class_names
        if pl_module.hparams.get("multilabel"):  # no confusion matrix or grid of mistakes: per-class scores only
            counts = self.label_counts.compute().cpu().numpy()  # (C, 5); all ranks take part
            draw = functools.partial(self._draw_label_scores, names, counts)
        else:
            matrix = self.confusion.compute().cpu()  # all ranks take part: the counts are summed across processes
            draw = functools.partial(self._draw_matrix_and_mistakes, names, matrix, self._mistakes.kept)
        self._mistakes = ConfidentMistakes(self.max_images)
        if not trainer.is_global_zero:
            return
        self._pending = (draw, trainer.current_epoch, trainer.global_step)
        if trainer.state.fn != TrainerFn.FITTING or self._due():
            self._draw_pending(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:  # the fit's last validation, skipped for the budget
            self._draw_pending(trainer)

    def _due(self) -> bool:
        """Whether drawing now keeps the fit's drawing time within the budget."""
        if self.time_budget is None:
            return True
        return self._spent + self._last_cost <= self.time_budget * (time.monotonic() - self._started)

    def _draw_pending(self, trainer: Trainer) -> None:
        draw, epoch, step = self._pending
        self._pending = None
        start, out = time.monotonic(), Path(trainer.default_root_dir) / "figures"
        try:
            draw(trainer, out, epoch, step)
        except OSError as err:
            if isinstance(err, WriteError):  # a logger's files: the fit stops, as for the logger's own writes
                raise
            # A figure is never worth a run: a full disk stops it at its next checkpoint or log, in one line.
            rank_zero_info(f"figures: epoch {epoch}'s not saved in {out} ({err.strerror or err}); the fit goes on "
                           "without them")
        self._last_cost = time.monotonic() - start
        self._spent += self._last_cost

    def _draw_matrix_and_mistakes(self, names: list[str], matrix: torch.Tensor, mistakes: list, trainer: Trainer,
                                  out: Path, epoch: int, step: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        replace_file(out / "confusion_matrix.csv", lambda tmp: np.savetxt(
            tmp, matrix.numpy(), fmt="%d", delimiter=",",
            header="rows: true class, columns: predicted class; " + ",".join(names)))
        fig, ax = self.confusion.plot(val=matrix, labels=names if len(names) <= 30 else None)
        ax.set_title(f"val confusion matrix, epoch {epoch}")
        publish(trainer, "val/confusion_matrix", figure_to_array(fig), step)
        self._publish_scores(trainer, out, names, per_class_scores(matrix.numpy()), epoch, step)
        publish(trainer, "val/misclassified", misclassified_grid(mistakes, names), step)

    def _draw_label_scores(self, names: list[str], counts: np.ndarray, trainer: Trainer, out: Path, epoch: int,
                           step: int) -> None:
        tp, fp, fn = counts[:, 0], counts[:, 1], counts[:, 3]
        self._publish_scores(trainer, out, names, scores_from_counts(tp, fp, fn), epoch, step)

    @staticmethod
    def _publish_scores(trainer: Trainer, out: Path, names: list[str], scores: np.ndarray, epoch: int,
                        step: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        publish_table(trainer, "val/per_class", names, scores, step)
        replace_file(out / "per_class.csv", lambda tmp: np.savetxt(
            tmp, scores, fmt=["%.6f", "%.6f", "%.6f", "%d"], delimiter=",",
            header="rows: " + ",".join(names) + "\nprecision,recall,f1,support"))
        if len(names) <= 40:
            publish(trainer, "val/per_class", per_class_chart(names, scores, epoch), step)
