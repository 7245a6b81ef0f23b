"""Seeds of random draws as pure functions of where they happen in a run (run seed, batch or epoch, rank, position),
never of how many numbers were drawn before: a resumed run draws exactly what the uninterrupted one did."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def run_seed() -> int:
    """The run's seed: what Lightning's seed_everything exported (PL_GLOBAL_SEED), 0 without one."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def batch_seed(batch: int, rank: int, *, stream: int = 0, base: int | None = None) -> int:
    """A seed from (run seed, training batch index, rank, stream), so that random draws depend only on the batch: a
    resumed run draws what the uninterrupted one drew, and each micro-batch of an accumulated step draws its own.

    `batch` counts every training batch of the run (Lightning's batch progress, restored from checkpoints); `stream`
    keeps independent users (dropout, device augmentation) from drawing the same numbers; `base` defaults to the
    run's seed_everything seed.
    """
    base = run_seed() if base is None else base
    return (((base * 1_000_003 + batch) * 1_009 + rank) * 7 + stream) % (2**63)


def draw_seed(seed: int, epoch: int, rank: int, position: int) -> int:
    """The seed of one training draw: a function of (run seed, epoch, rank, its position in the rank's epoch)."""
    return (((seed * 1_000_003 + epoch) * 1_009 + rank) * 2_000_003 + position) % (2**63)


@contextmanager
def seeded_cpu_draws(seed: int) -> Iterator[None]:
    """Inside the block, torch's CPU generator is seeded with `seed`; after it, its state is as before.

    What `torch.random.fork_rng(devices=[])` around `torch.manual_seed(seed)` does for the CPU, the only generator a
    per-sample transform draws from, without the latter's seeding of every other device type too (CUDA, XPU, MTIA:
    each queued lazily with a captured stack trace, the most of a sample's seeding cost; benchmarks/input_profile.py).
    """
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)
