"""The classifier's loss: any `nn.Module` named by `model.loss` (a `class_path` in YAML), e.g.

    model:
      loss:
        class_path: torch.nn.CrossEntropyLoss       # the default
        init_args: {label_smoothing: 0.1}

The contract, which torch's `CrossEntropyLoss` and `BinaryCrossEntropy` below meet, and a user's loss must:

    loss(logits, target) -> scalar tensor
        logits: (B, C) float, the network's outputs;
        target: (B,) int64 class indices (validation, test, and training without mixing), or (B, C) float rows that
                sum to 1 (training batches mixed by mixup or CutMix), or, for multi-label data, (B, C) float 0/1 rows.

The same loss gives train/loss, val/loss and test/loss. A loss that handles only class indices works as long as mixup
and CutMix are off (the model then never hands it soft rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.config_types import UnitIntervalRightOpen, check_arguments


class BinaryCrossEntropy(nn.Module):
    """A binary cross-entropy per class, on one-hot, mixed or multi-hot targets, as in timm's ResNet strikes back.

    Args:
        label_smoothing: targets become target * (1 - s) + s / C, as `cross_entropy`'s smoothing spreads them.
        target_threshold: after smoothing, targets above it become 1 and the others 0 (0.2 in RSB A3, which so
            binarises the mixed targets); None keeps them soft.
    """

    def __init__(self, label_smoothing: UnitIntervalRightOpen = 0.0,
                 target_threshold: UnitIntervalRightOpen | None = None) -> None:
        check_arguments("model.loss", BinaryCrossEntropy.__init__, locals())  # the annotated ranges
        super().__init__()
        self.label_smoothing, self.target_threshold = label_smoothing, target_threshold

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        classes = logits.shape[1]
        target = F.one_hot(target, classes).to(logits.dtype) if target.ndim == 1 else target.to(logits.dtype)
        if self.label_smoothing:
            target = target * (1 - self.label_smoothing) + self.label_smoothing / classes
        if self.target_threshold is not None:
            target = (target > self.target_threshold).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, target)


def criterion(loss: nn.Module | None, multilabel: bool) -> tuple[nn.Module, str | None]:
    """`model.loss` as the model uses it (None: torch's CrossEntropyLoss). On multi-label data a softmax cross-entropy
    becomes a binary cross-entropy per class with the same smoothing, and the reason is returned to be said; any other
    loss is the user's choice."""
    loss = nn.CrossEntropyLoss() if loss is None else loss
    if multilabel and isinstance(loss, nn.CrossEntropyLoss):
        smoothing = loss.label_smoothing
        return BinaryCrossEntropy(label_smoothing=smoothing), (
            "model.loss: CrossEntropyLoss scores one class per image, and the data is multi-label (labels.csv): "
            f"lightning_modules.losses.BinaryCrossEntropy(label_smoothing={smoothing}) instead")
    return loss, None
