"""Building the injected optimizer and LR scheduler, and rescaling the learning rates of a checkpoint to another
global batch.

`model.optimizer` is any callable `params -> torch.optim.Optimizer` (in YAML: a class_path such as torch.optim.AdamW
or timm.optim.Lamb, which jsonargparse hands over as a functools.partial of its init_args), and `model.lr_scheduler`
any callable `optimizer -> LRScheduler`. The model calls each with what only it knows, where the callable takes it and
the config left it unset (None): the optimizer's `fused` or `foreach` kernels (model.levers.optimizer_impl), the
scheduler's `total_steps` and `steps_per_epoch` (the run's length).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_modules.schedules import WarmupCosine

# The recipe's default (model.optimizer: null, model.lr_scheduler: null): SGD with Nesterov momentum at 0.1 per 256
# images, then 1 warm-up epoch and a cosine decay.
DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
DEFAULT_LR_SCHEDULER = functools.partial(WarmupCosine, warmup_epochs=1.0)

# The learning rates an optimizer's param groups and a scheduler's state carry (OneCycleLR: max_lr and min_lr in the
# groups; CyclicLR: max_lrs; ReduceLROnPlateau: min_lrs; CosineAnnealingLR: eta_min), rescaled on a resume.
LR_KEYS = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min"})


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


def build_lr_scheduler(factory: Callable, optimizer: torch.optim.Optimizer, *, total_steps: int,
                       steps_per_epoch: int, multipliers: list[float]):
    """`factory(optimizer)`, given the run's length where it takes it; an absolute `max_lr` the config gave
    (OneCycleLR's) is per 256 images like the optimizer's lr: multiplied per group as the groups' lrs were."""
    extra = unset_arguments(factory, {"total_steps": total_steps, "steps_per_epoch": steps_per_epoch})
    max_lr = (getattr(factory, "keywords", None) or {}).get("max_lr")
    if max_lr is not None:
        peaks = max_lr if isinstance(max_lr, list | tuple) else [max_lr] * len(multipliers)
        extra["max_lr"] = [lr * m for lr, m in zip(peaks, multipliers, strict=True)]
    return factory(optimizer, **extra)


def replan_lr_scheduler(factory: Callable, optimizer: torch.optim.Optimizer, *, step: int, total_steps: int,
                        steps_per_epoch: int, multipliers: list[float]):
    """The scheduler a fit of `total_steps` would have at optimizer `step` had it been planned that long from the
    start: `factory` built anew for the new length and stepped `step` times (its lrs are those of that step). For a
    resume whose length differs from the checkpoint's, where the restored scheduler would keep the old length."""
    scheduler = build_lr_scheduler(factory, optimizer, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                   multipliers=multipliers)  # from the groups' initial_lr: their peaks
    with warnings.catch_warnings():  # stepped without an optimizer step, on purpose
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        for _ in range(step):
            scheduler.step()
    return scheduler


def resumed_length(trainer, steps_per_epoch: int) -> int | None:
    """The optimizer steps a resumed fit will have taken at its end, once its checkpoint and data position are
    restored (the model's on_train_start): those taken, the rest of the epoch in progress (all of it where the epoch
    restarts on another world size) and `steps_per_epoch` for each later epoch; None for a run set by max_steps alone.
    Lightning's estimate, max_epochs x the steps of an epoch now, is wrong once an epoch's steps changed (another batch
    size or world size): the schedule would end early and train the last epochs at lr 0, or end above it."""
    loop, max_epochs = trainer.fit_loop, trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or not math.isfinite(trainer.num_training_batches):
        return None
    epochs = loop.epoch_progress.current
    if epochs.started > epochs.processed:  # saved inside an epoch, which goes on from the batches it has done
        done = loop.epoch_loop.batch_progress.current.processed  # an optimizer step each `accumulate` and at the end
        this = steps_per_epoch - done // trainer.accumulate_grad_batches if done < trainer.num_training_batches else 0
    else:
        this = steps_per_epoch
    later = max(0, max_epochs - trainer.current_epoch - 1) * steps_per_epoch
    total = trainer.global_step + (this + later if trainer.current_epoch < max_epochs else 0)
    return max(1, min(total, trainer.max_steps) if trainer.max_steps >= 0 else total)


def rescale_learning_rates(checkpoint: dict, factor: float) -> None:
    """Multiply every learning rate a checkpoint's optimizer and scheduler states carry by `factor`, in place: each
    of LR_KEYS in the param groups and the scheduler states, nested schedulers (SequentialLR's) included."""
    for state in checkpoint.get("optimizer_states", []):
        for group in state["param_groups"]:
            _rescale(group, factor)
    for state in checkpoint.get("lr_schedulers", []):
        _rescale(state, factor)


def _rescale(state: dict, factor: float) -> None:
    for key, value in state.items():
        if key in LR_KEYS and isinstance(value, int | float | torch.Tensor) and not isinstance(value, bool):
            state[key] = value * factor
        elif key in LR_KEYS and isinstance(value, list | tuple):
            state[key] = type(value)(v * factor for v in value)
        elif key == "_schedulers":  # SequentialLR, ChainedScheduler: their schedulers' states
            for inner in value:
                _rescale(inner, factor)
