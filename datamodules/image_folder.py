"""The LightningDataModule for folders of images: train/, val/ and optional test/, one sub-folder per class.

    imgcls fit --config configs/quickstart.yaml --data.root /path/to/images
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, get_args

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.transforms.v2 import functional as TF

from datamodules import hardware
from datamodules.bad_images import ScanCache, bad_images_message, find_bad_images
from datamodules.images import (
    LABELS_CSV,
    decode_images,
    find_classes,
    is_multilabel,
    list_images,
    read_encoded,
    read_image,
    read_labels_csv,
    scan_split,
)
from datamodules.presets import (
    PRESETS,
    AutoAugment,
    ClassificationPresetEval,
    ClassificationPresetTrain,
    Preset,
    check_fast_decode,
    float_transform,
)
from datamodules.samplers import BalancedSampler, RepeatedAugmentationSampler, SeededDraws

log = logging.getLogger(__name__)


Sampling = Literal["random", "balanced"]  # data.sampler
DataFormat = Literal["folder", "litdata"]  # data.format


class _ArraySequence(Sequence):
    """A read-only sequence over numpy arrays: slices give lists, and it equals any sequence of the same items."""

    def _item(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        return self._item(range(len(self))[index])  # negative indices, numpy ints, IndexError past the end

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None


class PathArray(_ArraySequence):
    """Paths held as one uint8 array of their encoded bytes and an int64 array of offsets: two objects however many
    paths, so that loader workers reading them copy nothing. A list of str is copied into every forked worker as it
    is read, since reading writes each object's reference count (pytorch/pytorch#13246)."""

    def __init__(self, paths: Iterable[str]) -> None:
        encoded = [os.fsencode(p) for p in paths]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)  # path i is data[offsets[i]:offsets[i + 1]]
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _item(self, index: int) -> str:
        return os.fsdecode(self.data[self.offsets[index]:self.offsets[index + 1]].tobytes())


class Samples(_ArraySequence):
    """(path, class index) pairs, as torchvision's ImageFolder.samples, read from a PathArray and an int64 array."""

    def __init__(self, paths: PathArray, targets: np.ndarray) -> None:
        self.paths, self.targets = paths, targets

    def __len__(self) -> int:
        return len(self.targets)

    def _item(self, index: int) -> tuple[str, int | np.ndarray]:
        target = self.targets[index]
        return self.paths[index], target if target.ndim else int(target)


