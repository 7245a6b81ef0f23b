"""What happens to a training or evaluation batch once it reaches the device: decoding and augmentation there
(``augment_on_device``), progressive resizing, and the uint8 -> float normalisation."""

from __future__ import annotations

import lightning as L
import torch
from torchvision.transforms.v2 import functional as TF

from core.seeding import batch_seed
from datamodules.datasets import stack_images
from datamodules.images import decode_images


class DeviceBatches(L.LightningDataModule):
    """The LightningDataModule hooks that finish a batch on the device. The subclass sets `float_transform`,
    `progressive_resizing` ({epoch: side} or None), `train_image_size`, `_device_transforms` ("train" | "eval" ->
    the uint8 transform, for augment_on_device) and `training_batches`, the count of training batches transferred so
    far (which it checkpoints): the index of the batch in hand, without asking the trainer's loops."""

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        x, y, *seeds = batch
        if isinstance(x, list):  # augment_on_device: the files stay in host memory, where nvJPEG reads them from
            return (x, y.to(device, non_blocking=True), *seeds)  # the seeds stay on the host: the CPU draws
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """uint8 images -> float32, normalized, on the device; the second element (targets or indices) is kept."""
        x, y, *seeds = batch
        trainer = self.trainer
        train = trainer is not None and trainer.training
        if train:
            index, self.training_batches = self.training_batches, self.training_batches + 1
        if isinstance(x, list):
            # Each draw's own seed (SeededDraws), as the workers use it; else (a sampler of the user's) one per batch,
            # from the batch's index in the run, on a stream of its own.
            seed = (seeds[0].tolist() if seeds else batch_seed(index, trainer.global_rank, stream=1)) if train else None
            x = self.augment_batch(x, y.device, train=train, seed=seed)
        if self.progressive_resizing and train:
            side = self.train_side(self.trainer.current_epoch)
            if side is not None and side != x.shape[-1]:
                x = TF.resize(x, [side, side], antialias=True)  # (B, 3, side, side), uint8 stays uint8
        if x.dtype == torch.uint8:
            x = self.float_transform(x)
        return x, y

    def train_side(self, epoch: int) -> int:
        """The training image side at `epoch`: the progressive_resizing entry in force, else train_image_size (None
        when the training transform states no size: the batch is left as it is)."""
        due = [e for e in self.progressive_resizing or {} if e <= epoch]
        return self.progressive_resizing[max(due)] if due else self.train_image_size

    def augment_batch(self, items: list[torch.Tensor], device: torch.device | str, *, train: bool,
                      seed: int | list[int] | None = None) -> torch.Tensor:
        """``augment_on_device``: files read by the workers -> a uint8 (B, 3, S, S) batch on `device`.

        The preset's transforms run image by image (each draws its own crop); with `seed`, from a generator forked
        for this batch, or with a list, one per image (the training draws' seeds: the crops the workers would have
        drawn), so that the draws do not depend on what else consumed random numbers before.
        """
        transform = self._device_transforms["train" if train else "eval"]
        images = decode_images(items, device)
        if seed is None:
            return stack_images([transform(image) for image in images])
        out = []
        with torch.random.fork_rng(devices=[]):  # the transforms draw their parameters on the CPU
            for i, image in enumerate(images):
                if isinstance(seed, list):
                    torch.manual_seed(seed[i])
                elif i == 0:
                    torch.manual_seed(seed)
                out.append(transform(image))
        return stack_images(out)
