"""Image folders as LitData shards, for data kept on shared storage or in a bucket: the conversion (`imgcls
prepare-data`), and the data source that trains from them (`ShardsDataModule`) with its streaming datasets and loader.

    imgcls prepare-data my_images /shared/my_images_shards
    imgcls fit --config configs/quickstart.yaml --data.class_path datamodules.ShardsDataModule \
        --data.root /shared/my_images_shards
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming.downloader import get_downloader
from litdata.streaming.sampler import ChunkedIndex

from core.command_line import parse_settings
from core.config_types import PositiveInt
from core.seeding import draw_seed, run_seed, seeded_cpu_draws
from datamodules.bad_images import ScanCache, bad_images_message, find_bad_images
from datamodules.datasets import UnreadableImageError
from datamodules.decoding import decode_bytes
from datamodules.image_data import ImageData, Transforms
from datamodules.image_folder import FolderSplits

# Lightning warns about any IterableDataset with a length on several workers; LitData's is what this process's
# workers yield, whatever their number.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

META = "imgcls-shards.json"  # beside the splits' folders; written last, so a converted folder has it


# ---- conversion -------------------------------------------------------------------------------------------------


def _encode(item: tuple[str, int | np.ndarray, str]) -> dict:
    """One sample as LitData stores it: the file's bytes as they are (never decoded here), its target, its path."""
    path, target, rel = item
    with open(path, "rb") as f:
        return {"image": f.read(), "label": target, "path": rel}


def prepare_data(src: str | os.PathLike, out: str | os.PathLike, *, num_workers: int | None = None,
                 val_split: float = 0.1, split_seed: int = 0, chunk_bytes: str = "64MB") -> dict:
    """Convert the image folder `src` (the layouts ImageFolderDataModule reads) into LitData chunks, one folder of
    them per split under `out`, and `out/imgcls-shards.json` (classes, counts, the files left out). Returns that.

    Without val/, val_split of train/ is held out as the DataModule would (split_seed). Every image is decoded once
    first (the start scan's check and messages); those that fail are listed and left out. Each split is written in
    a seeded random order: LitData shuffles chunks and blocks of samples within them, not single samples, so a
    batch holds the classes in their proportions only if the chunks do.
    """
    if "://" in str(out):
        raise ValueError(f"{out}: prepare-data writes to a local or shared folder; copy it to the bucket afterwards "
                         "(e.g. aws s3 sync OUT_DIR s3://bucket/prefix) and train from the URL")
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or choose another folder")
    data = FolderSplits(src, val_split, split_seed)
    splits = data.all()
    paths = [p for samples in splits.values() for p, _ in samples]
    cache = ScanCache(src, "prepare-data")
    bad = find_bad_images(paths, progress=True, cache=cache)
    print(cache.summary())
    if bad:
        print(f"{bad_images_message(bad, len(paths))}\nprepare-data: these are left out of the shards (and listed in "
              f"{out / META})")
    dropped = {p for p, _ in bad}
    counts = {}
    for split, samples in splits.items():
        items = [(p, t, os.path.relpath(p, src)) for p, t in samples if p not in dropped]
        if not items:
            raise ValueError(f"no usable image is left in {split}/ of {src} after leaving out {len(bad)} bad files")
        random.Random(split_seed).shuffle(items)
        # fork: the workers inherit this process's imports instead of importing torch again each (spawn).
        optimize(fn=_encode, inputs=items, output_dir=str(out / split), chunk_bytes=chunk_bytes,
                 num_workers=num_workers or os.cpu_count() or 1, keep_data_ordered=True, reorder_files=False,
                 start_method="fork" if os.name == "posix" else None)
        counts[split] = len(items)
    meta = {"class_names": data.class_names, "multilabel": data.multilabel, "counts": counts, "source": str(src),
            "val_split": None if (src / "val").is_dir() else val_split, "split_seed": split_seed,
            "left_out": [{"path": p, "reason": why} for p, why in bad]}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read_meta(root: str) -> dict:
    """The conversion's metadata of the shards at `root`: a folder, or a URL that LitData reads (s3://...)."""
    if "://" not in root:
        file = Path(root) / META
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: data.root={root} is not a folder of shards made by "
                                    f"`imgcls prepare-data` (or its conversion did not finish); run it first")
        return json.loads(file.read_text())
    with tempfile.TemporaryDirectory() as tmp:  # the same client, credentials and options as the chunks'
        get_downloader(root, tmp, []).download_file(f"{root.rstrip('/')}/{META}", os.path.join(tmp, META))
        return json.loads(Path(tmp, META).read_text())


def split_dir(root: str, split: str) -> str:
    return f"{root.rstrip('/')}/{split}"


# ---- reading ----------------------------------------------------------------------------------------------------


