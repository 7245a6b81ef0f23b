"""The model's small groups of settings (`model.recipe`, `model.levers`): typed fields, each with its one-line doc;
and the levers chosen for a device (`resolve_levers`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from core import hardware
from core.config_types import NonNegativeFloat, check_arguments

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
