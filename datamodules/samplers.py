"""Training samplers that Lightning leaves in place under DDP (they are DistributedSamplers): repeated augmentation
and class-balanced sampling, and the wrapper that gives each draw the seed of its augmentation."""

from __future__ import annotations

import gc
import math
import os
import signal

import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import Dataset, DistributedSampler

from core.seeding import draw_seed


def refuse_balanced_multilabel(sampler: str, multilabel: bool, data: str) -> None:
    """The one refusal of class-balanced sampling on multi-label data (`data` names it in the message)."""
    if sampler == "balanced" and multilabel:
        raise ValueError(f"data.sampler=balanced weights each image by its class, and {data} is multi-label; use "
                         "data.sampler: random")


class RepeatedAugmentationSampler(DistributedSampler):
    """Repeated augmentation (Hoffer et al. 2019; DeiT and torchvision's V2 recipe): each image of an epoch is drawn
    `repeats` times, and its copies go to different ranks, where each is augmented differently.

    Every epoch a permutation seeded by (seed, epoch) is repeated element-wise (a a a b b b ...) and dealt to the
    ranks in turn, so the copies of one image land on `repeats` different ranks (all on one rank when there is only
    one). An epoch keeps its length, ceil(images / ranks) per rank: it holds a `1 / repeats` share of the images,
    each `repeats` times, and the next epochs draw the others. The order is a function of (seed, epoch) alone, so a
    resumed loader (torchdata's StatefulDataLoader) replays it exactly.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, *, repeats: int = 3, seed: int = 0) -> None:
        if repeats < 1:
            raise ValueError(f"data.repeated_augmentation={repeats} must be at least 1 (1 is off)")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.repeats = repeats
        self.num_samples = math.ceil(len(dataset) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        repeated = order.repeat_interleave(self.repeats)  # (len * repeats,): a a a b b b ...
        if len(repeated) < self.total_size:  # fewer images than ranks: wrap around, as DistributedSampler pads
            repeated = repeated.repeat(math.ceil(self.total_size / len(repeated)))
        return iter(repeated[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class BalancedSampler(DistributedSampler):
    """Class-balanced sampling across all ranks: each epoch draws as many samples as the dataset holds, with
    replacement, each sample weighted by its class's frequency to the power -`power` (1: every class equally often;
    0.5: halfway, as in the square-root sampling of long-tailed recognition; 0: uniform).

    The draw is seeded by (seed, epoch) and each rank takes every world-th position of it: disjoint shares of one
    draw, so the classes are balanced over the global batch, and a resumed loader replays the epoch exactly.
    """

    def __init__(self, targets: np.ndarray, num_replicas: int, rank: int, *, power: float = 1.0, seed: int = 0) -> None:
        if power < 0:
            raise ValueError(f"data.balance_power={power} must be >= 0 (0 is uniform sampling, 1 balances the classes)")
        super().__init__(range(len(targets)), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        counts = np.bincount(targets)
        per_class = np.where(counts > 0, counts.astype(np.float64), np.inf) ** -power
        self.weights = torch.from_numpy(per_class[targets])  # (N,): a sample's chance, up to normalisation
        self.class_share = per_class * counts / (per_class * counts).sum()  # expected share of each class in a draw
        self.num_samples = math.ceil(len(targets) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(self.weights, self.total_size, replacement=True, generator=generator)
        return iter(draw[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class SeededDraws(DistributedSampler):
    """A training sampler's draws as (index, seed) pairs, the seed a function of (seed, epoch, rank, position): the
    dataset seeds that sample's augmentation (crop, flip, policy, erasing) with it.

    So a sample's augmentation depends on nothing but its draw. A resumed loader skips the draws its checkpoint had
    yielded and draws each later one exactly as the uninterrupted run did, in loader workers (whose own random state
    restarts on a resume) as in the main process; the copies of an image under repeated augmentation still differ
    (other positions). It is a DistributedSampler, so Lightning keeps it under DDP and sets its epoch.
    """

    def __init__(self, inner: DistributedSampler) -> None:  # no super().__init__: the inner sampler did that work
        self.inner = inner
        for name in ("dataset", "num_replicas", "rank", "seed", "shuffle", "drop_last", "num_samples", "total_size",
                     "epoch"):
            setattr(self, name, getattr(inner, name))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for position, index in enumerate(self.inner):
            yield index, draw_seed(self.seed, self.epoch, self.rank, position)

    def __len__(self) -> int:
        return len(self.inner)


def worker_init(worker_id: int, rank: int) -> None:
    """Start of each loader worker: leave Ctrl-C to the trainer process, freeze the heap it inherited from it, then
    seed it as Lightning does (Lightning adds its own seeding only to loaders that have no worker_init_fn).

    A terminal's Ctrl-C reaches every process of the job. A worker that took it would exit, and the trainer's next
    batch would fail ("DataLoader worker exited unexpectedly") before the checkpoint that its first Ctrl-C asks for
    (training.resume.Preemption); the workers end with the trainer process, as on any exit.

    A garbage collection in a forked worker writes to every object of the parent's heap (imports, the model's
    Python objects) and so copies those pages into the worker (measured in benchmarks/worker_memory.py;
    docs/PERFORMANCE.md, "Loader-worker memory"). Frozen objects are never collected, and the worker's own objects
    still are.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank=rank)
