"""The model's small groups of settings (`model.recipe`, `model.levers`): typed fields, each with its one-line doc;
the levers chosen for a device (`resolve_levers`); and the model's arguments, checked and saved as its checkpoints
keep them."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from torch import nn

from core import hardware
from core.config_types import NonNegativeFloat, check_arguments
from lightning_modules.network import network_config

Auto = Literal["auto"]
OptimizerImpl = Literal["auto", "default", "foreach", "fused"]
LrScaling = Literal["linear", "sqrt", "none"]


@dataclass(frozen=True)
class Recipe:
    """How the injected optimizer and the batches are used: lr scaling, parameter groups, mixup and CutMix."""

    lr_scaling: LrScaling = "linear"
    """How the optimizer's lr (per 256 images) follows the global batch (world size x batch x accumulation)."""
    backbone_lr_ratio: NonNegativeFloat = 1.0
    """Backbone lr / head lr, e.g. 0.1 to fine-tune pretrained layers gently (needs the network's head_modules)."""
    decay_norms_and_biases: bool = False
    """Weight decay on biases and norm weights (ndim <= 1) too; false (the recipe): their groups get 0."""
    mixup_alpha: NonNegativeFloat = 0.0
    """Mixup of training batches, Beta(alpha, alpha) weights (0.2 in torchvision's V2 recipe); 0 is off."""
    cutmix_alpha: NonNegativeFloat = 0.0
    """CutMix of training batches (1.0 in torchvision's V2 recipe); 0 is off; both on: one of the two per batch."""

    def __post_init__(self) -> None:
        check_arguments("model.recipe", Recipe, asdict(self))


@dataclass(frozen=True)
class Levers:
    """How the same run computes (a resume may change them); `auto` is chosen from the hardware (core/hardware.py)."""

    channels_last: bool | Auto = "auto"
    """NHWC memory format; auto: on where it was measured faster (CUDA, x86 CPUs with AVX2)."""
    compile: bool | Auto = False
    """torch.compile the network in place (checkpoint keys unchanged); auto: on CUDA with Triton only."""
    optimizer_impl: OptimizerImpl = "auto"
    """default, foreach or fused kernels, where the optimizer takes them; auto: fused on CUDA and AVX2 CPUs (foreach
    instead for SGD under 16-mixed's GradScaler, and for any optimizer whose gradients are clipped under mixed
    precision: lightning_modules/optim.py says why)."""

    def __post_init__(self) -> None:
        check_arguments("model.levers", Levers, asdict(self))


DEFAULT_RECIPE, DEFAULT_LEVERS = Recipe(), Levers()  # frozen: safe as argument defaults


def as_settings(kind: type, value):
    """`value` (None, a dict from a checkpoint's hyperparameters, or an instance) as an instance of `kind`."""
    if value is None:
        return kind()
    return kind(**value) if isinstance(value, dict) else value


def resolve_levers(settings: Mapping, device: str) -> tuple[dict[str, bool | str], list[str]]:
    """The model's speed levers (`settings`: Levers as a dict) for `device`: each `auto` chosen from the hardware; and
    one reason per lever."""
    hw = hardware.detect()
    rules = {"channels_last": hardware.choose_channels_last, "compile": hardware.choose_compile,
             "optimizer_impl": hardware.choose_optimizer_impl}
    levers, reasons = {}, []
    for key, rule in rules.items():
        value, why = rule(hw, device) if settings[key] == "auto" else (settings[key], "set in the config")
        levers[key] = value
        shown = ("on" if value else "off") if isinstance(value, bool) else value
        reasons.append(f"{key} {shown} ({why})")
    return levers, reasons


def check_model_arguments(init: Callable, num_classes: int, class_names: list[str] | None, multilabel: bool,
                          threshold: float, batch_size: int, recipe: Recipe) -> None:
    """ImageClassifier's refusals of its arguments (`init`: its __init__), before anything is built."""
    check_arguments("model", init, {"threshold": threshold, "batch_size": batch_size})
    if num_classes is None or num_classes < 2:
        raise ValueError(f"model.num_classes={num_classes} must be at least 2 (it is linked from the data)")
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"model.class_names has {len(class_names)} names but model.num_classes={num_classes}")
    if multilabel and (recipe.mixup_alpha or recipe.cutmix_alpha):
        raise ValueError("model.recipe.mixup_alpha and model.recipe.cutmix_alpha mix single-label targets; this "
                         "data is multi-label (train/labels.csv): set both to 0")


def save_model_hyperparameters(model, net, recipe: Recipe, levers: Levers) -> None:
    """The arguments of the caller (`model`'s __init__) as a config gives them (class_path and init_args of each
    seam), the settings' dataclasses as plain dicts. Each command's own threshold is left out: a checkpoint's hparams
    would override the command line. Objects from Python (a loss module, a network or optimizer callable), which
    checkpoints loaded weights_only cannot hold, are left out too, a network class or partial kept by name."""
    init = inspect.currentframe().f_back  # the frame of __init__, whose arguments these are
    with warnings.catch_warnings():  # Lightning's advice to ignore a module argument: done just below
        warnings.filterwarnings("ignore", message="Attribute 'loss' is an instance of `nn.Module`")
        model.save_hyperparameters(ignore=["threshold"], frame=init)
    python_objects = [k for k in ("net", "loss", "optimizer", "lr_scheduler")
                      if isinstance(model.hparams.get(k), nn.Module) or callable(model.hparams.get(k))]
    if python_objects:
        model.save_hyperparameters(ignore=["threshold", *python_objects], frame=init)
    if "net" in python_objects and network_config(net) is not None:
        model.hparams["net"] = network_config(net)
    for key, value in (("recipe", recipe), ("levers", levers)):
        if not isinstance(model.hparams.get(key), Mapping):
            model.hparams[key] = asdict(value)
