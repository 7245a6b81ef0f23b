"""Mixup and CutMix of training batches."""

from __future__ import annotations

from torchvision.transforms import v2


def batch_mix(num_classes: int, mixup_alpha: float, cutmix_alpha: float) -> v2.Transform | None:
    """(images (B, C, H, W), labels (B,)) -> (mixed images, soft labels (B, num_classes)): mixup, CutMix or either.

    torchvision's v2.MixUp and v2.CutMix draw from torch's global generator, which the run seeds per batch
    (ExactResume), so a resumed run mixes its batches exactly as the uninterrupted one.
    """
    mixes = []
    if mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
