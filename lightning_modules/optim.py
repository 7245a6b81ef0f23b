"""The optimizer the classifier names, and rescaling a checkpoint's learning rates to another global batch."""

from __future__ import annotations

import torch


def build_optimizer(name: str, groups: list[dict], *, momentum: float, nesterov: bool, impl: str
                    ) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov), AdamW (betas (momentum, 0.999)) or timm's LAMB over `groups`, each group's lr and
    weight decay its own; `impl` is default, foreach or fused (one kernel for every parameter)."""
    kernels = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=groups[0]["lr"], momentum=momentum, nesterov=nesterov, **kernels)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=groups[0]["lr"], betas=(momentum, 0.999), **kernels)
    try:  # LAMB: Adam's step scaled per layer by |w| / |step|; timm's, not torch's (which has none)
        from timm.optim import Lamb
    except ImportError:
        raise ImportError("model.optimizer=lamb is timm's LAMB: pip install 'imgcls[timm]'") from None
    return Lamb(groups, lr=groups[0]["lr"], betas=(momentum, 0.999), foreach=impl in ("foreach", "fused") or None)


def rescale_learning_rates(checkpoint: dict, factor: float) -> None:
    """Multiply the learning rates a checkpoint's optimizer and LambdaLR states carry by `factor`, in place."""
    for state in checkpoint.get("optimizer_states", []):
        for group in state["param_groups"]:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= factor
    for state in checkpoint.get("lr_schedulers", []):
        state["base_lrs"] = [lr * factor for lr in state.get("base_lrs", [])]
        state["_last_lr"] = [lr * factor for lr in state.get("_last_lr", [])]
