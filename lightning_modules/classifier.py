"""The LightningModule: trains the injected network (`model.net`; by default a torchvision backbone with a two-layer
head) with the injected loss, optimizer and schedule, and reports torchmetrics per split."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

import lightning_modules.pretrained as pretrained
from core.config_types import OpenUnitInterval, PositiveInt, check_arguments
from lightning_modules.losses import for_multilabel
from lightning_modules.network import (
    BackboneWithHead,
    head_parameter_names,
    network_config,
    network_from_config,
    require_backbone,
)
from lightning_modules.optim import (
    build_lr_scheduler,
    build_optimizer,
    factories,
    plain_callable,
    replan_lr_scheduler,
    rescale_learning_rates,
    resumed_length,
    target_of,
    unset_arguments,
)
from lightning_modules.schedules import WarmupCosine
from lightning_modules.settings import DEFAULT_LEVERS, DEFAULT_RECIPE, Levers, Recipe, as_settings, resolve_levers
from lightning_modules.targets import batch_mix, classifier_metrics, predictions, split_metrics


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
        batch_size: per-device batch size, linked from the DataModule; used only for lr scaling.
        recipe: how the optimizer and the batches are used (lightning_modules.settings.Recipe): ``lr_scaling``
            (each group's lr is multiplied before the scheduler is built), ``backbone_lr_ratio``,
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
        _check_arguments(num_classes, class_names, multilabel, threshold, batch_size, recipe)
        self.optimizer_factory, self.lr_scheduler_factory = factories(optimizer, lr_scheduler)
        super().__init__()
        self._save_hyperparameters(net, recipe, levers)
        self.recipe, self.lever_settings = recipe, levers
        loss = nn.CrossEntropyLoss() if loss is None else loss
        if multilabel:
            loss, why = for_multilabel(loss)
            if why:
                rank_zero_info(why)
        self.criterion = loss
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

    def _save_hyperparameters(self, net, recipe: Recipe, levers: Levers) -> None:
        """The arguments as a config gives them (class_path and init_args of each seam), the settings' dataclasses as
        plain dicts. Each command's own threshold is left out: a checkpoint's hparams would override the command line.
        Objects from Python (a loss module, a network or optimizer callable), which checkpoints loaded weights_only
        cannot hold, are left out too, a network class or partial kept by name."""
        init = inspect.currentframe().f_back  # the frame of __init__, whose arguments these are
        with warnings.catch_warnings():  # Lightning's advice to ignore a module argument: done just below
            warnings.filterwarnings("ignore", message="Attribute 'loss' is an instance of `nn.Module`")
            self.save_hyperparameters(ignore=["threshold"], frame=init)
        python_objects = [k for k in ("net", "loss", "optimizer", "lr_scheduler")
                          if isinstance(self.hparams.get(k), nn.Module) or callable(self.hparams.get(k))]
        if python_objects:
            self.save_hyperparameters(ignore=["threshold", *python_objects], frame=init)
        if "net" in python_objects and network_config(net) is not None:
            self.hparams["net"] = network_config(net)
        for key, value in (("recipe", recipe), ("levers", levers)):
            if not isinstance(self.hparams.get(key), Mapping):
                self.hparams[key] = asdict(value)

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
        multilabel = self.hparams.multilabel if multilabel is None else multilabel
        names = {"train/loss", "train/acc", "val/acc_best"}
        for split in ("val", "test"):
            names |= {f"{split}/loss", *split_metrics(self.hparams.num_classes, split, multilabel).keys()}
        return names

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

    def lr_scale(self) -> float:
        """Multiplier from the optimizer's lr (per 256 images) to the learning rate actually used."""
        trainer = self.attached_trainer()
        world = trainer.world_size if trainer is not None else 1
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        global_batch = world * self.hparams.batch_size * accumulate
        return {"linear": global_batch / 256, "sqrt": math.sqrt(global_batch / 256), "none": 1.0}[
            self.recipe.lr_scaling
        ]

    def param_groups(self) -> list[dict]:
        """Up to four groups: (backbone | head, as the network declares them) x (decay | no decay); biases and norm
        weights (ndim <= 1) get weight_decay 0 unless decay_norms_and_biases. Their lr is the optimizer's (scaled in
        configure_optimizers)."""
        head = head_parameter_names(self.net)
        groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in self.net.named_parameters():
            decays = self.recipe.decay_norms_and_biases or p.ndim > 1
            groups.setdefault((name in head, decays), []).append(p)
        return [{"params": params, "is_head": is_head, **({} if decays else {"weight_decay": 0.0})}
                for (is_head, decays), params in sorted(groups.items())]

    def steps(self) -> tuple[int, int]:
        """(optimizer steps of a fit from its start, optimizer steps per epoch); a resumed fit's: resumed_length."""
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        # Optimizer steps per epoch from the loader, not total_steps / max_epochs: with max_steps and no max_epochs,
        # "epoch" would be the whole run, and warm-up with it.
        if self.trainer.train_dataloader is None and self.trainer.state.fn == "fit":
            self.trainer.fit_loop.setup_data()  # max_steps runs: estimated_stepping_batches does not build it
        batches, epochs = self.trainer.num_training_batches, self.trainer.max_epochs
        if math.isfinite(batches):
            per_epoch = math.ceil(batches / self.trainer.accumulate_grad_batches)
        else:  # no loader yet (an iterable of unknown length): the configured epochs
            per_epoch = total_steps // epochs if epochs and epochs > 0 else total_steps
        return total_steps, max(1, min(total_steps, per_epoch))

    def lr_multipliers(self, groups: list[dict]) -> list[float]:
        """Per param group: lr_scale (per 256 images -> this global batch), times backbone_lr_ratio for the backbone."""
        return [self.lr_scale() * (1.0 if g["is_head"] else self.recipe.backbone_lr_ratio) for g in groups]

    def make_optimizer(self) -> torch.optim.Optimizer:
        """model.optimizer over param_groups (fused or foreach kernels per optimizer_impl), each group's lr multiplied
        by its lr_multipliers: the peak rates a scheduler then starts from."""
        impl = (self.levers.get("optimizer_impl")
                or resolve_levers(asdict(self.lever_settings), self.device.type)[0]["optimizer_impl"])
        trainer = self.attached_trainer()
        scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None  # 16-mixed
        clipped = trainer is not None and bool(trainer.gradient_clip_val) and isinstance(trainer.precision_plugin,
                                                                                          MixedPrecision)
        optimizer, note = build_optimizer(self.optimizer_factory, self.param_groups(), impl,
                                          grad_scaler=scaler is not None, clipped_in_mixed_precision=clipped)
        if note:
            rank_zero_info(note)
        for group, multiplier in zip(optimizer.param_groups, self.lr_multipliers(optimizer.param_groups), strict=True):
            group["lr"] = group["lr"] * multiplier
        return optimizer

    def configure_optimizers(self):
        optimizer = self.make_optimizer()
        multipliers = self.lr_multipliers(optimizer.param_groups)
        head = next(i for i, g in enumerate(optimizer.param_groups) if g["is_head"])
        peak = optimizer.param_groups[head]["lr"]
        total_steps, steps_per_epoch = self.steps()
        scheduler = build_lr_scheduler(self.lr_scheduler_factory, optimizer, total_steps=total_steps,
                                       steps_per_epoch=steps_per_epoch, multipliers=multipliers)
        warmup = getattr(scheduler, "warmup_steps", None)
        rank_zero_info(
            f"{target_of(self.optimizer_factory).__name__} lr {peak / multipliers[head]:g} per 256 images x "
            f"{self.lr_scale():.4g} ({self.recipe.lr_scaling} scaling, global batch {self.trainer.world_size} x "
            f"{self.hparams.batch_size} x {self.trainer.accumulate_grad_batches}) = {peak:.4g} for the head (peak); "
            f"{type(scheduler).__name__} over {total_steps} steps" + (f", {warmup} of warm-up" if warmup else "")
        )  # the peak read before the scheduler set the first step's rate
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """A resumed fit whose length differs from its checkpoint's plan (another max_epochs, max_steps, batch size,
        world size or accumulation) follows the schedule of the new length from its resume step, as a fit planned that
        long from its start, to the end value at its last step. One without total_steps continues as saved."""
        (saved, step), self._saved_plan = getattr(self, "_saved_plan", (None, 0)), (None, 0)
        total_steps, steps_per_epoch = self.steps()
        self._planned_steps = (resumed_length(self.trainer, steps_per_epoch) or total_steps) if saved else None
        if saved is None or saved["total_steps"] == (total_steps := self._planned_steps):
            return
        config = self.trainer.lr_scheduler_configs[0]
        name = type(config.scheduler).__name__
        if "total_steps" not in unset_arguments(self.lr_scheduler_factory, {"total_steps": total_steps}):
            rank_zero_info(f"lr schedule: {saved['total_steps']} -> {total_steps} optimizer steps; {name} takes no "
                           f"total_steps, so it continues as saved")
            return
        optimizer = config.scheduler.optimizer
        config.scheduler = replan_lr_scheduler(self.lr_scheduler_factory, optimizer, step=step,
                                               total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                               multipliers=self.lr_multipliers(optimizer.param_groups))
        what = "the cosine" if isinstance(config.scheduler, WarmupCosine) else name
        rank_zero_info(f"lr schedule: {saved['total_steps']} -> {total_steps} optimizer steps; {what} follows the "
                       f"new length from step {step}")

    # ---- resuming on another global batch (elastic restarts, fewer GPUs) --------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lr_scale"] = self.lr_scale()
        trainer = self.attached_trainer()
        if trainer is not None and trainer.state.fn == "fit":
            checkpoint["lr_plan"] = {"total_steps": getattr(self, "_planned_steps", None) or self.steps()[0]}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Rescale the restored learning rates when the global batch changed since the checkpoint (another world size
        after an elastic restart, other accumulation): the optimizer and schedule states carry the old scale. Note
        the run length the checkpoint's schedule was planned for (on_train_start follows a new one)."""
        self._saved_plan = (checkpoint.get("lr_plan"), checkpoint.get("global_step", 0))
        saved = checkpoint.get("lr_scale")
        trainer = self.attached_trainer()
        if saved is None or trainer is None or trainer.state.fn != "fit":
            return
        factor = self.lr_scale() / saved
        if math.isclose(factor, 1.0):
            return
        rescale_learning_rates(checkpoint, factor)
        rank_zero_info(
            f"resuming on a global batch of {self.trainer.world_size} x {self.hparams.batch_size} x "
            f"{self.trainer.accumulate_grad_batches}: learning rates rescaled x{factor:.4g} ({self.recipe.lr_scaling} "
            f"scaling: {saved:.4g} -> {self.lr_scale():.4g} per the lr of 256 images)"
        )

    @classmethod
    def from_pretrained(cls, name_or_path, *, threshold: float | None = None) -> ImageClassifier:
        """The model of a folder written by `imgcls publish` (or its Hub repo id), in eval mode on the CPU: no
        checkpoint, no config file, nothing unpickled (lightning_modules/pretrained.py)."""
        return pretrained.from_pretrained(cls, name_or_path, threshold=threshold)


def _check_arguments(num_classes: int, class_names: list[str] | None, multilabel: bool, threshold: float,
                     batch_size: int, recipe: Recipe) -> None:
    """ImageClassifier's refusals of its arguments, before anything is built."""
    check_arguments("model", ImageClassifier.__init__, {"threshold": threshold, "batch_size": batch_size})
    if num_classes is None or num_classes < 2:
        raise ValueError(f"model.num_classes={num_classes} must be at least 2 (it is linked from the data)")
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"model.class_names has {len(class_names)} names but model.num_classes={num_classes}")
    if multilabel and (recipe.mixup_alpha or recipe.cutmix_alpha):
        raise ValueError("model.recipe.mixup_alpha and model.recipe.cutmix_alpha mix single-label targets; this "
                         "data is multi-label (train/labels.csv): set both to 0")