class ImageFiles(Dataset):
    """(image, target) pairs from (path, target) pairs, stored in numpy arrays (`paths`, `targets`). A target is a
    class index, or for multi-label data a multi-hot row of 0/1 per class (given as a numpy array), which the
    dataset returns as a float tensor.

    `read` decodes a path (`read_image`), or only reads it (`read_encoded`, for ``augment_on_device``); `transform`
    None leaves its result as it is.
    """

    def __init__(self, samples: Iterable[tuple[str, int | np.ndarray]], transform, read=read_image) -> None:
        samples = list(samples)
        self.paths = PathArray(p for p, _ in samples)
        if samples and isinstance(samples[0][1], np.ndarray):  # (N, C) uint8: 1 byte per label
            self.targets = np.stack([t for _, t in samples]).astype(np.uint8)
        else:
            self.targets = np.fromiter((t for _, t in samples), np.int64, len(samples))
        self.transform = transform
        self.read = read

    @property
    def samples(self) -> Samples:
        return Samples(self.paths, self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int | torch.Tensor]:
        """`item`: an index, or (index, seed) from the training sampler (SeededDraws): the transform's random draws
        then come from that seed alone, and the process's own random state is left as it was."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        target = self.targets[index]
        target = torch.from_numpy(target.astype(np.float32)) if target.ndim else int(target)
        if seed is None:
            return _load(self.read, self.transform, self.paths[index]), target
        if self.transform is None:  # augment_on_device: the seed travels with the file to `augment_batch`
            return _load(self.read, None, self.paths[index]), target, seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _load(self.read, self.transform, self.paths[index]), target


class PredictImages(ImageFiles):
    """(image, index) for unlabeled images; the index maps back to `paths` when predictions are written."""

    def __init__(self, paths: list[str], transform, read=read_image) -> None:
        super().__init__([(p, i) for i, p in enumerate(paths)], transform, read)


class UnreadableImageError(ValueError):
    """An image that could not be read during training (it broke after the start-of-fit scan)."""


def _load(read, transform, path: str):
    # A file that broke after the start-of-fit scan: name it, instead of a bare PIL error from a worker. The
    # transform is inside too: with data.fast_decode it decodes the JPEG.
    try:
        image = read(path)
        return transform(image) if transform is not None else image
    except Exception as err:
        raise UnreadableImageError(f"cannot read image {path}: {err}; remove or replace it (data.bad_images: skip "
                                   "drops unreadable files at the start of fit)") from err


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """(3, H, W) images -> a (B, 3, H, W) batch, channels_last when the images are stored HWC (interleaved).

    torch.stack would copy interleaved images into planar NCHW element by element (~10x slower than a memcpy), and
    the model converts the batch back to channels_last; stacking their HWC views copies them whole instead.
    """
    if images[0].stride(0) == 1:  # channels innermost: HWC, possibly a crop of a larger image
        return torch.stack([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
    return torch.stack(images)


def _stack_targets(targets: tuple) -> torch.Tensor:
    """Class indices -> (B,) int64; multi-hot rows -> (B, C) float32."""
    return torch.stack(targets) if isinstance(targets[0], torch.Tensor) else torch.tensor(targets)


def _collate_images(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, targets = zip(*batch, strict=True)
    return stack_images(list(images)), _stack_targets(targets)


def _collate_encoded(batch: list[tuple]) -> tuple:
    """Encoded files differ in length (and decoded ones in size): a list of them, the targets stacked, and the
    training draws' seeds (int64) when the sampler gave them."""
    images, targets, *seeds = zip(*batch, strict=True)
    return (list(images), _stack_targets(targets), *(torch.tensor(s) for s in seeds))


