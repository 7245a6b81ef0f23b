"""The LightningModule: fine-tunes a torchvision classification model with a two-layer head, and reports torchmetrics
per split."""

from __future__ import annotations

import math
import warnings
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import (
    MulticlassAccuracy,
    MultilabelExactMatch,
)

from core import hardware
from core.config_types import (
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
    UnitIntervalRightOpen,
    check_arguments,
)
from lightning_modules.losses import for_multilabel
from lightning_modules.network import Arch, build_network, head_prefix
from lightning_modules.optim import build_optimizer, rescale_learning_rates
from lightning_modules.targets import batch_mix, split_metrics

Auto = Literal["auto"]
OptimizerImpl = Literal["auto", "default", "foreach", "fused"]
Optimizer = Literal["sgd", "adamw", "lamb"]
LrScaling = Literal["linear", "sqrt", "none"]


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d)  # the layers whose running statistics a frozen backbone keeps fixed


class ImageClassifier(L.LightningModule):
    """Image classifier: a torchvision backbone (a ResNet50 by default) and the Keras fine-tuning head.

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
        arch: any torchvision classification model: resnet18 ... resnet152, wide_resnet50_2, convnext_tiny,
            efficientnet_b0, mobilenet_v3_large, regnet_y_8gf, vit_b_16, swin_t, ... (the head replaces its last
            Linear layer).
        weights: torchvision weights name (IMAGENET1K_V2, DEFAULT), a state-dict or checkpoint file, or null.
        head_hidden: width of the hidden head layer (1024 in the Keras/Horovod recipe this template reproduces:
            global average pool -> 1024 -> classes); 0 gives a single linear layer.
        dropout: dropout before the last layer of the head.
        optimizer: ``sgd`` (momentum, nesterov), ``adamw``, or ``lamb`` (timm's LAMB, of its ResNet-strikes-back
            recipes; needs ``pip install 'imgcls[timm]'``).
        loss: any ``nn.Module`` mapping (logits, targets) to a scalar (contract: lightning_modules/losses.py), by
            ``class_path``; null is ``torch.nn.CrossEntropyLoss()``. ``lightning_modules.losses.BinaryCrossEntropy``
            is ResNet strikes back's (with ``target_threshold``). It also gives val/loss and test/loss.
        lr: learning rate per 256 images; scaled by the global batch (world size x batch x accumulation).
        lr_scaling: ``linear``, ``sqrt`` or ``none``: how lr follows the global batch size.
        momentum: SGD momentum (AdamW: beta1).
        nesterov: Nesterov momentum for SGD.
        weight_decay: decoupled for AdamW, L2 for SGD; never applied to biases and normalisation weights.
        warmup_epochs: linear warm-up length (fractions allowed); cosine decay to zero follows.
        mixup_alpha: mixup of training batches (Beta(alpha, alpha) weights; 0.2 in torchvision's V2 recipe); 0 is off.
        cutmix_alpha: CutMix of training batches (1.0 in torchvision's V2 recipe); 0 is off. With both on, each batch
            gets one of the two, at even odds (v2.RandomChoice). They run on the device, on the normalised batch; the
            loss takes the mixed soft targets, and train/acc scores the argmax of the mixed target.
        backbone_lr_ratio: backbone lr / head lr, e.g. 0.1 to fine-tune the pretrained layers gently.
        freeze_backbone_epochs: keep the backbone frozen this many epochs: no gradients, no backward pass through
            it, no optimizer state for it, BatchNorm statistics fixed.
        batch_size: per-device batch size, linked from the DataModule; used only for lr scaling.
        channels_last: NHWC memory format; ``auto`` turns it on where it was measured faster (CUDA, x86 CPUs with
            AVX2), see core/hardware.py.
        compile: ``torch.compile`` the network (in place: checkpoint keys are unchanged) when the Trainer sets it up;
            ``auto`` compiles on CUDA with Triton only.
        optimizer_impl: ``default`` (torch's per-parameter loop), ``foreach`` or ``fused`` (one kernel for all
            parameters); ``auto`` picks fused where it was measured faster (CUDA, x86 CPUs with AVX2).
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
        arch: Arch = "resnet50",
        weights: str | None = None,
        head_hidden: NonNegativeInt = 1024,
        dropout: UnitIntervalRightOpen = 0.2,
        optimizer: Optimizer = "sgd",
        loss: nn.Module | None = None,
        lr: PositiveFloat = 0.1,
        lr_scaling: LrScaling = "linear",
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: NonNegativeFloat = 1e-4,
        warmup_epochs: NonNegativeFloat = 1.0,
        mixup_alpha: NonNegativeFloat = 0.0,
        cutmix_alpha: NonNegativeFloat = 0.0,
        backbone_lr_ratio: NonNegativeFloat = 1.0,
        freeze_backbone_epochs: NonNegativeInt = 0,
        batch_size: PositiveInt = 64,
        channels_last: bool | Auto = "auto",
        compile: bool | Auto = False,
        optimizer_impl: OptimizerImpl = "auto",
        input_contract: dict | None = None,
    ) -> None:
        check_arguments("model", ImageClassifier.__init__, locals())  # the annotated ranges and choices
        super().__init__()
        if num_classes is None or num_classes < 2:
            raise ValueError(f"model.num_classes={num_classes} must be at least 2 (it is linked from the data)")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"model.class_names has {len(class_names)} names but model.num_classes={num_classes}")
        if multilabel and (mixup_alpha or cutmix_alpha):
            raise ValueError("model.mixup_alpha and model.cutmix_alpha mix single-label targets; this data is "
                             "multi-label (train/labels.csv): set both to 0")
        # Each command's own threshold: not checkpointed, as a checkpoint's hparams would override the command line.
        with warnings.catch_warnings():  # Lightning's advice to ignore a module argument: done just below
            warnings.filterwarnings("ignore", message="Attribute 'loss' is an instance of `nn.Module`")
            self.save_hyperparameters(ignore=["threshold"])  # from a config: the loss's class_path and init_args
        if isinstance(self.hparams.get("loss"), nn.Module):  # an object from Python, which checkpoints loaded
            self.save_hyperparameters(ignore=["threshold", "loss"])  # weights_only cannot hold: left out
        loss = nn.CrossEntropyLoss() if loss is None else loss
        if multilabel:
            loss, why = for_multilabel(loss)
            if why:
                rank_zero_info(why)
        self.criterion = loss
        self.threshold = threshold
        self.input_contract = dict(input_contract) if input_contract is not None else None
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
        self.net = build_network(arch, weights, head_hidden, dropout, num_classes)
        self.batch_mix = batch_mix(num_classes, mixup_alpha, cutmix_alpha)  # None when both are off
        # The levers set to `auto` are chosen in configure_model, once the Trainer knows the device.
        self.levers: dict[str, bool | str] = {}
        self._channels_last = False
        self._net_compiled = False
        if channels_last is True:
            self._set_channels_last()

        self.train_acc = (MultilabelExactMatch(num_classes, threshold=threshold) if multilabel
                          else MulticlassAccuracy(num_classes, average="micro"))
        self.val_metrics = split_metrics(num_classes, "val", multilabel, threshold)
        self.test_metrics = split_metrics(num_classes, "test", multilabel, threshold)
        # Mean loss over all images of all ranks, synced once at epoch end: ranks may hold different numbers of
        # val/test batches (each image goes to one rank), so a per-step all-reduce (sync_dist) could deadlock.
        self.eval_loss = nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})
        self.val_acc_best = MaxMetric()  # best-so-far val/acc, for dashboards and sweeps
        self.val_acc_best.persistent(True)  # kept in checkpoints, so a resumed run remembers its best

    def configure_model(self) -> None:
        # Called by the Trainer (each fit, validate, ...) once it knows the device.
        device = self._trainer.strategy.root_device.type if self._trainer is not None else self.device.type
        if not self.levers:
            self.levers, reasons = resolve_levers(self.hparams, device)
            rank_zero_info("model levers on " + device + ": " + "; ".join(reasons))
        if self.levers["channels_last"] and not self._channels_last:
            self._set_channels_last()
        if self.hparams.freeze_backbone_epochs and self._trainer is not None and self._trainer.state.fn == "fit":
            self._set_backbone_trainable(not self.backbone_frozen())  # before the strategy wraps the model
        if self.levers["compile"] and not self._net_compiled:
            self.net.compile()  # in place: nn.Module.compile keeps the state-dict keys
            self._net_compiled = True

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
        self.log("train/loss", loss, prog_bar=True)
        # Per epoch, over every training image of every rank (torchmetrics syncs it once): one batch's accuracy is
        # too noisy to read, and the epoch value sits on the same axis as val/acc.
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

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
        if self.hparams.multilabel:  # every class at or above the threshold (PredictionWriter names them)
            probs = self(x).float().sigmoid()
            return {"index": index.cpu(), "probs": probs.cpu()}
        probs = self(x).float().softmax(dim=1)  # (B, num_classes)
        top = probs.topk(min(5, probs.shape[1]), dim=1)
        label = top.indices[:, 0]
        return {
            "index": index.cpu(),  # position in the predict dataset, maps back to the file path
            "label": label.cpu(),
            "class_name": [self.class_names[i] for i in label.tolist()],
            "confidence": top.values[:, 0].cpu(),
            "top5_labels": top.indices.cpu(),
            "top5_probs": top.values.cpu(),
        }

    # ---- fine-tuning: frozen backbone ----------------------------------------------------------------------
    # Frozen means requires_grad off (as Lightning's BackboneFinetuning does): no backward pass runs through the
    # backbone, and its parameters get no gradient, so the optimizer builds no momentum or Adam moments for them.
    # Unlike BackboneFinetuning, the backbone's parameter groups exist from the start (the LR schedule covers them);
    # and since DDP registers gradient hooks only for the parameters that require a gradient when it wraps the model,
    # the model is wrapped again when the backbone thaws. BatchNorm statistics stay fixed while frozen.

    def backbone_frozen(self) -> bool:
        trainer = self._trainer
        return trainer is not None and self.current_epoch < self.hparams.freeze_backbone_epochs

    def _set_backbone_trainable(self, trainable: bool) -> bool:
        """requires_grad of every backbone parameter; True when that changed anything."""
        prefix = head_prefix(self.net)
        changed = False
        for name, p in self.net.named_parameters():
            if not name.startswith(prefix) and p.requires_grad != trainable:
                p.requires_grad_(trainable)
                changed = True
        return changed

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.backbone_frozen():
            for name, module in self.net.named_modules():
                if isinstance(module, BATCH_NORMS) and not name.startswith(head_prefix(self.net)):
                    module.eval()
        return self

    def on_train_start(self) -> None:
        # Every fit start, resumes included: Lightning skips on_train_epoch_start when it resumes mid-epoch, and
        # restores the loops' epoch only after DDP wrapped the model.
        self._apply_freeze()

    def on_train_epoch_start(self) -> None:
        self._apply_freeze()  # the thaw epoch

    def _apply_freeze(self) -> None:
        """requires_grad and the BatchNorm mode of the backbone for the current epoch; DDP re-wrapped on a change."""
        if self.hparams.freeze_backbone_epochs and self._set_backbone_trainable(not self.backbone_frozen()):
            strategy = self.trainer.strategy
            if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
                strategy.model = self  # unwrapped, then wrapped again with the backbone's gradient hooks
                strategy.configure_ddp()
                rank_zero_info(f"backbone unfrozen at epoch {self.current_epoch}: DDP re-wrapped the model")
        self.train(self.training)  # re-apply the frozen-BatchNorm rule as epochs advance

    # ---- optimisation ---------------------------------------------------------------------------------------

    def lr_scale(self) -> float:
        """Multiplier from `lr` (per 256 images) to the learning rate actually used."""
        world = self.trainer.world_size if self._trainer is not None else 1
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        global_batch = world * self.hparams.batch_size * accumulate
        return {"linear": global_batch / 256, "sqrt": math.sqrt(global_batch / 256), "none": 1.0}[
            self.hparams.lr_scaling
        ]

    def param_groups(self) -> list[dict]:
        """Four groups: (backbone | head) x (decay | no decay); biases and norm weights (ndim <= 1) never decay."""
        hp = self.hparams
        head_lr = hp.lr * self.lr_scale()
        groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in self.net.named_parameters():
            groups.setdefault((name.startswith(head_prefix(self.net)), p.ndim > 1), []).append(p)
        return [
            {
                "params": params,
                "lr": head_lr if is_head else head_lr * hp.backbone_lr_ratio,
                "weight_decay": hp.weight_decay if decays else 0.0,
                "is_head": is_head,
            }
            for (is_head, decays), params in sorted(groups.items())
        ]

    def configure_optimizers(self):
        hp = self.hparams
        groups = self.param_groups()
        chosen = self.levers.get("optimizer_impl") or resolve_levers(hp, self.device.type)[0]["optimizer_impl"]
        optimizer = build_optimizer(hp.optimizer, groups, momentum=hp.momentum, nesterov=hp.nesterov, impl=chosen)

        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        # Optimizer steps per epoch from the loader, not total_steps / max_epochs: with max_steps and no max_epochs,
        # "epoch" would be the whole run, and warm-up with it.
        if self.trainer.train_dataloader is None and self._trainer.state.fn == "fit":
            self.trainer.fit_loop.setup_data()  # max_steps runs: estimated_stepping_batches does not build it
        batches, epochs = self.trainer.num_training_batches, self.trainer.max_epochs
        if math.isfinite(batches):
            per_epoch = math.ceil(batches / self.trainer.accumulate_grad_batches)
        else:  # no loader yet (an iterable of unknown length): the configured epochs
            per_epoch = total_steps // epochs if epochs and epochs > 0 else total_steps
        steps_per_epoch = max(1, min(total_steps, per_epoch))
        warmup_steps = int(hp.warmup_epochs * steps_per_epoch)
        frozen_steps = hp.freeze_backbone_epochs * steps_per_epoch

        def schedule(step: int) -> float:  # warm-up, then cosine to zero; a pure function of the step
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        def backbone_schedule(step: int) -> float:
            return 0.0 if step < frozen_steps else schedule(step)

        lambdas = [schedule if g["is_head"] else backbone_schedule for g in groups]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        rank_zero_info(
            f"lr {hp.lr:g} per 256 images x {self.lr_scale():.4g} ({hp.lr_scaling} scaling, global batch "
            f"{self.trainer.world_size} x {hp.batch_size} x {self.trainer.accumulate_grad_batches}) = "
            f"{hp.lr * self.lr_scale():.4g} for the head (peak); {total_steps} steps, {warmup_steps} of warm-up"
        )  # not groups[..]["lr"]: LambdaLR has already multiplied that by the schedule's first value
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


    # ---- resuming on another global batch (elastic restarts, fewer GPUs) --------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lr_scale"] = self.lr_scale()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Rescale the restored learning rates when the global batch changed since the checkpoint (another world size
        after an elastic restart, other accumulation): the optimizer and schedule states carry the old scale."""
        saved = checkpoint.get("lr_scale")
        if saved is None or self._trainer is None or self.trainer.state.fn != "fit":
            return
        factor = self.lr_scale() / saved
        if math.isclose(factor, 1.0):
            return
        rescale_learning_rates(checkpoint, factor)
        rank_zero_info(
            f"resuming on a global batch of {self.trainer.world_size} x {self.hparams.batch_size} x "
            f"{self.trainer.accumulate_grad_batches}: learning rates rescaled x{factor:.4g} ({self.hparams.lr_scaling} "
            f"scaling: {saved:.4g} -> {self.lr_scale():.4g} per the lr of 256 images)"
        )


def resolve_levers(hparams, device: str) -> tuple[dict[str, bool | str], list[str]]:
    """The model's speed levers for `device`: each `auto` chosen from the hardware; and one reason per lever."""
    hw = hardware.detect()
    rules = {"channels_last": hardware.choose_channels_last, "compile": hardware.choose_compile,
             "optimizer_impl": hardware.choose_optimizer_impl}
    levers, reasons = {}, []
    for key, rule in rules.items():
        value, why = rule(hw, device) if hparams[key] == "auto" else (hparams[key], "set in the config")
        levers[key] = value
        shown = ("on" if value else "off") if isinstance(value, bool) else value
        reasons.append(f"{key} {shown} ({why})")
    return levers, reasons