class ShardImages(StreamingDataset):
    """One split of the shards as (image, target) pairs; each sample is decoded and transformed in the loader worker
    that reads it. LitData shuffles and shares the samples out among ranks and workers itself (no sampler).

    Training samples (`train`) are augmented from a seed of (seed, epoch, sample index) alone, as `SeededDraws`
    seeds the folder's draws, so a resumed run draws every crop and flip of the run it continues. With `transform`
    None (augment_on_device) a sample is its (encoded) image, target and that seed.
    """

    def __init__(self, input_dir: str, transform: Callable | None, *, encoded: bool = False, train: bool = False,
                 seed: int = 0, drop_last: bool = False) -> None:
        # One sample decoded at a time (LitData's "auto" decodes blocks of 256 of our dicts, each again for every few
        # samples read); so the order within a chunk can be a full permutation at no cost.
        super().__init__(input_dir, shuffle=train, drop_last=drop_last if train else None, seed=seed, batch_decode=0,
                         item_shuffle_window=0)
        if not train:  # evaluation: each image once, ranks uneven (the metrics sync at the epoch's end)
            self.set_drop_last(False)  # after __init__: LitData warns when DDP is given drop_last=False
        if train and self.posix_fast is not None and self.posix_fast.window_shuffle:
            # On NFS, Lustre or GPFS LitData deals whole chunks to workers in fixed stripes trimmed to the shortest:
            # the same samples dropped every epoch, and with few chunks a rank may get none. The item-level split
            # of local disks (chunks permuted each epoch, every rank as many batches) reads in place all the same.
            self.posix_fast = dataclasses.replace(self.posix_fast, kind="posix")
        self.image_transform = transform  # not `transform`: StreamingDataset applies an attribute of that name itself
        self.encoded = encoded
        self.train = train

    def __getitem__(self, index: ChunkedIndex | int):
        sample = super().__getitem__(index)
        position = index.index if isinstance(index, ChunkedIndex) else int(index)  # the sample's index in the split
        target = sample["label"]
        target = torch.from_numpy(np.asarray(target, np.float32)) if np.ndim(target) else int(target)
        seed = draw_seed(self.seed, self.current_epoch, 0, position) if self.train else None
        try:
            image = decode_bytes(sample["image"], encoded=self.encoded)
            if self.image_transform is None:  # augment_on_device: the seed travels with the file to the device
                return (image, target, seed) if seed is not None else (image, target)
            if seed is None:
                return self.image_transform(image), target
            with seeded_cpu_draws(seed):
                return self.image_transform(image), target
        except Exception as err:
            raise UnreadableImageError(f"cannot read image {sample['path']} (sample {position} of "
                                       f"{self.input_dir.url or self.input_dir.path}): {err}") from err


def training_split(root: str, transform: Callable | None, *, encoded: bool, seed: int, world_size: int,
                   batch_size: int, count: int) -> ShardImages:
    """The train split of `count` images. Under DDP LitData drops the samples past the last whole batch of every
    rank (each then steps as often); on one process, as the folder's loader, only when there is more than a batch."""
    per_process = math.ceil(count / world_size)
    if world_size > 1 and count < world_size * batch_size:
        raise ValueError(f"data: {count} training images over {world_size} processes give {per_process} per "
                         f"process, fewer than data.batch_size={batch_size}, and LitData would give them none; "
                         "lower data.batch_size")
    return ShardImages(split_dir(root, "train"), transform, encoded=encoded, train=True, seed=seed,
                       drop_last=world_size > 1 or per_process > batch_size)


class ShardLoader(StreamingDataLoader):
    """LitData's StreamingDataLoader, which counts the batches it yielded (its `state_dict` goes into every
    checkpoint, as the folder's StatefulDataLoader's does), with three changes for exact resumption:

    - its epoch is the trainer's (`epoch`), not a count of its iterators, which Lightning makes more or fewer of
      after a resume (its shuffle and the augmentation seeds depend on it);
    - only the first iterator after `load_state_dict` goes on from the saved position: StreamingDataLoader would
      resume every later one too until one runs to its end, and Lightning stops each epoch at `len(loader)`;
    - a state saved after an epoch's last batch gives an empty iterator, as a spent StatefulDataLoader does
      (StreamingDataLoader would run the epoch again).

    Its workers are never persistent: a persistent worker keeps the dataset it had, without a restored position.
    """

    def __init__(self, dataset: ShardImages, *, epoch: Callable[[], int] | None = None, **kwargs) -> None:
        super().__init__(dataset, persistent_workers=False, **kwargs)
        self._epoch = epoch
        self._resume: str | None = None  # what the next iterator does: "position" (go on from it) or "spent"

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume == "spent":
            return
        if resume is None:
            self.restore = False  # a new epoch: StreamingDataLoader then forgets the loaded position
            if self._epoch is not None:
                self.current_epoch = self._epoch()  # StreamingDataLoader adds 1: LitData counts epochs from 1
        yield from super().__iter__()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        spent = state["num_samples_yielded"] >= len(self.dataset)
        self._resume = "spent" if spent else "position" if self.restore else None


