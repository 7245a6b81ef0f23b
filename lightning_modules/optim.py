"""Building the injected optimizer over the model's param groups.

`model.optimizer` is any callable `params -> torch.optim.Optimizer` (in YAML: a class_path such as torch.optim.AdamW
or timm.optim.Lamb, which jsonargparse hands over as a functools.partial of its init_args), and `model.lr_scheduler`
any callable `optimizer -> LRScheduler`. The model calls each with what only it knows, where the callable takes it and
the config left it unset (None): the optimizer's `fused` or `foreach` kernels (model.levers.optimizer_impl), the
scheduler's `total_steps` and `steps_per_epoch` (the run's length: lr_plan.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_modules.network import head_parameter_names
from lightning_modules.schedules import WarmupCosine

# The recipe's default (model.optimizer: null, model.lr_scheduler: null): SGD with Nesterov momentum at 0.1 per 256
# images, then 1 warm-up epoch and a cosine decay.
DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
DEFAULT_LR_SCHEDULER = functools.partial(WarmupCosine, warmup_epochs=1.0)


def target_of(factory: Callable) -> Callable:
    """The class (or function) a callable builds: a partial's target, jsonargparse's wrapped class, or itself."""
    while isinstance(factory, functools.partial):
        classes = [a for a in factory.args if isinstance(a, type)]  # jsonargparse: partial(call, instantiator, cls)
        factory = classes[-1] if classes else factory.func
    return factory


def plain_callable(factory: Callable) -> Callable:
    """jsonargparse's partial of a class_path (call_without_instantiate_context, an instantiator, the class) as
    partial(class, **init_args): under LightningCLI the instantiator holds the CLI, which neither deepcopy (EMA's
    averaged copy of the model) nor pickle can copy. Any other callable is returned as it is."""
    if isinstance(factory, functools.partial) and factory.func.__module__.startswith("jsonargparse"):
        return functools.partial(target_of(factory), **factory.keywords)
    return factory


def factories(optimizer: Callable | None, lr_scheduler: Callable | None) -> tuple[Callable, Callable]:
    """`model.optimizer` and `model.lr_scheduler` as plain callables (null: the recipe's defaults). The optimizer is
    tried on one parameter: its own checks of its arguments (a negative lr, betas out of range) refuse before any
    training."""
    for key, value in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if value is not None and not callable(value):
            raise ValueError(f"model.{key}={value!r} is not a class_path: give the class, e.g. "
                             + ("torch.optim.AdamW" if key == "optimizer" else "torch.optim.lr_scheduler.OneCycleLR"))
    optimizer = DEFAULT_OPTIMIZER if optimizer is None else plain_callable(optimizer)
    lr_scheduler = DEFAULT_LR_SCHEDULER if lr_scheduler is None else plain_callable(lr_scheduler)
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))])
    except ValueError as err:
        raise ValueError(f"model.optimizer ({target_of(optimizer).__name__}): {err}") from None
    return optimizer, lr_scheduler


def unset_arguments(factory: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that `factory`'s target takes and its partial left unset (absent or None)."""
    try:
        accepted = inspect.signature(target_of(factory)).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing
        return {}
    given = getattr(factory, "keywords", {}) or {}
    return {k: v for k, v in values.items() if k in accepted and given.get(k) is None}


def param_groups(net: nn.Module, decay_norms_and_biases: bool) -> list[dict]:
    """Up to four groups: (backbone | head, as the network declares them) x (decay | no decay); biases and norm
    weights (ndim <= 1) get weight_decay 0 unless decay_norms_and_biases. Their lr is the optimizer's (the lr plan
    scales it: lr_plan.py)."""
    head = head_parameter_names(net)
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in net.named_parameters():
        decays = decay_norms_and_biases or p.ndim > 1
        groups.setdefault((name in head, decays), []).append(p)
    return [{"params": params, "is_head": is_head, **({} if decays else {"weight_decay": 0.0})}
            for (is_head, decays), params in sorted(groups.items())]


def kernel_limits(trainer) -> dict[str, bool]:
    """What the Trainer's precision asks of the optimizer's kernels (build_optimizer's keywords): a GradScaler
    (16-mixed), gradients clipped under mixed precision; nothing without a Trainer."""
    if trainer is None:
        return {}
    plugin = trainer.precision_plugin
    return {"grad_scaler": getattr(plugin, "scaler", None) is not None,
            "clipped_in_mixed_precision": bool(trainer.gradient_clip_val) and isinstance(plugin, MixedPrecision)}


def build_optimizer(factory: Callable, groups: list[dict], impl: str, *, grad_scaler: bool = False,
                    clipped_in_mixed_precision: bool = False) -> tuple[torch.optim.Optimizer, str | None]:
    """`factory(groups)`, with `fused=True` or `foreach=True` when `impl` asks for it and the optimizer takes it; and
    a note where a fused kernel was asked for and foreach given instead: because the gradients are clipped under mixed
    precision, where Lightning refuses to clip those of a fused optimizer (it unscales them inside its step), or
    because a GradScaler (16-mixed) would skip the first step of a fused SGD whose momentum cannot be primed with
    zeros (`prime_fused_sgd_momentum`)."""
    kernels = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    note = None
    if impl == "fused" and "fused" not in unset_arguments(factory, kernels):
        # the config's own fused: true is kept; with none (timm's Lamb, RMSprop on some builds) or false: foreach
        kernels = {} if (getattr(factory, "keywords", None) or {}).get("fused") else {"foreach": True}
    elif impl == "fused" and clipped_in_mixed_precision:
        kernels = {"foreach": True}
        note = ("optimizer_impl foreach, not fused: trainer.gradient_clip_val is set, and Lightning's mixed precision "
                "clips no gradients of a fused optimizer")
    elif impl == "fused" and grad_scaler and _is_subclass(target_of(factory), torch.optim.SGD):
        probe = factory([{**group, "params": [torch.nn.Parameter(torch.zeros(1))]} for group in groups])
        if any(group["momentum"] and group["dampening"] for group in probe.param_groups):
            kernels = {"foreach": True}
            note = ("optimizer_impl foreach, not fused: torch's fused SGD leaves its momentum undefined on a first "
                    "step that 16-mixed's GradScaler skips, and with a dampening a zero momentum is not the same")
    optimizer = factory(groups, **unset_arguments(factory, kernels))
    prime_fused_sgd_momentum(optimizer)
    return optimizer, note


def prime_fused_sgd_momentum(optimizer: torch.optim.Optimizer) -> None:
    """A fused SGD with momentum gets zero momentum buffers before each step where a parameter with a gradient has
    none (the groups without dampening).

    torch's fused SGD allocates the momentum buffers of a group's first step with `torch.empty_like` and lets its
    kernel fill them; a step that 16-mixed's GradScaler skips for an inf gradient (the first steps of a run, or those
    of a backbone that thaws) leaves them undefined, and the weights turn nan a step later. Without dampening, a zero
    buffer gives that first step's update exactly (0.9 x 0 + the gradient): the weights of torch's loop, bitwise
    (tests/test_model.py), without the loop's host synchronisation at every step under a GradScaler.
    tests/test_internals.py fails once torch defines the buffers itself, so this can go."""
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("fused"):
        optimizer.register_step_pre_hook(_zero_missing_momentum)


def _zero_missing_momentum(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if group["momentum"] and not group["dampening"]:
            for param in group["params"]:
                if param.grad is not None and "momentum_buffer" not in optimizer.state.get(param, {}):
                    optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


def _is_subclass(target: Callable, classes: tuple[type, ...]) -> bool:
    return isinstance(target, type) and issubclass(target, classes)
