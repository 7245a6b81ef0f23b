"""A researcher's own parts, outside the packages, plugged in by `class_path` alone (tests/test_seams.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FocalLoss(nn.Module):
    """Focal loss (Lin et al., 2017) on class indices or soft targets: cross-entropy weighted by (1 - p_t) ** gamma."""

    def __init__(self, gamma: float = 2.0) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=1)
        soft = F.one_hot(target, logits.shape[1]).float() if target.ndim == 1 else target.float()
        weight = (1 - log_p.exp()) ** self.gamma
        return -(soft * weight * log_p).sum(dim=1).mean()


class LinearDecay(torch.optim.lr_scheduler.LambdaLR):
    """From each group's lr down to 0 at the run's last step; `total_steps` comes from the model."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int | None = None) -> None:
        super().__init__(optimizer, lambda step: max(0.0, 1 - step / total_steps))
