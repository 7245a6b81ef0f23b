"""The LightningModule: trains the injected network (`model.net`; by default a torchvision backbone with a two-layer
head) with the injected loss, optimizer and schedule, and reports torchmetrics per split."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

import lightning_modules.pretrained as pretrained
from core.config_types import OpenUnitInterval, PositiveInt
from lightning_modules.losses import criterion
from lightning_modules.lr_plan import LrPlan
from lightning_modules.metrics import classifier_metrics, logged_names
from lightning_modules.mixing import batch_mix
from lightning_modules.network import BackboneWithHead, network_from_config, require_backbone
from lightning_modules.optim import build_optimizer, factories, kernel_limits, param_groups, plain_callable, target_of
from lightning_modules.predictions import predictions
from lightning_modules.settings import (
    DEFAULT_LEVERS,
    DEFAULT_RECIPE,
    Levers,
    Recipe,
    as_settings,
    check_model_arguments,
    resolve_levers,
    save_model_hyperparameters,
)


class ImageClassifier(L.LightningModule):
    """Image classifier: the injected network (a torchvision ResNet50 and the Keras fine-tuning head by default).

    Args:
        num_classes: number of classes; linked from the DataModule by the CLI.
        class_names: names of the classes, index order; linked from the DataModule and saved in checkpoints.
        multilabel: each image has any number of the classes (linked from the DataModule: ``train/labels.csv``):
            sigmoid outputs, a loss on multi-hot rows (the default cross-entropy becomes
            ``lightning_modules.losses.BinaryCrossEntropy``, said in one line), and the metrics
            val/acc (exact match: every label right), val/map (mean average precision over the classes),
            val/f1_macro and val/f1_micro.
        threshold: multi-label: a class is predicted when its sigmoid output is at least this (metrics, predict); not
            saved in checkpoints, so each command takes its own.
        net: any ``nn.Module`` class by ``class_path``, with its ``init_args`` but without ``num_classes``, which the
            model passes (from Python: any callable num_classes -> nn.Module). It maps (B, 3, H, W) images to
            (B, num_classes) logits, and may declare its head (``head_modules()``; contract:
            lightning_modules/network.py, docs/EXTENDING.md). Default: ``lightning_modules.network.BackboneWithHead``
            (arch, weights, head_hidden, dropout).
        optimizer: any ``torch.optim`` optimizer by ``class_path`` (``torch.optim.AdamW``, ``timm.optim.Lamb`` with
            ``pip install 'imgcls[timm]'``), with its ``init_args``; from Python any callable params -> Optimizer. It
            gets the param groups below; its ``lr`` is per 256 images (``recipe.lr_scaling``). null: the SGD (lr 0.1,
            momentum 0.9, Nesterov, weight decay 1e-4). Contract and example: docs/EXTENDING.md.
        lr_scheduler: any ``torch.optim.lr_scheduler`` class by ``class_path`` (callable optimizer -> LRScheduler),
            stepped every optimizer step; ``total_steps`` and ``steps_per_epoch`` are passed when it takes them and
            they are unset (``OneCycleLR`` needs only ``max_lr``, per 256 images like ``lr``). null: the recipe's
            ``lightning_modules.schedules.WarmupCosine`` (1 warm-up epoch, then cosine decay to zero).
        loss: any ``nn.Module`` mapping (logits, targets) to a scalar (contract: lightning_modules/losses.py), by
            ``class_path``; null is ``torch.nn.CrossEntropyLoss()``. ``lightning_modules.losses.BinaryCrossEntropy``
            is ResNet strikes back's (with ``target_threshold``). It also gives val/loss and test/loss.
        batch_size: per-device batch size, linked from the DataModule; used only for lr scaling (``lr_plan``).
        recipe: how the optimizer and the batches are used (lightning_modules.settings.Recipe): ``lr_scaling``
            (the lr plan multiplies each group's lr before the scheduler is built), ``backbone_lr_ratio``,
            ``decay_norms_and_biases``, ``mixup_alpha`` and ``cutmix_alpha`` (on the device, on the normalised batch;
            the loss takes the mixed soft targets, and train/acc scores the argmax of the mixed target).
        levers: how the same run computes (lightning_modules.settings.Levers): ``channels_last``, ``compile`` and
            ``optimizer_impl`` (``fused=True`` / ``foreach=True`` when the optimizer takes it and its config leaves it
            unset), each ``auto`` chosen from the hardware (core/hardware.py).
        input_contract: the evaluation preprocessing the network is trained for, linked from the DataModule and saved
            in checkpoints (as timm's ``pretrained_cfg``): ``preset``, ``image_size`` (the square side it sees),
            ``resize_size`` and ``crop``, ``interpolation``, ``mean`` and ``std`` (of pixels scaled to [0, 1]).
            ``imgcls validate``, ``test``, ``predict`` and ``export`` read it from a checkpoint.
    """

    def __init__(
        self,
        num_classes: int,
        class_names: list[str] | None = None,
        multilabel: bool = False,
        threshold: OpenUnitInterval = 0.5,
        net: Callable[[int], nn.Module] = BackboneWithHead,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        loss: nn.Module | None = None,
        batch_size: PositiveInt = 64,
        input_contract: dict | None = None,
        recipe: Recipe = DEFAULT_RECIPE,
        levers: Levers = DEFAULT_LEVERS,
    ) -> None:
        net = network_from_config(net) if isinstance(net, dict) else net  # a checkpoint's, loaded without the CLI
        recipe, levers = as_settings(Recipe, recipe), as_settings(Levers, levers)
        check_model_arguments(ImageClassifier.__init__, num_classes, class_names, multilabel, threshold, batch_size,
                              recipe)
        self.optimizer_factory, lr_scheduler = factories(optimizer, lr_scheduler)
        super().__init__()
        save_model_hyperparameters(self, net, recipe, levers)  # as a config gives them
        self.recipe, self.lever_settings = recipe, levers
        self.lr_plan = LrPlan(lr_scheduler, lr_scaling=recipe.lr_scaling, backbone_lr_ratio=recipe.backbone_lr_ratio,
                              batch_size=batch_size)  # asked by configure_optimizers, restored by a resume
        self.criterion, why = criterion(loss, multilabel)
        if why:
            rank_zero_info(why)
        self.threshold = threshold
        self.input_contract = dict(input_contract) if input_contract is not None else None
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
        self.net = plain_callable(net)(num_classes)
        if not isinstance(self.net, nn.Module):
            raise ValueError(f"model.net built a {type(self.net).__name__}, not a torch.nn.Module: give an nn.Module "
                             "class that takes num_classes")
        if recipe.backbone_lr_ratio != 1:
            require_backbone(self.net, f"model.recipe.backbone_lr_ratio={recipe.backbone_lr_ratio}")
        self.batch_mix = batch_mix(num_classes, recipe.mixup_alpha, recipe.cutmix_alpha)  # None when both are off
        # The levers set to `auto` are chosen in configure_model, once the Trainer knows the device.
        self.levers: dict[str, bool | str] = {}
        self._channels_last = False
        self._net_compiled = False
        self._bar_loss: torch.Tensor | None = None  # the progress bar's loss, a host copy (`show_loss`)
        if levers.channels_last is True:
            self._set_channels_last()
        self.train_acc, self.val_metrics, self.test_metrics, self.eval_loss, self.val_acc_best = classifier_metrics(
            num_classes, multilabel, threshold)

    def configure_model(self) -> None:
        # Called by the Trainer (each fit, validate, ...) once it knows the device.
        trainer = self.attached_trainer()
        device = trainer.strategy.root_device.type if trainer is not None else self.device.type
        if not self.levers:
            self.levers, reasons = resolve_levers(asdict(self.lever_settings), device)
            rank_zero_info("model levers on " + device + ": " + "; ".join(reasons))
        if self.levers["channels_last"] and not self._channels_last:
            self._set_channels_last()
        if self.levers["compile"] and not self._net_compiled:
            self.net.compile()  # in place: nn.Module.compile keeps the state-dict keys
            self._net_compiled = True

    def attached_trainer(self) -> L.Trainer | None:
        """The Trainer this model is attached to, or None (a model built in Python and not yet fitted)."""
        try:
            return self.trainer
        except RuntimeError:  # LightningModule.trainer raises when no Trainer is attached
            return None

    def _set_channels_last(self) -> None:
        self.net = self.net.to(memory_format=torch.channels_last)
        self._channels_last = True

    # ---- forward and steps ----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)  # (B, 3, H, W) -> (B, num_classes) logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.batch_mix is not None:
            x, y = self.batch_mix(x, y)  # y: (B, num_classes) soft targets
        logits = self(x)
        loss = self.loss(logits, y)
        if self.hparams.multilabel:
            self.train_acc(logits.sigmoid(), y.int())
        else:
            self.train_acc(logits, y.argmax(dim=1) if y.ndim == 2 else y)
        self.log("train/loss", loss)  # to the loggers, which read it every trainer.log_every_n_steps steps
        self.show_loss(loss)
        # Per epoch, over every training image of every rank (torchmetrics syncs it once): one batch's accuracy is
        # too noisy to read, and the epoch value sits on the same axis as val/acc.
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def show_loss(self, loss: torch.Tensor) -> None:
        """The training loss in the progress bar, as a host copy taken every trainer.log_every_n_steps steps (every
        step on a CPU). Lightning turns a progress bar's values into numbers after every step, bar or no bar
        (Lightning issue 21232): on a GPU that `.item()` would wait for the step's kernels, and the host could no
        longer queue the next step while the GPU runs this one."""
        if loss.device.type == "cpu" or self._bar_loss is None \
                or self.trainer.global_step % max(1, self.trainer.log_every_n_steps or 1) == 0:
            self._bar_loss = loss.detach().to("cpu")
        self.log("loss", self._bar_loss, prog_bar=True, logger=False)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`model.loss` of (B, C) logits against class indices (B,), soft targets or multi-hot rows (B, C); the
        multi-hot rows of multi-label data as floats, as the loss contract has them (lightning_modules/losses.py)."""
        return self.criterion(logits, y.to(logits.dtype) if self.hparams.multilabel else y)

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        logits = self(x)
        metrics = self.val_metrics if prefix == "val" else self.test_metrics
        if self.hparams.multilabel:  # probabilities: torchmetrics applies a sigmoid only to values outside [0, 1]
            metrics.update(logits.sigmoid(), y.int())
        else:
            metrics.update(logits, y)
        loss = self.loss(logits, y)  # the training loss: val/loss and train/loss are the same quantity
        self.eval_loss[prefix].update(loss, weight=y.shape[0])
        self.log(f"{prefix}/loss", self.eval_loss[prefix], prog_bar=prefix == "val")
        self.log_dict(metrics, prog_bar=prefix == "val")

    def logged_metrics(self, multilabel: bool | None = None) -> set[str]:
        """The names this model logs (what a ModelCheckpoint or EarlyStopping may monitor); `multilabel` None: as
        configured, else as a model of that kind would."""
        return logged_names(self.hparams.num_classes, self.hparams.multilabel if multilabel is None else multilabel)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_acc_best(self.val_metrics["acc"].compute())
        self.log("val/acc_best", self.val_acc_best.compute())

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        x, index = batch
        return predictions(self(x).float(), index, self.class_names, self.hparams.multilabel)

    # ---- optimisation ---------------------------------------------------------------------------------------

    def make_optimizer(self) -> torch.optim.Optimizer:
        """model.optimizer over the param groups (optim.py; fused or foreach kernels per optimizer_impl), each group's
        lr scaled by the lr plan: the peak rates a scheduler then starts from."""
        impl = (self.levers.get("optimizer_impl")
                or resolve_levers(asdict(self.lever_settings), self.device.type)[0]["optimizer_impl"])
        trainer = self.attached_trainer()
        groups = param_groups(self.net, self.recipe.decay_norms_and_biases)
        optimizer, note = build_optimizer(self.optimizer_factory, groups, impl, **kernel_limits(trainer))
        if note:
            rank_zero_info(note)
        return self.lr_plan.scale_groups(optimizer, trainer)

    def configure_optimizers(self):
        optimizer = self.make_optimizer()
        scheduler = self.lr_plan.scheduler(optimizer, self.trainer, target_of(self.optimizer_factory).__name__)
        return {"optimizer": optimizer,  # name: LearningRateMonitor's tags (train/lr/pg1, ...), by the training curves
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}

    @classmethod
    def from_pretrained(cls, name_or_path, *, threshold: float | None = None) -> ImageClassifier:
        """The model of a folder written by `imgcls publish` (or its Hub repo id), in eval mode on the CPU: no
        checkpoint, no config file, nothing unpickled (lightning_modules/pretrained.py)."""
        return pretrained.from_pretrained(cls, name_or_path, threshold=threshold)

