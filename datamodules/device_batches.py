"""What happens to a batch once it reaches the device: decoding and augmentation there (``augment_on_device``),
progressive resizing, and the uint8 -> float normalisation. A DataModule holds one (`ClassificationData.device_batches`)
and hands it each batch from ``on_after_batch_transfer``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms.v2 import functional as TF

from core.seeding import batch_seed, seeded_cpu_draws
from datamodules import presets
from datamodules.datasets import stack_images
from datamodules.decoding import decode_images


class DeviceBatches:
    """The device's part of the pipeline.

    Args:
        float_stage: uint8 (B, 3, H, W) -> float32, scaled and normalised (`presets.float_stage`); default:
            scaled to [0, 1] only.
        transforms: ``augment_on_device``: the uint8 training and evaluation transforms by "train" and "eval", run
            here on the files the workers read; None: the workers transform.
        schedule: progressive resizing, {epoch: side} sorted by epoch (`presets.check_schedule`), or None.
        train_size: the training transform's side, in force before the schedule's first entry (None: unstated).
    """

    def __init__(self, float_stage: Callable | None = None, *, transforms: dict[str, Callable] | None = None,
                 schedule: dict[int, int] | None = None, train_size: int | None = None) -> None:
        self.float_stage = float_stage if float_stage is not None else presets.float_stage(None, None)
        self.transforms, self.schedule, self.train_size = transforms, schedule, train_size

    def finish(self, batch: tuple, *, index: int | None, trainer) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the device -> (x, y), x float (float32, or the dtype of a true-precision run) and normalised.
        `index` is the batch's place among the run's training batches (None outside training): the seed of its draws
        when the batch carries none."""
        x, y, *seeds = batch
        train = index is not None
        if isinstance(x, list):
            # Each draw's own seed (SeededDraws), as the workers use it; else (a sampler of the user's) one per batch,
            # from the batch's index in the run, on a stream of its own.
            seed = (seeds[0].tolist() if seeds else batch_seed(index, trainer.global_rank, stream=1)) if train else None
            x = self.augment(x, y.device, train=train, seed=seed)
        if self.schedule and train:
            side = self.train_side(trainer.current_epoch)
            if side is not None and side != x.shape[-1]:
                x = TF.resize(x, [side, side], antialias=True)  # (B, 3, side, side), uint8 stays uint8
        if x.dtype == torch.uint8:
            x = self.float_stage(x)
            if trainer is not None:  # a true-precision run (bf16-true, 64-true) wants its own dtype: Lightning
                x = trainer.precision_plugin.convert_input(x)  # converted the batch before it was float
        return x, y

    def train_side(self, epoch: int) -> int | None:
        """The training image side at `epoch`: the schedule's entry in force, else train_size (None when the training
        transform states no size: the batch is left as it is)."""
        due = [e for e in self.schedule or {} if e <= epoch]
        return self.schedule[max(due)] if due else self.train_size

    def augment(self, items: list[torch.Tensor], device: torch.device | str, *, train: bool,
                seed: int | list[int] | None = None) -> torch.Tensor:
        """``augment_on_device``: files read by the workers -> a uint8 (B, 3, S, S) batch on `device`.

        The transforms run image by image (each draws its own crop); with `seed`, from the CPU's generator seeded for
        this batch, or with a list, for each image (the training draws' seeds: the crops the workers would have
        drawn), so that the draws do not depend on what else consumed random numbers before; the generator's state
        is restored after.
        """
        transform = self.transforms["train" if train else "eval"]
        images = decode_images(items, device)
        if seed is None:
            return stack_images([transform(image) for image in images])
        # The transforms draw their parameters from the CPU's generator alone: no other device's is reseeded (the
        # GPU's dropout stream is not the data's to set).
        if isinstance(seed, list):
            out = []
            for own, image in zip(seed, images, strict=True):
                with seeded_cpu_draws(own):
                    out.append(transform(image))
            return stack_images(out)
        with seeded_cpu_draws(seed):
            return stack_images([transform(image) for image in images])