class ImageFolderDataModule(L.LightningDataModule):
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
        num_workers: loader processes per device; null chooses from the hardware (datamodules/hardware.py): one
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
            image_size. About a quarter less CPU per image; pixels differ from the exact decode by about one level
            in 255 on average. Validation, test and prediction images are always decoded exactly.
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
        batch_size: int = 64,
        num_workers: int | None = None,
        val_split: float = 0.1,
        split_seed: int = 0,
        preset: Preset = "imagenet",
        image_size: int = 224,
        train_image_size: int | None = None,
        eval_image_size: int | None = None,
        eval_resize_size: int | None = None,
        progressive_resizing: dict[int, int] | None = None,
        auto_augment: AutoAugment = "none",
        auto_augment_magnitude: int | None = None,
        random_erasing: float = 0.0,
        repeated_augmentation: int = 1,
        sampler: Sampling = "random",
        balance_power: float = 1.0,
        prefetch_factor: int = 2,
        persistent_workers: bool = True,
        pin_memory: bool | None = None,
        predict_dir: str | None = None,
        normalize_on_device: bool = True,
        augment_on_device: bool = False,
        fast_decode: bool = False,
        bad_images: Literal["raise", "skip"] = "raise",
        scan_cache: bool = True,
    ) -> None:
        super().__init__()
        _check_args(batch_size, num_workers, val_split, preset, dict(image_size=image_size,
                                                                     train_image_size=train_image_size,
                    eval_image_size=eval_image_size), bad_images)
        check_fast_decode(preset, fast_decode)
        self.save_hyperparameters()
        for key in ("root", "predict_dir"):  # as strings: checkpoints load weights_only, which refuses Paths
            if isinstance(self.hparams[key], Path):
                self.hparams[key] = str(self.hparams[key])
        if format not in get_args(DataFormat):
            raise ValueError(f"data.format={format!r} is unknown; choose {' or '.join(get_args(DataFormat))}")
        self.format = format
        # A litdata root stays a string, which LitData reads as given: Path would fold s3:// into s3:/.
        self.root = (Path(root).expanduser() if format == "folder" else os.path.expanduser(root)) if root else None
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_split = val_split
        self.split_seed = split_seed
        self.preset = preset
        self.image_size = image_size
        self.train_image_size = train_image_size or image_size
        self.eval_image_size = eval_image_size or image_size
        self.eval_resize_size = eval_resize_size
        ClassificationPresetEval(preset=preset, image_size=self.eval_image_size, resize_size=eval_resize_size)  # checks
        self.progressive_resizing = _check_schedule(progressive_resizing, self.train_image_size)
        self.augment = dict(auto_augment=auto_augment, auto_augment_magnitude=auto_augment_magnitude,
                            random_erasing=random_erasing)
        ClassificationPresetTrain(preset=preset, image_size=self.train_image_size, **self.augment)  # checks the keys
        if repeated_augmentation < 1:
            raise ValueError(f"data.repeated_augmentation={repeated_augmentation} must be at least 1 (1 is off)")
        self.repeated_augmentation = repeated_augmentation
        if sampler not in get_args(Sampling):
            raise ValueError(f"data.sampler={sampler!r} is unknown; choose {' or '.join(get_args(Sampling))}")
        if sampler == "balanced" and repeated_augmentation > 1:
            raise ValueError("data.sampler=balanced and data.repeated_augmentation > 1 are two samplers; choose one")
        if balance_power < 0:
            raise ValueError(f"data.balance_power={balance_power} must be >= 0 (0 is uniform, 1 balances the classes)")
        self.sampling, self.balance_power = sampler, balance_power
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.predict_dir = Path(predict_dir).expanduser() if predict_dir is not None else None
        self.normalize_on_device = normalize_on_device
        self.augment_on_device = augment_on_device
        self.fast_decode = fast_decode
        self._device_transforms: dict[str, object] = {}  # "train" | "eval" -> uint8 preset, for augment_on_device
        self.float_transform = float_transform(preset)  # uint8 (B, 3, H, W) -> float32 (B, 3, H, W)
        self.bad_images = bad_images
        self.scan_cache = scan_cache
        # Multi-label when train/ holds a labels.csv (path,labels rows) instead of class folders.
        self.multilabel = isinstance(self.root, Path) and self.root.is_dir() and is_multilabel(self.root)
        if format == "litdata" and (sampler == "balanced" or repeated_augmentation > 1):
            raise ValueError("data.format=litdata draws with LitData's shuffle: set data.sampler: random and "
                             "data.repeated_augmentation: 1")
        if self.multilabel and sampler == "balanced":
            raise ValueError(f"data.sampler=balanced weights each image by its class, and {self.root} is multi-label "
                             f"(train/{LABELS_CSV}); use data.sampler: random")
        self.shard_counts: dict[str, int] | None = None  # data.format litdata: images per split of the shards
        # Class names are read now (a directory listing, cheap) so that the CLI can link them into the model.
        self.class_names: list[str] | None = self._read_class_names() if self.root is not None else None
        self.train_set = self.val_set = self.test_set = self.predict_set = None

    @property
    def num_classes(self) -> int | None:
        return len(self.class_names) if self.class_names is not None else None

    def _read_class_names(self) -> list[str]:
        if self.format == "litdata":  # what `imgcls prepare-data` wrote beside the shards
            from datamodules.shards import read_meta  # imports LitData, which the folder format does without

            meta = read_meta(self.root)
            self.multilabel, self.shard_counts = meta["multilabel"], meta["counts"]
            return meta["class_names"]
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.root={self.root} does not exist; run `imgcls demo-data {self.root}` "
                                    "or point data.root at a folder with train/ and val/")
        if self.multilabel:  # the labels that train/labels.csv uses, sorted
            classes = sorted({label for _, labels in read_labels_csv(self.root / "train") for label in labels})
            if len(classes) < 2:
                raise ValueError(f"{self.root / 'train' / LABELS_CSV} uses {len(classes)} label(s) ({classes}); "
                                 "multi-label classification needs two or more")
            return classes
        classes = find_classes(self.root / "train")
        if len(classes) < 2:
            raise ValueError(f"{self.root / 'train'} has a single class ({classes[0]}); classification needs two or "
                             "more")
        for split in ("val", "test"):
            split_dir = self.root / split
            if split_dir.is_dir():
                other = find_classes(split_dir)
                if other != classes:
                    missing, extra = sorted(set(classes) - set(other)), sorted(set(other) - set(classes))
                    raise ValueError(
                        f"{split}/ classes differ from train/ (root: {self.root}): "
                        f"missing from {split}/: {missing or 'none'}, not in train/: {extra or 'none'}"
                    )
        return classes

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
            (test,) = self._drop_bad(self._split_samples(test_dir), folder=self.root, scan="test")
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

    def _split_samples(self, split_dir: Path) -> list[tuple[str, int | np.ndarray]]:
        """(path, class index) for a split's class folders, or (path, multi-hot row) for its labels.csv."""
        if not self.multilabel:
            return scan_split(split_dir, self.class_names)
        index = {name: i for i, name in enumerate(self.class_names)}
        rows = read_labels_csv(split_dir)
        unknown = sorted({label for _, labels in rows for label in labels} - index.keys())
        if unknown:
            raise ValueError(f"{split_dir / LABELS_CSV} uses label(s) {unknown[:10]} that train/{LABELS_CSV} never "
                             f"does; the model has one output per label of train/")
        samples = []
        for path, labels in rows:
            row = np.zeros(len(index), np.uint8)
            row[[index[label] for label in labels]] = 1
            samples.append((path, row))
        return samples

    def split_samples(self) -> dict[str, list[tuple[str, int | np.ndarray]]]:
        """(path, target) pairs of train, val (its folder, or val_split of train) and test if present, as fit and
        test list them: what `imgcls prepare-data` converts."""
        train, val = self._train_val_samples()
        test = {"test": self._split_samples(self.root / "test")} if (self.root / "test").is_dir() else {}
        return {"train": train, "val": val, **test}

    def _train_val_samples(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        train = self._split_samples(self.root / "train")
        if (self.root / "val").is_dir():
            return train, self._split_samples(self.root / "val")
        # Seeded and stratified, over a sorted file list: every rank and every run gets the same split.
        from sklearn.model_selection import train_test_split  # here: importing it costs ~1 s of start-up

        if self.multilabel:  # label sets do not stratify: a seeded random split
            train_idx, val_idx = train_test_split(range(len(train)), test_size=self.val_split,
                                                  random_state=self.split_seed)
            return [train[i] for i in sorted(train_idx)], [train[i] for i in sorted(val_idx)]
        targets = [t for _, t in train]
        try:
            train_idx, val_idx = train_test_split(
                range(len(train)), test_size=self.val_split, stratify=targets, random_state=self.split_seed
            )
        except ValueError as err:  # sklearn: a class too small to appear on both sides
            raise ValueError(
                f"data.val_split={self.val_split} of {self.root / 'train'} leaves a class empty ({err}); "
                "add a val/ folder or images, or change data.val_split"
            ) from None
        kept = {train[i][1] for i in val_idx}
        if len(kept) < len(self.class_names):
            empty = [self.class_names[c] for c in range(len(self.class_names)) if c not in kept]
            raise ValueError(f"data.val_split={self.val_split} of {self.root / 'train'} leaves class(es) {empty} "
                             "with no validation image; raise data.val_split or add a val/ folder")
        return [train[i] for i in sorted(train_idx)], [train[i] for i in sorted(val_idx)]

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
        common = dict(
            batch_size=self.batch_size,
            num_workers=workers,
            pin_memory=on_cuda if self.pin_memory is None else self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            collate_fn=_collate_encoded if self.augment_on_device else _collate_images,
            worker_init_fn=(functools.partial(_worker_init, rank=trainer.global_rank if trainer else 0)
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

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        x, y, *seeds = batch
        if isinstance(x, list):  # augment_on_device: the files stay in host memory, where nvJPEG reads them from
            return (x, y.to(device, non_blocking=True), *seeds)  # the seeds stay on the host: the CPU draws
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """uint8 images -> float32, normalized, on the device; the second element (targets or indices) is kept."""
        x, y, *seeds = batch
        if isinstance(x, list):
            trainer = self.trainer
            train = trainer is not None and trainer.training
            # Each draw's own seed (SeededDraws), as the workers use it; else (a sampler of the user's) one per batch.
            seed = (seeds[0].tolist() if seeds else _augment_seed(trainer)) if train else None
            x = self.augment_batch(x, y.device, train=train, seed=seed)
        if self.progressive_resizing and self.trainer is not None and self.trainer.training:
            side = self.train_side(self.trainer.current_epoch)
            if side != x.shape[-1]:
                x = TF.resize(x, [side, side], antialias=True)  # (B, 3, side, side), uint8 stays uint8
        if x.dtype == torch.uint8:
            x = self.float_transform(x)
        return x, y

    def train_side(self, epoch: int) -> int:
        """The training image side at `epoch`: the progressive_resizing entry in force, else train_image_size."""
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


def _worker_init(worker_id: int, rank: int) -> None:
    """Start of each loader worker: freeze the heap it inherited from the trainer process, then seed it as Lightning
    does (Lightning adds its own seeding only to loaders that have no worker_init_fn).

    A garbage collection in a forked worker writes to every object of the parent's heap (imports, the model's
    Python objects) and so copies those pages: ~100 MB per worker, measured (benchmarks/worker_memory.py). Frozen
    objects are never collected, and the worker's own objects still are.
    """
    gc.freeze()
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank=rank)


def _augment_seed(trainer) -> int:
    """The seed of the batch in hand's device augmentation. Read in the transfer hook, before Lightning counts the
    batch in hand: the count so far is its index."""
    return batch_seed(trainer.fit_loop.epoch_loop.batch_progress.total.ready, trainer.global_rank, stream=1)


def batch_seed(batch: int, rank: int, *, stream: int = 0, base: int | None = None) -> int:
    """A seed from (run seed, training batch index, rank, stream), so that random draws depend only on the batch: a
    resumed run draws what the uninterrupted one drew, and each micro-batch of an accumulated step draws its own.

    `batch` counts every training batch of the run (Lightning's batch progress, restored from checkpoints); `stream`
    keeps independent users (dropout, device augmentation) from drawing the same numbers; `base` defaults to the
    run's seed_everything seed.
    """
    base = int(os.environ.get("PL_GLOBAL_SEED", 0)) if base is None else base
    return (((base * 1_000_003 + batch) * 1_009 + rank) * 7 + stream) % (2**63)


def _check_schedule(schedule: dict[int, int] | None, train_size: int) -> dict[int, int] | None:
    if not schedule:
        return None
    schedule = {int(epoch): int(side) for epoch, side in schedule.items()}
    bad = {e: s for e, s in schedule.items() if e < 0 or not 32 <= s <= train_size}
    if bad:
        raise ValueError(f"data.progressive_resizing has entries {bad}: epochs must be >= 0 and sides between 32 and "
                         f"data.train_image_size={train_size} (the loaders' crop size, which batches are resized from)")
    return dict(sorted(schedule.items()))


def _check_args(batch_size, num_workers, val_split, preset, sizes: dict[str, int | None], bad_images) -> None:
    """Reject bad config values up front, naming the key."""
    if batch_size < 1:
        raise ValueError(f"data.batch_size={batch_size} must be at least 1")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers} must be >= 0 (or null for automatic)")
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"data.val_split={val_split} must be between 0 and 1")
    if preset not in PRESETS:
        raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
    for key, size in sizes.items():
        if size is not None and size < 32:
            raise ValueError(f"data.{key}={size} is below 32, too small for a ResNet (5 stride-2 stages)")
    if bad_images not in ("raise", "skip"):
        raise ValueError(f"data.bad_images={bad_images!r} is unknown; choose raise or skip")
