"""The data-source contract: what every DataModule the CLI trains from provides, and the machinery built on it.

    imgcls fit --config configs/quickstart.yaml --data.class_path my_package.MyData --data.my_option 3

A data source is a subclass of `ClassificationData` (docs/EXTENDING.md, "Data source", has an example). The shipped
ones: `ImageFolderDataModule` (the default), `CsvDataModule`, `HFDataModule` and `ShardsDataModule`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from core import hardware
from core.config_types import NonNegativeFloat, NonNegativeInt, PositiveInt, check_arguments, instantiate
from core.seeding import run_seed
from datamodules.datasets import SeededImages, SeededItems, collate_images
from datamodules.device_batches import DeviceBatches
from datamodules.samplers import (
    BalancedSampler,
    RepeatedAugmentationSampler,
    SeededDraws,
    refuse_balanced_multilabel,
    worker_init,
)

log = logging.getLogger(__name__)

Sampling = Literal["random", "balanced"]  # data.sampler


def check_fields(data) -> None:
    """The annotated ranges and choices of every dataclass field of `data`, checked by the class that declares it."""
    for cls in reversed(type(data).__mro__):
        if "__dataclass_fields__" in vars(cls):
            own = set(vars(cls).get("__annotations__", {}))
            check_arguments("data", cls, {f.name: getattr(data, f.name) for f in fields(cls) if f.name in own})


@dataclass(eq=False, repr=False, kw_only=True)
class ClassificationData(L.LightningDataModule):
    """Labelled images for `ImageClassifier`; ``--data.help datamodules.NAME`` lists the arguments of source NAME.

    The shipped sources: ImageFolderDataModule (the default), CsvDataModule, HFDataModule and ShardsDataModule.
    Subclass it, and ``--data.class_path your_module.YourData`` plugs yours in.

    What a subclass provides:

    - in ``__init__``, after ``super().__init__(...)`` (or, a dataclass as the shipped sources are, in
      ``__post_init__`` after the base's; the CLI links these into the model before either is built, so they must be
      cheap: a listing, no decoding):
      ``class_names``, the class names in target-index order (None only for ``predict`` from a checkpoint, which
      carries them); ``multilabel``, True when each target is a multi-hot row (default False); and, where the
      source preprocesses images itself, the ``input_contract`` property (`datamodules.transforms.contract_of`:
      the evaluation preprocessing, which the model keeps in its checkpoints; default None);
    - in ``setup(stage)``, the map-style datasets the loaders read: ``train_set`` and ``val_set`` (fit, validate),
      ``test_set`` (test), ``predict_set`` (predict). Each yields ``(image, target)``: a (3, H, W) float tensor, or
      uint8 (converted on the device by ``device_batches``: scaled to [0, 1], and for the image sources normalised
      with the evaluation transform's mean and std); a class index, or a float multi-hot row of ``num_classes``.
      ``predict_set`` yields ``(image, index)`` and has ``paths`` (a name per index, written in predictions.csv).
      ``train_set.targets`` (one class index per sample) is needed by ``sampler: balanced``.

    What this class does with them:

    - exact resume: the training sampler (a `DistributedSampler`, also on one process, wrapped in `SeededDraws`)
      yields ``(index, seed)`` pairs, the seed a function of (run seed, epoch, rank, position). A `SeededImages`
      dataset applies its transform under that seed; any other training set is wrapped in `SeededItems`, which
      draws each item with torch's generator seeded by it (its random transforms must draw from torch's generator,
      as torchvision's do). So a resumed run draws every augmentation the uninterrupted run drew. The loader is a
      torchdata `StatefulDataLoader`, whose position Lightning checkpoints;
    - loaders, with workers chosen from the hardware (``num_workers: null``), and under DDP validation and test
      samplers that give each image to exactly one rank;
    - batches: ``(x, y, *seeds)``: images (B, 3, H, W), targets (B,) int64 or (B, C) float, and with
      ``augment_on_device`` the training draws' seeds (B,) int64. ``on_after_batch_transfer`` hands the model
      ``(x, y)``, float and normalised (`DeviceBatches`, held as ``device_batches``);
    - ``state_dict``: the count of training batches this run has transferred (the seed of a batch that comes
      without per-draw seeds), restored on resume.
    """

    batch_size: PositiveInt = 64
    """Images per device and step; the global batch is world size x batch_size x accumulation."""
    num_workers: NonNegativeInt | None = None
    """Loader processes per device; null chooses from the hardware (core/hardware.py): none on a CPU-trained model
    (decoded between steps), the node's CPUs shared by the GPUs (at most 8) on CUDA."""
    sampler: Sampling = "random"
    """``random`` (each training image once per epoch) or ``balanced``: as many draws as images, with replacement,
    weighted by class frequency ** -balance_power, shared out disjointly among the ranks."""
    balance_power: NonNegativeFloat = 1.0
    """1 draws every class equally often, 0.5 halfway (square-root sampling), 0 is uniform."""
    repeated_augmentation: PositiveInt = 1
    """Draw each training image this many times per draw, its copies on different ranks and augmented differently (3
    in torchvision's V2 recipe); an epoch keeps its length. 1 is off."""
    prefetch_factor: PositiveInt = 2
    """Batches each worker loads ahead."""
    persistent_workers: bool = True
    """Keep loader processes alive between epochs."""
    pin_memory: bool | None = None
    """Page-locked host memory for faster copies; null means "when training on CUDA"."""

    def __post_init__(self) -> None:
        check_fields(self)  # the annotated ranges and choices, the subclasses' fields too
        super().__init__()
        self.save_hyperparameters()  # every field; from the CLI, the config the source was built from
        # Paths saved as strings: checkpoints load weights_only, which refuses Paths.
        self.hparams.update({k: os.fspath(v) for k, v in self.hparams.items() if isinstance(v, os.PathLike)})
        # A plain int: jsonargparse passes PositiveInt, which the link into the model would put into its checkpoints.
        self.batch_size = int(self.batch_size)
        if self.sampler == "balanced" and self.repeated_augmentation > 1:
            raise ValueError("data.sampler=balanced and data.repeated_augmentation > 1 are two samplers; choose one")
        self.class_names: list[str] | None = None
        self.multilabel = False
        self.train_set = self.val_set = self.test_set = self.predict_set = None
        self.collate_fn = collate_images  # batch of (image, target) -> (x, y)
        self.device_batches = DeviceBatches()  # uint8 -> float in [0, 1]; no schedule; nothing augmented there
        self.training_batches = 0  # training batches transferred this run, kept in checkpoints

    @classmethod
    def from_config(cls, config: Mapping) -> ClassificationData:
        """The data source of a config's ``data`` section (class_path and init_args), built as the CLI builds it."""
        return instantiate(cls, config)

    @property
    def num_classes(self) -> int | None:
        return len(self.class_names) if self.class_names is not None else None

    @property
    def input_contract(self) -> dict | None:
        """The evaluation preprocessing a model trained on this data expects (`transforms.contract_of`),
        linked into the model; None where the source hands over images the model takes as they are."""
        return None

    # ---- loaders --------------------------------------------------------------------------------------------

    def loader_options(self, train: bool) -> dict:
        """The keyword arguments every loader of this DataModule shares: batch size, workers, pinning, collate."""
        trainer = self.trainer
        device = trainer.strategy.root_device.type if trainer is not None else "cpu"
        workers = self.num_workers
        if workers is None:
            workers, why = hardware.choose_num_workers(hardware.detect(), device,
                                                       trainer.num_devices if trainer is not None else 1)
            if train:  # once per run, not once per loader
                rank_zero_info(f"data.num_workers: {workers} per device ({why})")
        return dict(  # plain ints: the loaders keep them in their state, which checkpoints load weights_only
            batch_size=int(self.batch_size),
            num_workers=int(workers),
            pin_memory=device == "cuda" if self.pin_memory is None else self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            collate_fn=self.collate_fn,
            worker_init_fn=(functools.partial(worker_init, rank=trainer.global_rank if trainer else 0)
                            if workers else None),
        )

    def _loader(self, dataset: Dataset, *, train: bool, drop_last: bool = False, sampler=None) -> DataLoader:
        options = self.loader_options(train)
        # The training loader is a StatefulDataLoader: its position (sampler order and samples yielded) goes into
        # every checkpoint, so a mid-epoch resume neither repeats nor skips a sample of that epoch.
        loader_cls = StatefulDataLoader if train else DataLoader
        return loader_cls(dataset, shuffle=False, sampler=sampler, drop_last=drop_last,
                          persistent_workers=self.persistent_workers and options["num_workers"] > 0, **options)

    def train_sampler(self, dataset: Dataset, world: int, rank: int) -> DistributedSampler:
        """The training order: a DistributedSampler, also on one process, a function of (seed, epoch) alone.

        Lightning keeps a DistributedSampler in place under DDP and sets its epoch before each one. A shuffle drawn
        from a generator instead (torch's or torchdata's RandomSampler) depends on how many iterators were made
        before, and a resume that replays an epoch's end makes one more: it would skip a shuffle. The seed is
        Lightning's (seed_everything), as for the sampler Lightning would add itself.
        """
        seed = run_seed()
        if self.repeated_augmentation > 1:
            return RepeatedAugmentationSampler(dataset, world, rank, repeats=self.repeated_augmentation, seed=seed)
        if self.sampler == "balanced":
            targets = np.asarray(dataset.targets)
            refuse_balanced_multilabel(self.sampler, targets.ndim != 1, "this data")
            return BalancedSampler(targets, world, rank, power=self.balance_power, seed=seed)
        return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_set if isinstance(self.train_set, SeededImages) else SeededItems(self.train_set)
        # drop_last keeps every step's batch (and so BatchNorm statistics and the LR scale) the same size, where each
        # process's shard holds more than one batch: a small dataset over many processes would otherwise train on
        # nothing at all (Lightning's DistributedSampler hands each process ceil(images / processes)).
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        per_process = math.ceil(len(dataset) / world)
        if per_process < self.batch_size and (trainer is None or trainer.is_global_zero):
            log.warning(f"data: {len(dataset)} training images over {world} process(es) give {per_process} "
                        f"per process, fewer than data.batch_size={self.batch_size}: each step trains on "
                        f"{per_process} per process")
        sampler = SeededDraws(self.train_sampler(dataset, world, rank))  # each draw carries its augmentation's seed
        return self._loader(dataset, train=True, drop_last=per_process > self.batch_size, sampler=sampler)

    def _eval_sampler(self, dataset: Dataset) -> UnrepeatedDistributedSampler | None:
        # Under DDP, Lightning's DistributedSampler pads val/test with repeated images so that every rank gets as
        # many; this sampler gives each image to exactly one rank, so the torchmetrics-synced val/acc is exact.
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return None
        return UnrepeatedDistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                            shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False, sampler=self._eval_sampler(self.val_set))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False, sampler=self._eval_sampler(self.test_set))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, train=False)  # Lightning adds its unrepeated sampler under DDP

    # ---- batches on the device ----------------------------------------------------------------------------

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        x, y, *seeds = batch
        if isinstance(x, list):  # augment_on_device: the files stay in host memory, where nvJPEG reads them from
            return (x, y.to(device, non_blocking=True), *seeds)  # the seeds stay on the host: the CPU draws
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Images -> float32, normalized, on the device (`device_batches`); the targets or indices are kept."""
        trainer = self.trainer
        index = None
        if trainer is not None and trainer.training:  # the batch's index among the run's training batches
            index, self.training_batches = self.training_batches, self.training_batches + 1
        return self.device_batches.finish(batch, index=index, trainer=trainer)

    # ---- checkpointed state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"training_batches": self.training_batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.training_batches = int(state_dict.get("training_batches", 0))
