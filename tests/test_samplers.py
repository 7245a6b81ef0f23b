"""Training samplers: repeated augmentation's copies, ranks and epochs."""

from __future__ import annotations

from collections import Counter

import pytest

from datamodules import ImageFolderDataModule
from datamodules.samplers import RepeatedAugmentationSampler
from tests.helpers import make_image_folder


def _epoch(n: int, world: int, repeats: int, epoch: int) -> list[list[int]]:
    ranks = [RepeatedAugmentationSampler(range(n), world, r, repeats=repeats, seed=7) for r in range(world)]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in ranks]


@pytest.mark.parametrize(("n", "world", "repeats"), [(96, 4, 3), (50, 3, 3), (40, 8, 2), (30, 1, 3)])
def test_each_drawn_image_comes_repeats_times_its_copies_on_different_ranks(n, world, repeats):
    per_rank = _epoch(n, world, repeats, epoch=0)
    assert [len(r) for r in per_rank] == [-(-n // world)] * world  # an epoch keeps its length
    counts = Counter(i for rank in per_rank for i in rank)
    assert len(counts) >= n // repeats  # a 1/repeats share of the images...
    assert sorted(set(counts.values()))[-1] == repeats  # ...each `repeats` times (the last one maybe cut short)
    assert sum(c != repeats for c in counts.values()) <= 1
    if world >= repeats:  # copies of one image on `repeats` different ranks
        where = {i: {r for r, rank in enumerate(per_rank) if i in rank} for i, c in counts.items() if c == repeats}
        assert all(len(ranks) == repeats for ranks in where.values())


def test_the_order_is_a_function_of_seed_and_epoch():
    assert _epoch(60, 2, 3, epoch=1) == _epoch(60, 2, 3, epoch=1)
    assert _epoch(60, 2, 3, epoch=1) != _epoch(60, 2, 3, epoch=2)
    seen = set()
    for epoch in range(6):  # each epoch draws its own third of the images
        seen.update(i for rank in _epoch(60, 2, 3, epoch) for i in rank)
    assert len(seen) >= 50


def test_the_datamodule_draws_repeated_images_in_its_training_loader(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 6, "b": 6}, size=32)
    data = ImageFolderDataModule(root=str(root), batch_size=12, num_workers=0, image_size=32, preset="none",
                                 repeated_augmentation=3)
    data.setup("fit")
    loader = data.train_dataloader()
    assert isinstance(loader.sampler, RepeatedAugmentationSampler)
    x, _ = next(iter(loader))
    assert x.shape[0] == 12  # an epoch's worth of draws: 4 images, 3 times each
    assert sorted(Counter(tuple(img.flatten()[:64].tolist()) for img in x).values()) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="data.repeated_augmentation=0 must be at least 1"):
        ImageFolderDataModule(root=str(root), repeated_augmentation=0)