@dataclasses.dataclass(eq=False, repr=False)
class ShardsDataModule(ImageData):
    """LitData shards that `imgcls prepare-data` wrote from an image folder, in a folder or a bucket (``s3://``),
    streamed by LitData: the splits, class names and the bad-file scan come from that conversion, and the training
    order is LitData's shuffle, shared out among ranks and workers by LitData itself (no sampler: ``sampler`` must
    stay ``random`` and ``repeated_augmentation`` 1). Training samples are augmented from a seed of (run seed, epoch,
    sample), and the loader's position is checkpointed, so a resumed run goes on exactly (`ShardLoader`).
    """

    root: str | None = None
    """The shards' folder or URL (what `imgcls prepare-data` was given as OUT_DIR). May be null for ``predict`` from a
    checkpoint, which carries the class names."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampler == "balanced" or self.repeated_augmentation > 1:
            raise ValueError("datamodules.ShardsDataModule draws with LitData's shuffle: set data.sampler: random and "
                             "data.repeated_augmentation: 1")
        # A string, which LitData reads as given: Path would fold s3:// into s3:/.
        self.root = os.path.expanduser(self.root) if self.root else None
        self.shard_counts: dict[str, int] | None = None  # images per split of the shards
        if self.root is not None:  # what `imgcls prepare-data` wrote beside the shards
            meta = read_meta(self.root)
            self.class_names, self.multilabel = meta["class_names"], meta["multilabel"]
            self.shard_counts = meta["counts"]

    def setup_datasets(self, stage: str, transforms: Transforms) -> None:
        if self.root is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root SHARDS_FOLDER_OR_URL")
        if stage in ("fit", "validate") and self.train_set is None:
            self.train_set = training_split(self.root, transforms.train, encoded=transforms.train_encoded,
                                            seed=run_seed(), batch_size=self.batch_size,
                                            world_size=self.trainer.world_size if self.trainer else 1,
                                            count=self.shard_counts["train"])
            self.val_set = ShardImages(split_dir(self.root, "val"), transforms.eval, encoded=transforms.eval_encoded)
        if stage == "test":
            if "test" not in self.shard_counts:
                raise FileNotFoundError(f"the shards at {self.root} have no test split; `imgcls test` needs one")
            self.test_set = ShardImages(split_dir(self.root, "test"), transforms.eval, encoded=transforms.eval_encoded)

    def _shard_loader(self, dataset: ShardImages, *, train: bool) -> ShardLoader:
        # LitData shuffles, shares out among ranks (each image to one rank in evaluation) and drops the last samples.
        trainer = self.trainer
        return ShardLoader(dataset, epoch=(lambda: trainer.current_epoch) if trainer and train else None,
                           **self.loader_options(train))

    def train_dataloader(self) -> ShardLoader:
        return self._shard_loader(self.train_set, train=True)

    def val_dataloader(self) -> ShardLoader:
        return self._shard_loader(self.val_set, train=False)

    def test_dataloader(self) -> ShardLoader:
        return self._shard_loader(self.test_set, train=False)


# ---- the command ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PrepareDataSettings:
    """The settings of `imgcls prepare-data`."""

    src: str
    """image folder: train/ (val/, test/) of class folders, or labels.csv splits"""
    out_dir: str
    """new folder for the shards: out_dir/{train,val,test}/ and imgcls-shards.json"""
    _: dataclasses.KW_ONLY
    num_workers: PositiveInt | None = None
    """conversion processes (default: CPU count)"""
    val_split: float = 0.1
    """without val/: fraction of train/ held out"""
    split_seed: int = 0
    """seed of that split and of the write order"""
    chunk_bytes: str = "64MB"
    """size of each chunk file"""


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(PrepareDataSettings, argv, prog="imgcls prepare-data", description=__doc__)
    meta = prepare_data(args.src, args.out_dir, num_workers=args.num_workers, val_split=args.val_split,
                        split_seed=args.split_seed, chunk_bytes=args.chunk_bytes)
    counts = ", ".join(f"{split} {n}" for split, n in meta["counts"].items())
    print(f"shards in {args.out_dir}: {counts} images, {len(meta['class_names'])} classes, "
          f"{len(meta['left_out'])} left out; train with --data.class_path datamodules.ShardsDataModule --data.root "
          f"{args.out_dir}")
