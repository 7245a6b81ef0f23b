"""The LightningDataModule for folders of images: train/, val/ and optional test/, one sub-folder per class.

    imgcls fit --config configs/quickstart.yaml --data.root /path/to/images
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Literal

import numpy as np
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from core import hardware
from core.config_types import (
    ClosedUnitInterval,
    ImageSide,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveInt,
    check_arguments,
)
from datamodules.bad_images import ScanCache, bad_images_message, find_bad_images
from datamodules.datasets import (
    ImageFiles,
    PredictImages,
    collate_encoded,
    collate_images,
)
from datamodules.device_batches import DeviceBatches
from datamodules.images import (
    LABELS_CSV,
    is_multilabel,
    list_images,
    read_encoded,
    read_image,
)
from datamodules.presets import (
    AutoAugment,
    ClassificationPresetEval,
    ClassificationPresetTrain,
    Preset,
    check_fast_decode,
    check_schedule,
    float_transform,
    input_contract,
)
from datamodules.samplers import (
    BalancedSampler,
    RepeatedAugmentationSampler,
    SeededDraws,
    worker_init,
)
from datamodules.splits import hold_out, read_class_names, split_samples

log = logging.getLogger(__name__)


Sampling = Literal["random", "balanced"]  # data.sampler
DataFormat = Literal["folder", "litdata"]  # data.format


class ImageFolderDataModule(DeviceBatches):
    """Image-folder data with ImageFolder semantics (classes are the sorted sub-folder names), or multi-label data.

    Multi-label: each split folder holds its images (in any sub-folders) and ``labels.csv`` with the columns
    ``path`` (relative to the split folder) and ``labels`` (separated by spaces or ``|``; empty for none). The
    classes are the labels that ``train/labels.csv`` uses, sorted, and each target is a multi-hot row. The model
    then has sigmoid outputs and a binary cross-entropy per class (linked by the CLI as ``model.multilabel``).

    Args:
        root: folder holding ``train/``, ``val/`` (optional: else ``val_split`` of train) and ``test/`` (optional).
            May be null for ``predict`` from a checkpoint, which carries the class names.
        format: ``folder`` (image files) or ``litdata``: root is then a folder or an ``s3://`` URL of the LitData
            shards that ``imgcls prepare-data`` wrote, streamed by LitData (datamodules/shards.py); the splits, class
            names and bad-file scan come from that conversion, and the sampler is LitData's shuffle.
        batch_size: images per device and step; the global batch is world size x batch_size x accumulation.
        num_workers: loader processes per device; null chooses from the hardware (core/hardware.py): one
            on a CPU-trained model, the node's CPUs shared by the GPUs (at most 8) on CUDA.
        val_split: fraction of ``train/`` held out, seeded (and stratified by class, single-label), when there is no
            ``val/``.
        split_seed: seed of that split; the same split on every process and every run.
        preset: transform preset, one of ``imagenet``, ``keras``, ``none``.
        image_size: side of the square image fed to the network.
        train_image_size: side of the training crops, null = image_size. Smaller than eval_image_size is FixRes
            (torchvision's V2 recipe trains at 176 and evaluates at 224): the random crops enlarge objects, and
            evaluating larger makes up for it.
        eval_image_size: side of the validation, test and prediction images, null = image_size.
        eval_resize_size: preset ``imagenet``: the short side those images are resized to before their center crop
            of eval_image_size; null = eval_image_size / 0.875 (256 for 224). torchvision's V2 recipe: 232.
        progressive_resizing: epoch -> training image side from that epoch on, e.g. ``{0: 128, 6: 160, 12: 176}``
            (progressive resizing, as in FFCV and Composer: small, fast images early, full size late). The loaders
            keep producing train_image_size crops; each training batch is resized on the device, before
            normalisation. Validation keeps eval_image_size. null is off.
        auto_augment: automatic augmentation policy of the training images (torchvision v2, on uint8): ``none``,
            ``trivialaugment`` (TrivialAugmentWide, torchvision's V2 recipe), ``randaugment``, ``autoaugment``
            (ImageNet policy) or ``augmix``.
        auto_augment_magnitude: the policy's strength, null = torchvision's default: RandAugment magnitude (9),
            AugMix severity (3), TrivialAugmentWide's number of magnitude bins (31).
        random_erasing: probability of erasing a random box of each training image (0.1 in torchvision's V2 recipe),
            filled with the pixel that normalises to zero.
        repeated_augmentation: draw each training image this many times per draw, its copies on different ranks
            and augmented differently (3 in torchvision's V2 recipe); an epoch keeps its length. 1 is off.
        sampler: ``random`` (each training image once per epoch) or ``balanced``: as many draws as images, with
            replacement, weighted by class frequency ** -balance_power, shared out disjointly among the ranks.
        balance_power: 1 draws every class equally often, 0.5 halfway (square-root sampling), 0 is uniform.
        prefetch_factor: batches each worker loads ahead.
        persistent_workers: keep loader processes alive between epochs.
        pin_memory: page-locked host memory for faster copies; null means "when training on CUDA".
        predict_dir: folder of images (nested folders allowed) for ``imgcls predict``.
        normalize_on_device: workers yield uint8 batches and the float conversion and normalization run after the
            copy to the device (same values, 4x fewer bytes moved); false yields float batches from the workers.
        augment_on_device: workers only read the files; JPEG decoding (nvJPEG on CUDA, one call per batch), the
            preset's augmentation and the normalization run on the device, image by image, in the main process.
            For when the CPU cores cannot feed the GPUs; on a CPU-only machine it only moves the work around.
        fast_decode: training JPEGs (imagenet preset) are decoded by libjpeg-turbo's fast path: fast integer IDCT
            and chroma upsampling, and at 1/2, 1/4 or 1/8 scale when the random crop is that many times larger than
            image_size. Less CPU per image (benchmarks/input_pipeline.py); pixels differ from the exact decode by
            about one level in 255 on average. Validation, test and prediction images are always decoded exactly.
        bad_images: what to do with files that cannot be decoded, found by a scan at setup: ``raise`` (list them
            all and stop before training) or ``skip`` (log them and train on the rest).
        scan_cache: keep that scan's verdicts, keyed by path, size and mtime, in ``.imgcls-scan-cache-*.npz`` beside
            the images (in ``~/.cache/imgcls/scan`` when their folder is read-only): a later start decodes only the
            files added or changed since. false decodes every image at every start.
    """

    def __init__(
        self,
        root: str | None = "data/digits",
        format: DataFormat = "folder",
        batch_size: PositiveInt = 64,
        num_workers: NonNegativeInt | None = None,
        val_split: OpenUnitInterval = 0.1,
        split_seed: int = 0,
        preset: Preset = "imagenet",
        image_size: ImageSide = 224,
        train_image_size: ImageSide | None = None,
        eval_image_size: ImageSide | None = None,
        eval_resize_size: ImageSide | None = None,
        progressive_resizing: dict[int, int] | None = None,
        auto_augment: AutoAugment = "none",
        auto_augment_magnitude: int | None = None,
        random_erasing: ClosedUnitInterval = 0.0,
        repeated_augmentation: PositiveInt = 1,
        sampler: Sampling = "random",
        balance_power: NonNegativeFloat = 1.0,
        prefetch_factor: PositiveInt = 2,
        persistent_workers: bool = True,
        pin_memory: bool | None = None,
        predict_dir: str | None = None,
        normalize_on_device: bool = True,
        augment_on_device: bool = False,
        fast_decode: bool = False,
        bad_images: Literal["raise", "skip"] = "raise",
        scan_cache: bool = True,
    ) -> None:
        check_arguments("data", ImageFolderDataModule.__init__, locals())  # the annotated ranges and choices
        super().__init__()
        check_fast_decode(preset, fast_decode)
        # Saved as strings: checkpoints load weights_only, which refuses Paths.
        root, predict_dir = (str(p) if isinstance(p, Path) else p for p in (root, predict_dir))
        self.save_hyperparameters()
        # A plain int: jsonargparse passes PositiveInt, which the link into the model would put into its checkpoints.
        self.format, self.batch_size, self.num_workers = format, int(batch_size), num_workers
        # A litdata root stays a string, which LitData reads as given: Path would fold s3:// into s3:/.
        self.root = (Path(root).expanduser() if format == "folder" else os.path.expanduser(root)) if root else None
        self.prefetch_factor, self.persistent_workers, self.pin_memory = prefetch_factor, persistent_workers, pin_memory
        self.val_split, self.split_seed = val_split, split_seed
        self.preset, self.image_size, self.eval_resize_size = preset, image_size, eval_resize_size
        self.train_image_size, self.eval_image_size = train_image_size or image_size, eval_image_size or image_size
        ClassificationPresetEval(preset=preset, image_size=self.eval_image_size, resize_size=eval_resize_size)  # checks
        self.progressive_resizing = check_schedule(progressive_resizing, self.train_image_size)
        self.augment = dict(auto_augment=auto_augment, auto_augment_magnitude=auto_augment_magnitude,
                            random_erasing=random_erasing)
        ClassificationPresetTrain(preset=preset, image_size=self.train_image_size, **self.augment)  # checks the keys
        self.predict_dir = Path(predict_dir).expanduser() if predict_dir is not None else None
        self.normalize_on_device, self.augment_on_device = normalize_on_device, augment_on_device
        self.fast_decode, self.bad_images, self.scan_cache = fast_decode, bad_images, scan_cache
        self._device_transforms: dict[str, object] = {}  # "train" | "eval" -> uint8 preset, for augment_on_device
        self.float_transform = float_transform(preset)  # uint8 (B, 3, H, W) -> float32 (B, 3, H, W)
        self.multilabel = isinstance(self.root, Path) and self.root.is_dir() and is_multilabel(self.root)
        self.sampling, self.balance_power, self.repeated_augmentation = sampler, balance_power, repeated_augmentation
        self._check_sampling()
        self.shard_counts: dict[str, int] | None = None  # data.format litdata: images per split of the shards
        # Class names are read now (a directory listing, cheap) so that the CLI can link them into the model.
        self.class_names: list[str] | None = self._read_class_names() if self.root is not None else None
        self.train_set = self.val_set = self.test_set = self.predict_set = None

    def _check_sampling(self) -> None:
        if self.sampling == "balanced" and self.repeated_augmentation > 1:
            raise ValueError("data.sampler=balanced and data.repeated_augmentation > 1 are two samplers; choose one")
        if self.format == "litdata" and (self.sampling == "balanced" or self.repeated_augmentation > 1):
            raise ValueError("data.format=litdata draws with LitData's shuffle: set data.sampler: random and "
                             "data.repeated_augmentation: 1")
        if self.multilabel and self.sampling == "balanced":
            raise ValueError(f"data.sampler=balanced weights each image by its class, and {self.root} is multi-label "
                             f"(train/{LABELS_CSV}); use data.sampler: random")

    @property
    def input_contract(self) -> dict:
        """The evaluation preprocessing, as values (`datamodules.presets.input_contract`): linked into the model, which
        keeps it in its checkpoints, so that a checkpoint evaluates and predicts as it was validated."""
        return input_contract(self.preset, self.eval_image_size, self.eval_resize_size)

    @property
    def num_classes(self) -> int | None:
        return len(self.class_names) if self.class_names is not None else None

    def _read_class_names(self) -> list[str]:
        if self.format == "litdata":  # what `imgcls prepare-data` wrote beside the shards
            from datamodules.shards import read_meta  # imports LitData, which the folder format does without

            meta = read_meta(self.root)
            self.multilabel, self.shard_counts = meta["multilabel"], meta["counts"]
            return meta["class_names"]
        return read_class_names(self.root, self.multilabel)

    # ---- datasets -------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        outputs_uint8 = self.normalize_on_device or self.augment_on_device
        train_tf = ClassificationPresetTrain(preset=self.preset, image_size=self.train_image_size,
                                             uint8_output=outputs_uint8, fast_decode=self.fast_decode, **self.augment)
        eval_tf = ClassificationPresetEval(preset=self.preset, image_size=self.eval_image_size,
                                           uint8_output=outputs_uint8, resize_size=self.eval_resize_size)
        # With fast_decode the training transform decodes each JPEG for its crop (reduced size when it can).
        read = read_image
        train_read = read_encoded if self.fast_decode else read_image
        if self.augment_on_device:  # the workers read; `augment_batch` decodes and transforms on the device
            self._device_transforms = {"train": train_tf, "eval": eval_tf}
            train_tf = eval_tf = None
            read = train_read = read_encoded
        if stage == "predict":
            if self.predict_dir is None:
                raise ValueError("data.predict_dir is not set; pass --data.predict_dir FOLDER_OF_IMAGES")
            if not self.predict_dir.is_dir():
                raise FileNotFoundError(f"data.predict_dir={self.predict_dir} is not a folder")
            paths = list_images(self.predict_dir)
            if not paths:
                raise FileNotFoundError(f"data.predict_dir={self.predict_dir} holds no images")
            (paths,) = self._drop_bad(paths, folder=self.predict_dir, scan="predict")
            self.predict_set = PredictImages(paths, eval_tf, read)
            return
        if self.root is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root FOLDER")
        if self.format == "litdata":  # splits made, and bad files left out, by `imgcls prepare-data`
            self._setup_shards(stage, train_tf, eval_tf, train_read is read_encoded, read is read_encoded)
            return
        if stage in ("fit", "validate") and self.train_set is None:  # built once: `fit` validates again at its end
            train, val = self._train_val_samples()
            train, val = self._drop_bad(train, val, folder=self.root, scan="train-val")  # one scan, one message
            self.train_set = ImageFiles(train, train_tf, train_read)
            self.val_set = ImageFiles(val, eval_tf, read)
        if stage == "test":
            test_dir = self.root / "test"
            if not test_dir.is_dir():
                raise FileNotFoundError(f"{test_dir} does not exist; `imgcls test` needs a test/ split")
            (test,) = self._drop_bad(self._split(test_dir), folder=self.root, scan="test")
            self.test_set = ImageFiles(test, eval_tf, read)

    def _setup_shards(self, stage: str, train_tf, eval_tf, train_encoded: bool, eval_encoded: bool) -> None:
        from datamodules.shards import ShardImages, split_dir, training_split

        if stage in ("fit", "validate") and self.train_set is None:
            self.train_set = training_split(self.root, train_tf, encoded=train_encoded,
                                            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), batch_size=self.batch_size,
                                            world_size=self.trainer.world_size if self.trainer else 1,
                                            count=self.shard_counts["train"])
            self.val_set = ShardImages(split_dir(self.root, "val"), eval_tf, encoded=eval_encoded)
        if stage == "test":
            if "test" not in self.shard_counts:
                raise FileNotFoundError(f"the shards at {self.root} have no test split; `imgcls test` needs one")
            self.test_set = ShardImages(split_dir(self.root, "test"), eval_tf, encoded=eval_encoded)

    def _drop_bad(self, *splits: list, folder: Path, scan: str) -> list[list]:
        """Scan the samples of `splits` (paths or (path, target) pairs, below `folder`) once, on rank 0; raise on bad
        files, listing every split's, or drop them. Returns the splits, filtered. `scan` names the cache's file."""
        paths = [s[0] if isinstance(s, tuple) else s for split in splits for s in split]
        trainer = self.trainer
        bad = None
        if trainer is None or trainer.is_global_zero:
            cache = ScanCache(folder, scan) if self.scan_cache else None
            bad = find_bad_images(paths, progress=True, cache=cache)
            if cache is not None:
                rank_zero_info(cache.summary())
        if trainer is not None and trainer.world_size > 1:
            bad = trainer.strategy.broadcast(bad, src=0)  # one scan per run; every rank decides alike
        if not bad:
            return list(splits)
        message = bad_images_message(bad, len(paths))
        if self.bad_images == "raise":
            raise ValueError(f"{message}\nremove or fix these files, or set data.bad_images: skip")
        if trainer is None or trainer.is_global_zero:
            log.warning(f"data.bad_images=skip: skipping {message}")
        dropped = {p for p, _ in bad}
        kept = [[s for s in split if (s[0] if isinstance(s, tuple) else s) not in dropped] for split in splits]
        if not all(kept):
            raise ValueError(f"no usable image is left in a split after skipping {len(bad)} bad files "
                             f"(first: {bad[0][0]})")
        return kept

    def split_samples(self) -> dict[str, list[tuple[str, int | np.ndarray]]]:
        """(path, target) pairs of train, val (its folder, or val_split of train) and test if present, as fit and
        test list them: what `imgcls prepare-data` converts."""
        train, val = self._train_val_samples()
        test = {"test": self._split(self.root / "test")} if (self.root / "test").is_dir() else {}
        return {"train": train, "val": val, **test}

    def _split(self, split_dir: Path) -> list[tuple[str, int | np.ndarray]]:
        return split_samples(split_dir, self.class_names, self.multilabel)

    def _train_val_samples(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        train = self._split(self.root / "train")
        if (self.root / "val").is_dir():
            return train, self._split(self.root / "val")
        return hold_out(train, self.val_split, self.split_seed, self.class_names, self.multilabel, self.root / "train")

    # ---- loaders --------------------------------------------------------------------------------------------

    def _loader(self, dataset: Dataset, *, shuffle: bool, drop_last: bool = False, sampler=None) -> DataLoader:
        trainer = self.trainer
        device = trainer.strategy.root_device.type if trainer is not None else "cpu"
        on_cuda = device == "cuda"
        workers = self.num_workers
        if workers is None:
            workers, why = hardware.choose_num_workers(hardware.detect(), device,
                                                       trainer.num_devices if trainer is not None else 1)
            if shuffle:  # once per run, not once per loader
                rank_zero_info(f"data.num_workers: {workers} per device ({why})")
        common = dict(  # plain ints: the loaders keep them in their state, which checkpoints load weights_only
            batch_size=int(self.batch_size),
            num_workers=int(workers),
            pin_memory=on_cuda if self.pin_memory is None else self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            collate_fn=collate_encoded if self.augment_on_device else collate_images,
            worker_init_fn=(functools.partial(worker_init, rank=trainer.global_rank if trainer else 0)
                            if workers else None),
        )
        if isinstance(dataset, IterableDataset):  # LitData shards: the dataset orders and shares out its samples
            from datamodules.shards import ShardLoader

            return ShardLoader(dataset, epoch=(lambda: trainer.current_epoch) if trainer and shuffle else None,
                               **common)
        # The training loader is a StatefulDataLoader: its position (sampler order and samples yielded) goes into
        # every checkpoint, so a mid-epoch resume neither repeats nor skips a sample of that epoch.
        loader_cls = StatefulDataLoader if shuffle else DataLoader
        if sampler is not None:
            shuffle = False  # the sampler orders the data
        return loader_cls(dataset, shuffle=shuffle, sampler=sampler, drop_last=drop_last,
                          persistent_workers=self.persistent_workers and workers > 0, **common)

    def train_dataloader(self) -> DataLoader:
        if self.format == "litdata":  # LitData shuffles, shares out and drops the last samples (shards.training_split)
            return self._loader(self.train_set, shuffle=True)
        # drop_last keeps every step's batch (and so BatchNorm statistics and the LR scale) the same size, where each
        # process's shard holds more than one batch: a small dataset over many processes would otherwise train on
        # nothing at all (Lightning's DistributedSampler hands each process ceil(images / processes)).
        world = self.trainer.world_size if self.trainer is not None else 1
        per_process = math.ceil(len(self.train_set) / world)
        if per_process < self.batch_size and (self.trainer is None or self.trainer.is_global_zero):
            log.warning(f"data: {len(self.train_set)} training images over {world} process(es) give {per_process} "
                        f"per process, fewer than data.batch_size={self.batch_size}: each step trains on "
                        f"{per_process} per process")
        rank = self.trainer.global_rank if self.trainer else 0
        # Every training sampler is a DistributedSampler, also on one process: its order is a function of (seed,
        # epoch) alone, and Lightning keeps it in place under DDP and sets its epoch before each one. A shuffle drawn
        # from a generator instead (torch's or torchdata's RandomSampler) depends on how many iterators were made
        # before, and a resume that replays an epoch's end makes one more than the run it continues: it would skip
        # a shuffle. The seed is Lightning's (seed_everything), as for the sampler Lightning would add itself.
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        if self.repeated_augmentation > 1:
            sampler = RepeatedAugmentationSampler(self.train_set, world, rank, repeats=self.repeated_augmentation,
                                                  seed=seed)
        elif self.sampling == "balanced":
            sampler = BalancedSampler(self.train_set.targets, world, rank, power=self.balance_power, seed=seed)
        else:
            sampler = DistributedSampler(self.train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler = SeededDraws(sampler)  # each draw carries the seed of its augmentation
        return self._loader(self.train_set, shuffle=True, drop_last=per_process > self.batch_size, sampler=sampler)

    def _eval_sampler(self, dataset: Dataset) -> UnrepeatedDistributedSampler | None:
        # Under DDP, Lightning's DistributedSampler pads val/test with repeated images so that every rank gets as
        # many; this sampler gives each image to exactly one rank, so the torchmetrics-synced val/acc is exact.
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1 or isinstance(dataset, IterableDataset):  # LitData shares out
            return None
        return UnrepeatedDistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                            shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, sampler=self._eval_sampler(self.val_set))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False, sampler=self._eval_sampler(self.test_set))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, shuffle=False)
