"""Checks that a fit's parts fit together, made before its first step: a mismatch found after an epoch wastes it."""

from __future__ import annotations

import torchvision

from training.callbacks.freezing import BATCH_NORMS


def check_monitored(trainer, model, datamodule) -> None:
    """Every callback that monitors a metric (ModelCheckpoint, EarlyStopping, ...) names one the model logs.

    Lightning finds out only after the first validation ("could not find the monitored key"). A multi-label recipe
    on single-label data (or the reverse) is the usual cause, and is named as such.
    """
    logged = getattr(model, "logged_metrics", None)
    if logged is None:  # a user's model that does not say what it logs
        return
    names = set(logged()) | {"epoch", "step"}  # Lightning's own candidates: monitor "step", mode max = the newest
    for callback in trainer.callbacks:
        monitor = getattr(callback, "monitor", None)
        if not isinstance(monitor, str) or monitor in names:
            continue
        multilabel = bool(getattr(datamodule, "multilabel", False))
        root = getattr(datamodule, "root", None)
        if not multilabel and monitor in model.logged_metrics(multilabel=True):
            why = (f"{monitor} is a multi-label metric: this config needs multi-label data (a labels.csv in each "
                   f"split folder), and data.root={root} has class folders")
        elif multilabel and monitor in model.logged_metrics(multilabel=False):
            why = f"{monitor} is a single-label metric, and data.root={root} is multi-label (labels.csv)"
        else:
            why = f"the model logs {', '.join(sorted(names))}"
        raise ValueError(f"{type(callback).__name__} monitors {monitor}, which this model never logs: {why}")


def check_batch_norm(model, datamodule) -> None:
    """A training batch of one image with BatchNorm layers in the network: torch refuses it at the first step
    ("Expected more than 1 value per channel"), a traceback that names no key. Said before the fit, with the key."""
    batch = getattr(datamodule, "batch_size", None)
    if batch == 1 and any(isinstance(module, BATCH_NORMS) for module in model.modules()):
        raise ValueError("data.batch_size=1: the network's BatchNorm layers need at least 2 images a training batch; "
                         "raise data.batch_size (trainer.accumulate_grad_batches makes a larger effective batch)")


def check_input_side(model, datamodule, fit: bool = False) -> None:
    """A network built for one image side (a vision transformer's position embeddings: torchvision's ViT, timm's with
    a fixed patch embedding) given images of another, or in a `fit` from an epoch of data.progressive_resizing on:
    torchvision and timm assert at that step ("Wrong image height! Expected 224 but got 32!"), naming no key. Said
    before the run, with the key."""
    expected = fixed_side(model)
    if expected is None:
        return
    for name in ("train_transform", "eval_transform"):
        side = getattr(getattr(datamodule, name, None), "image_size", None)
        if side is not None and int(side) != expected:
            raise ValueError(f"data.{name}.image_size={side}: the network takes {expected} px images only (its "
                             f"position embeddings are built for that side); set data.image_size {expected}")
    schedule = (getattr(datamodule, "progressive_resizing", None) or {}) if fit else {}
    if any(int(side) != expected for side in schedule.values()):  # each epoch's batches resized to its side
        raise ValueError(f"data.progressive_resizing={schedule}: the network takes {expected} px images only (its "
                         "position embeddings are built for that side); set data.progressive_resizing null")


def fixed_side(model) -> int | None:
    """The one image side the network takes, where it has one (None: any side)."""
    for module in model.modules():
        if isinstance(module, torchvision.models.VisionTransformer):
            return module.image_size
        # timm's PatchEmbed (not imported: timm is an extra): strict unless built with a dynamic image size
        if hasattr(module, "img_size") and getattr(module, "strict_img_size", False) and not getattr(
                module, "dynamic_img_size", False):
            return int(module.img_size[0])
    return None
