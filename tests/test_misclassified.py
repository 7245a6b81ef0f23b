"""The misclassified grid of the dashboards: the most confident mistakes across every class, each captioned with its
classes and confidence (training.records.plots, drawn by training.callbacks.ValidationFigures)."""

from __future__ import annotations

import numpy as np
import torch

from training.records.plots import ConfidentMistakes, misclassified_grid


def batches(seed: int, count: int, size: int = 32, classes: int = 10):
    """Random logits and targets in `count` batches, images tagged by their position in the data (pixel [0, 0, 0])."""
    gen = torch.Generator().manual_seed(seed)
    for b in range(count):
        logits = torch.randn(size, classes, generator=gen) * 3
        targets = torch.randint(0, classes, (size,), generator=gen)
        images = torch.zeros(size, 3, 4, 4)
        images[:, 0, 0, 0] = torch.arange(b * size, (b + 1) * size, dtype=torch.float32)
        yield images, targets, logits


def test_the_grid_keeps_the_most_confident_mistakes_of_all_batches_most_confident_first():
    kept = ConfidentMistakes(16)
    everything = []
    for images, targets, logits in batches(0, 8):
        kept.update(images, targets, logits)
        confidence, predicted = logits.softmax(dim=1).max(dim=1)
        everything += [(float(c), int(i[0, 0, 0]), int(t), int(p))
                       for i, t, p, c in zip(images, targets, predicted, confidence, strict=True) if p != t]
    expected = sorted(everything, key=lambda m: -m[0])[:16]
    chosen = [(m.confidence, int(m.image[0, 0, 0]), m.true, m.predicted) for m in kept.kept]
    assert [c[1:] for c in chosen] == [e[1:] for e in expected]
    assert [c[0] for c in chosen] == [e[0] for e in expected]
    # Not the first mistakes in the data's order (what the grid showed before: 16 of one class on sorted data),
    # and from several classes and batches.
    first = [e[1] for e in everything[:16]]
    assert [c[1] for c in chosen] != first
    assert len({c[2] for c in chosen}) > 3 and len({c[1] // 32 for c in chosen}) > 3


def test_on_data_sorted_by_class_the_grid_shows_the_surest_mistakes_whatever_their_class():
    """Validation data listed class by class, two mistakes in each class, surer on the later classes: the grid holds
    the mistakes of the eight surest classes, not the first mistakes found."""
    kept = ConfidentMistakes(16)
    for true in range(10):
        targets = torch.full((20,), true)
        logits = torch.zeros(20, 10)
        logits[:, true] = 4.0
        logits[:2, true], logits[:2, (true + 1) % 10] = 0.0, 1.0 + true  # two wrong ones, surer for later classes
        kept.update(torch.zeros(20, 3, 4, 4), targets, logits)
    assert sorted(m.true for m in kept.kept) == sorted(2 * list(range(2, 10)))
    assert all(m.predicted == (m.true + 1) % 10 for m in kept.kept)
    assert [m.true for m in kept.kept][::2] == list(range(9, 1, -1))  # most confident first


def test_right_predictions_and_ties_keep_the_first_seen():
    kept = ConfidentMistakes(2)
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [0.0, 5.0], [5.0, 0.0]])
    kept.update(torch.arange(4.0).view(4, 1, 1, 1).expand(4, 3, 1, 1), torch.tensor([0, 0, 0, 1]), logits)
    assert [int(m.image[0, 0, 0]) for m in kept.kept] == [1, 2]  # the right one (0) left out, ties in data order
    kept.update(torch.full((1, 3, 1, 1), 9.0), torch.tensor([0]), torch.tensor([[0.0, 5.0]]))
    assert [int(m.image[0, 0, 0]) for m in kept.kept] == [1, 2]  # a later tie does not displace them


def test_each_tile_is_captioned_and_the_grid_has_a_row_per_four():
    kept = ConfidentMistakes(5)
    for images, targets, logits in batches(1, 2):
        kept.update(images, targets, logits)
    grid = misclassified_grid(kept.kept, [f"c{k}" for k in range(10)], tile=128)
    assert grid.shape == (2 * (128 + 34), 4 * 128, 3) and grid.dtype == np.uint8
    captions = grid[: 34, :128]
    assert (captions[..., 0] > 150).any() and ((captions[..., 0] < 150) & (captions[..., 1] < 150)).any()
