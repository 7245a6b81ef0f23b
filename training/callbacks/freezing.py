"""Fine-tuning with a frozen backbone: the callback that freezes the network's declared backbone for the first epochs.
Every `imgcls` run carries one, configured by its own key (configs/imagenet_ddp8.yaml):

    freeze:
      epochs: 1
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.config_types import NonNegativeInt, check_arguments
from lightning_modules.network import backbone_modules, head_parameter_names, require_backbone

# The layers whose running statistics a frozen backbone keeps fixed (public classes; SyncBatchNorm included).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d)


class FreezeBackbone(Callback):
    """Keeps the backbone of `model.net` (everything outside its `head_modules()`) frozen for the first `epochs`.

    Frozen means requires_grad off, as Lightning's BackboneFinetuning has it: no backward pass runs through the
    backbone and its parameters get no gradient, so the optimizer builds no momentum or Adam moments for them; and
    its BatchNorm statistics stay fixed. Unlike BackboneFinetuning, the backbone's parameter groups exist from the
    start (the LR schedule covers them). DDP registers gradient hooks only for the parameters that require a gradient
    when it wraps the model, so the model is wrapped again when the backbone thaws; a compiled network
    (`model.levers.compile`) is compiled again then, once (its graphs assume the parameters' requires_grad: 33 s for
    ResNet-50 on an H200). A resume mid-freeze or at the thaw epoch continues exactly: the state follows the epoch,
    and the callback holds none of its own.

    Args:
        epochs: epochs with a frozen backbone (the head trains alone first); 0 is off.
    """

    def __init__(self, epochs: NonNegativeInt = 0) -> None:
        check_arguments("FreezeBackbone", FreezeBackbone.__init__, {"epochs": epochs})
        self.epochs = epochs

    def frozen(self, trainer: L.Trainer) -> bool:
        return trainer.current_epoch < self.epochs

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.epochs:
            return
        require_backbone(pl_module.net, f"FreezeBackbone(epochs={self.epochs})")
        # Before the strategy wraps the model: DDP then hooks only the head. The loops' epoch is restored later.
        self._set_trainable(pl_module, not self.frozen(trainer))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every fit start, resumes included: Lightning skips on_train_epoch_start when it resumes mid-epoch, and
        # restores the loops' epoch only after DDP wrapped the model.
        self._apply(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._apply(trainer, pl_module)  # the thaw epoch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # After any model.train() (a fit's start, a fresh process's resume): BatchNorm statistics fixed while frozen.
        if self.epochs and self.frozen(trainer):
            self._set_batch_norms_training(pl_module, False)

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """requires_grad and the BatchNorm mode of the backbone for the current epoch; DDP re-wrapped when the
        requires_grad changed."""
        if not self.epochs:
            return
        frozen = self.frozen(trainer)
        changed = self._set_trainable(pl_module, not frozen)
        if pl_module.training:  # Lightning restores each module's mode after a validation: eval stays until the thaw
            self._set_batch_norms_training(pl_module, not frozen)
        if not changed:
            return
        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            strategy.model = pl_module  # unwrapped, then wrapped again with the backbone's gradient hooks
            strategy.configure_ddp()
            rank_zero_info(f"backbone unfrozen at epoch {trainer.current_epoch}: DDP re-wrapped the model")

    @staticmethod
    def _set_batch_norms_training(pl_module: L.LightningModule, training: bool) -> None:
        for module in backbone_modules(pl_module.net):
            if isinstance(module, BATCH_NORMS):
                module.train(training)

    @staticmethod
    def _set_trainable(pl_module: L.LightningModule, trainable: bool) -> bool:
        """requires_grad of every backbone parameter; True when that changed anything."""
        head = head_parameter_names(pl_module.net)
        changed = False
        for name, p in pl_module.net.named_parameters():
            if name not in head and p.requires_grad != trainable:
                p.requires_grad_(trainable)
                changed = True
        return changed
