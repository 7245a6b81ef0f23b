"""CurvesAcrossResumes: tells a fit's loggers where it starts and which steps its checkpoints cover, so that the
run's curves stay whole and show each step once across resumes and kills (training/records/loggers.py)."""

from __future__ import annotations

import math

from lightning.pytorch import Callback


class CurvesAcrossResumes(Callback):
    """Tells the loggers where a fit starts (`starts_at`), that a checkpoint is about to be written (`checkpointing`:
    the rows it covers go to disk first, so a logger whose disk is full stops the fit before a checkpoint covers rows it
    lost), and which steps its checkpoints cover (`covered_below`, once the file is written: at the next batch or when
    the fit stops). Loggers without these methods are left as their library made them."""

    def __init__(self) -> None:
        self._saved: int | None = None

    @staticmethod
    def _tell(trainer, method: str, step: float) -> None:
        for logger in trainer.loggers:
            if hasattr(logger, method):
                getattr(logger, method)(step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._tell(trainer, "starts_at", trainer.global_step)
        if not trainer.checkpoint_callbacks:  # nothing to resume from: no row is ever done again
            self._tell(trainer, "covered_below", math.inf)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._tell(trainer, "checkpointing", trainer.global_step)
        self._saved = trainer.global_step

    def _release(self, trainer) -> None:
        if self._saved is not None:
            self._tell(trainer, "covered_below", self._saved)
            self._saved = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._release(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._release(trainer)
        self._tell(trainer, "covered_below", math.inf)  # the fit is over: nothing is done again

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._release(trainer)  # Preemption's exit after its checkpoint; a crash keeps what its checkpoint covers
