"""NonFiniteLossGuard: stop at the first NaN/inf training loss, before its weights are saved."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from training.resume.faults import NonFiniteLossError, last_good_checkpoint


class NonFiniteLossGuard(Callback):
    """Stops the run at the first NaN/inf training loss, naming the step and the last good checkpoint.

    Reading a GPU loss on the host waits for the step's kernels, so the losses are kept on their device and checked
    together, in one transfer, every `check_every_n_steps` steps (1 on a CPU, where it costs nothing; 50 on a GPU),
    and always before a checkpoint is written and before validation: the weights of a step with a non-finite loss
    are never saved (AtomicCheckpointIO also refuses non-finite weights, a second line of defence). For exploding
    gradients set `trainer.gradient_clip_val`.

    Args:
        check_every_n_steps: steps between checks; null picks by device as above.
    """

    def __init__(self, check_every_n_steps: int | None = None) -> None:
        self.check_every_n_steps = check_every_n_steps
        self._pending: list[tuple[int, int, int, torch.Tensor]] = []  # (step, epoch, batch_idx, loss) unchecked

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        self._pending.append((trainer.global_step, trainer.current_epoch, batch_idx, loss.detach()))
        every = self.check_every_n_steps or (1 if loss.device.type == "cpu" else 50)
        if len(self._pending) >= every:
            self.check(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self.check(trainer)  # raising here stops the save: no checkpoint holds the weights of a non-finite step

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: Trainer) -> None:
        """Raise NonFiniteLossError for the first non-finite loss since the last check (one device transfer)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        finite = torch.stack([torch.isfinite(loss).all() for *_, loss in pending]).cpu()
        if bool(finite.all()):
            return
        step, epoch, batch_idx, loss = pending[int((~finite).nonzero()[0])]
        raise NonFiniteLossError(
            f"training loss is {loss.item()} at step {step} (epoch {epoch}, batch {batch_idx}); last good "
            f"checkpoint: {last_good_checkpoint(trainer) or 'none yet'}. Lower model.optimizer.lr, set "
            "trainer.gradient_clip_val, or use precision 32-true, then resume with --ckpt_path last"
        )
