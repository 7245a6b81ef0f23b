"""What the classifier predicts per image: the rows of a predict batch."""

from __future__ import annotations

import torch


def predictions(logits: torch.Tensor, index: torch.Tensor, class_names: list[str], multilabel: bool) -> dict:
    """A predict batch's rows, on the CPU, with `index`, each image's place in the predict dataset (which maps back
    to its file): multi-label data's probabilities (PredictionWriter names every class at or above the threshold),
    else the top class, its name and confidence, and the top 5 classes and probabilities."""
    if multilabel:
        return {"index": index.cpu(), "probs": logits.sigmoid().cpu()}
    top = logits.softmax(dim=1).topk(min(5, logits.shape[1]), dim=1)  # (B, num_classes) -> (B, k)
    label = top.indices[:, 0]
    return {"index": index.cpu(), "label": label.cpu(), "class_name": [class_names[i] for i in label.tolist()],
            "confidence": top.values[:, 0].cpu(), "top5_labels": top.indices.cpu(), "top5_probs": top.values.cpu()}
