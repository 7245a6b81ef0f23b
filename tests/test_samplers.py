"""Training samplers: repeated augmentation's copies, ranks and epochs; class-balanced draws; resumption."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchmetrics.functional.classification import multiclass_f1_score

from datamodules import ClassificationPresetTrain, ImageFolderDataModule
from datamodules.samplers import BalancedSampler, RepeatedAugmentationSampler
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
    assert isinstance(loader.sampler.inner, RepeatedAugmentationSampler)
    x, _ = next(iter(loader))
    assert x.shape[0] == 12  # an epoch's worth of draws: 4 images, 3 times each
    assert sorted(Counter(tuple(img.flatten()[:64].tolist()) for img in x).values()) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="data.repeated_augmentation=0 must be at least 1"):
        ImageFolderDataModule(root=str(root), repeated_augmentation=0)


def _imbalanced_targets() -> np.ndarray:
    return np.array([0] * 500 + [1] * 50 + [2] * 50)  # 10:1:1


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_balanced_draws_follow_the_class_weights_over_all_ranks(power):
    targets = _imbalanced_targets()
    ranks = [BalancedSampler(targets, 2, r, power=power, seed=3) for r in range(2)]
    drawn = np.concatenate([targets[list(s)] for s in ranks])
    seen = np.bincount(drawn, minlength=3) / len(drawn)
    expected = np.array([500, 50, 50]) ** (1 - power)
    assert np.allclose(seen, expected / expected.sum(), atol=0.04), seen
    assert np.allclose(ranks[0].class_share, expected / expected.sum())


def test_the_ranks_take_disjoint_shares_of_one_seeded_draw_per_epoch():
    targets = _imbalanced_targets()
    whole = BalancedSampler(targets, 1, 0, seed=3)
    ranks = [BalancedSampler(targets, 3, r, seed=3) for r in range(3)]
    for sampler in [whole, *ranks]:
        sampler.set_epoch(4)
    full = list(whole)
    assert [list(s) for s in ranks] == [full[r::3] for r in range(3)]  # position r, r+3, ...: one draw, dealt
    whole.set_epoch(5)
    assert list(whole) != full


def test_balanced_sampling_beats_uniform_macro_f1_on_balanced_held_out_data():
    """Two overlapping Gaussian classes, 10:1 in training: a classifier trained on uniform draws leans to the
    majority; balanced draws give the better macro-F1 on balanced held-out data."""
    rng = np.random.default_rng(0)

    def blobs(n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.concatenate([rng.normal(0.0, 1.0, (n0, 2)), rng.normal(1.5, 1.0, (n1, 2))]).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(np.array([0] * n0 + [1] * n1))

    x, y = blobs(2000, 200)
    x_test, y_test = blobs(1000, 1000)
    scores = {}
    for name, power in (("uniform", 0.0), ("balanced", 1.0)):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = BalancedSampler(y.numpy(), 1, 0, power=power)
        for epoch in range(5):
            sampler.set_epoch(epoch)
            for xb, yb in DataLoader(TensorDataset(x, y), batch_size=64, sampler=sampler):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
        scores[name] = float(multiclass_f1_score(model(x_test).argmax(1), y_test, 2, average="macro"))
    print("macro-F1 on balanced held-out data:", scores)
    assert scores["balanced"] > scores["uniform"] + 0.05, scores


@pytest.mark.parametrize("kind", ["balanced", "repeated"])
def test_a_resumed_loader_replays_the_rest_of_the_epoch_exactly(kind):
    """What ExactResume relies on: torchdata's StatefulDataLoader restores these samplers' position mid-epoch."""
    targets = _imbalanced_targets()
    data = TensorDataset(torch.arange(len(targets)))

    def loader():
        sampler = (BalancedSampler(targets, 2, 1, seed=9) if kind == "balanced"
                   else RepeatedAugmentationSampler(data, 2, 1, repeats=3, seed=9))
        sampler.set_epoch(2)
        return StatefulDataLoader(data, batch_size=16, sampler=sampler)

    uninterrupted = [b[0].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)[0].tolist() for _ in range(5)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b[0].tolist() for b in resumed] == uninterrupted


@pytest.mark.parametrize("workers", [0, 1])
def test_a_resumed_loader_augments_the_rest_of_the_epoch_exactly(tmp_path, workers):
    """Random crops, flips, TrivialAugment and erasing, drawn in the main process or a loader worker: a loader resumed
    mid-epoch from its state gives the batches of the uninterrupted one, pixel for pixel. Each draw's augmentation
    is seeded by its draw (SeededDraws); before, it came from the process's random state, which a resumed worker
    starts afresh (and which other draws had advanced in the main process)."""
    root = make_image_folder(tmp_path / "images", {"a": 12, "b": 12}, size=48)
    data = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=workers, image_size=32,
                                 preset="imagenet", train_transform=ClassificationPresetTrain(
                                     auto_augment="trivialaugment", random_erasing=0.5),
                                 repeated_augmentation=2, scan_cache=False, persistent_workers=False)
    data.setup("fit")

    def loader():
        made = data.train_dataloader()
        made.sampler.set_epoch(3)
        return made

    uninterrupted = [x for x, _ in loader()]
    assert len(uninterrupted) == 6
    assert not all(torch.equal(a, b) for a, b in zip(uninterrupted, uninterrupted[1:], strict=False))
    first = loader()
    it = iter(first)
    head = [next(it)[0] for _ in range(2)]
    state = first.state_dict()
    torch.manual_seed(12345)  # whatever the process drew meanwhile
    resumed = loader()
    resumed.load_state_dict(state)
    replayed = head + [x for x, _ in resumed]
    assert len(replayed) == len(uninterrupted)
    assert all(torch.equal(a, b) for a, b in zip(replayed, uninterrupted, strict=True))
    # the 2 copies of each image in an epoch are augmented differently (repeated augmentation's point)
    draws = list(loader().sampler)
    assert len({seed for _, seed in draws}) == len(draws)


def test_the_datamodule_builds_the_balanced_sampler_and_refuses_two_samplers(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 10, "b": 2}, size=32)
    data = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, sampler="balanced", balance_power=0.5)
    data.setup("fit")
    sampler = data.train_dataloader().sampler.inner
    assert isinstance(sampler, BalancedSampler)
    assert np.allclose(sampler.class_share, np.array([10, 2]) ** 0.5 / (10**0.5 + 2**0.5))
    with pytest.raises(ValueError, match="two samplers; choose one"):
        ImageFolderDataModule(root=str(root), sampler="balanced", repeated_augmentation=2)
    with pytest.raises(ValueError, match="data.sampler='weighted' is unknown"):
        ImageFolderDataModule(root=str(root), sampler="weighted")


def test_seeded_cpu_draws_draw_what_manual_seed_draws_and_leave_the_generator_as_it_was():
    from core.seeding import seeded_cpu_draws

    torch.manual_seed(7)
    expected = torch.rand(5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with seeded_cpu_draws(7):
        drawn = torch.rand(5)
    assert torch.equal(drawn, expected)
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(RuntimeError), seeded_cpu_draws(7):
        raise RuntimeError("a transform that fails")
    assert torch.equal(torch.get_rng_state(), before)  # restored on an error too
