"""LitData shards (`imgcls prepare-data`, `datamodules.ShardsDataModule`): the conversion, the pixels, the split among
ranks, 2-process DDP seeing each image once per epoch, and a SIGKILL mid-epoch resumed to the uninterrupted weights."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch import Callback
from litdata import StreamingDataset
from PIL import Image

from datamodules import ImageFolderDataModule
from datamodules.shards import ShardLoader, ShardsDataModule, main, training_split
from tests.helpers import fit_run as _fit
from tests.helpers import killed_and_resumed, make_image_folder, resume_config

BAD_REASON = "not an image (PIL cannot identify the format)"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, str]:
    """32 train and 32 val JPEGs of 2 classes plus a file that is no image, converted by `imgcls prepare-data` on 2
    processes: (source, shards, what it printed)."""
    tmp = tmp_path_factory.mktemp("shards")
    src = make_image_folder(tmp / "src", {"a": 16, "b": 16}, size=32, ext=".jpg")
    (src / "train" / "a" / "broken.jpg").write_bytes(b"this is no image")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the lines of this process; LitData's workers print their own
        main([str(src), str(tmp / "shards"), "--num_workers", "2"])
    return src, tmp / "shards", printed.getvalue()


def test_prepare_data_writes_each_split_and_leaves_out_bad_images(converted):
    src, shards, printed = converted
    bad = src / "train" / "a" / "broken.jpg"
    # The start scan's message and reason, then where the list is kept.
    assert f"1 of 65 images cannot be used:\n  {bad}: {BAD_REASON}\nprepare-data: these are left out" in printed
    meta = json.loads((shards / "imgcls-shards.json").read_text())
    assert meta["class_names"] == ["a", "b"] and meta["multilabel"] is False
    assert meta["counts"] == {"train": 32, "val": 32} and meta["left_out"] == [{"path": str(bad), "reason": BAD_REASON}]
    for split in ("train", "val"):
        stored = {s["path"]: s for s in StreamingDataset(str(shards / split))}  # bytes as they were, not decoded
        files = sorted(p for p in (src / split).rglob("*.jpg") if p != bad)
        assert sorted(stored) == [str(p.relative_to(src)) for p in files]
        for path in files:
            sample = stored[str(path.relative_to(src))]
            assert bytes(sample["image"]) == path.read_bytes() and sample["label"] == "ab".index(path.parent.name)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        main([str(src), str(shards)])


def test_shards_give_the_folders_pixels_and_seeded_augmentation(converted):
    src, shards, _ = converted
    options = dict(batch_size=4, num_workers=0, image_size=32, preset="imagenet")
    folder = ImageFolderDataModule(root=str(src), bad_images="skip", scan_cache=False, **options)
    streamed = ShardsDataModule(root=str(shards), **options)
    assert streamed.class_names == folder.class_names and streamed.num_classes == 2
    folder.setup("fit")
    streamed.setup("fit")
    by_path = {str(Path(p).relative_to(src)): folder.val_set[i] for i, p in enumerate(folder.val_set.paths)}
    reader = StreamingDataset(str(shards / "val"))
    for i in range(len(reader)):  # the eval transform of the same bytes: the same uint8 tensor
        image, target = streamed.val_set[i]
        expected_image, expected_target = by_path[reader[i]["path"]]
        assert target == expected_target and torch.equal(image, expected_image)
    # Training draws (random crops and flips) are a function of (seed, epoch, sample): repeatable, new each epoch.
    train = streamed.train_set
    first = [train[i][0] for i in range(4)]
    assert all(torch.equal(a, train[i][0]) for i, a in enumerate(first))
    train.current_epoch += 1
    assert not all(torch.equal(a, train[i][0]) for i, a in enumerate(first))


@pytest.mark.parametrize("posix_window", [False, True], ids=["local disk", "NFS-like (LitData's window shuffle)"])
def test_two_ranks_share_an_epoch_out_disjointly_and_drop_the_uneven_tail(converted, monkeypatch, posix_window):
    """What LitData does with 32 images on 2 ranks of 2 workers each: batch 4 divides them (each seen once per
    epoch); batch 5 does not, and it drops the 2 past the last batch every rank can make (3 batches, 15 images each).
    On a parallel file system LitData would deal whole chunks in fixed stripes; the training split reads item by
    item there too (LITDATA_POSIX_FAST=1 stands in for one)."""
    _, shards, _ = converted
    if posix_window:
        monkeypatch.setenv("LITDATA_POSIX_FAST", "1")
    for batch, seen_per_rank in ((4, 16), (5, 15)):
        epochs = []
        for epoch in range(2):
            ranks = []
            for rank in range(2):
                monkeypatch.setenv("WORLD_SIZE", "2")  # LitData reads these when no process group exists
                monkeypatch.setenv("GLOBAL_RANK", str(rank))
                data = training_split(str(shards), lambda image: image[:, :1, :1], encoded=False, seed=7,
                                      world_size=2, batch_size=batch, count=32)
                loader = ShardLoader(data, epoch=lambda e=epoch: e, batch_size=batch, num_workers=2)
                assert len(loader) == seen_per_rank // batch and type(data.shuffler).__name__ == "FullShuffle"
                ids = [tuple(x.flatten().tolist()) for images, _ in loader for x in images]
                assert len(ids) == seen_per_rank
                ranks.append(ids)
            assert not set(ranks[0]) & set(ranks[1]) and len(set(ranks[0] + ranks[1])) == 2 * seen_per_rank
            epochs.append(ranks)
        assert epochs[0] != epochs[1]  # reshuffled each epoch


def test_a_loader_restored_mid_epoch_or_at_its_end_goes_on_as_the_uninterrupted_one(converted):
    """The loader's state after 3 of an epoch's 4 batches (2 workers: 2 from one, 1 from the other) and after all 4,
    loaded into a new loader: the rest of that epoch (nothing, for the second), then the next epoch, in the
    uninterrupted order. Lightning stops each epoch at len(loader), before the iterator runs out."""
    _, shards, _ = converted
    epoch = [0]  # the trainer's

    def loader() -> ShardLoader:
        data = training_split(str(shards), lambda image: image[:, :1, :1], encoded=False, seed=7, world_size=1,
                              batch_size=8, count=32)
        return ShardLoader(data, epoch=lambda: epoch[0], batch_size=8, num_workers=2)

    def epoch_of(dl: ShardLoader, batches: int | None = None) -> list[list]:
        it = iter(dl)
        return [next(it)[0].flatten().tolist() for _ in range(batches if batches is not None else len(dl))]

    reference = loader()
    expected = [epoch_of(reference)]
    epoch[0] = 1
    expected.append(epoch_of(reference))
    for done in (3, 4):
        epoch[0] = 0
        first = loader()
        seen = epoch_of(first, done)
        resumed = loader()
        resumed.load_state_dict(first.state_dict())
        seen += list(b[0].flatten().tolist() for b in resumed) if done == 4 else epoch_of(resumed, 4 - done)
        assert seen == expected[0], done
        epoch[0] = 1
        assert epoch_of(resumed) == expected[1], done


def _id_folder(root: Path, splits: dict[str, int]) -> Path:
    """Single-colour PNGs whose red and green values are the image's id: id = 256 * red + green."""
    for split, count in splits.items():
        for i in range(count):
            folder = root / split / "ab"[i % 2]
            folder.mkdir(parents=True, exist_ok=True)
            pixel = np.array([i // 256, i % 256, 0], np.uint8)
            Image.fromarray(np.broadcast_to(pixel, (32, 32, 3)).copy()).save(folder / f"{split}{i:03d}.png")
    return root


class SeenImages(Callback):
    """Test-only: writes `<out_dir>/rank<R>.json`, the image ids of every training epoch and validation of its rank
    (preset none, 32 px: the pixels of `_id_folder`'s images reach the model unchanged, divided by 255)."""

    def __init__(self, out_dir: str) -> None:
        self.out = Path(out_dir)
        self.seen: dict[str, list[int]] = {}

    def _record(self, key: str, batch) -> None:
        pixels = (batch[0][:, :2, 0, 0] * 255).round().long()
        self.seen.setdefault(key, []).extend((256 * pixels[:, 0] + pixels[:, 1]).tolist())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._record(f"train{trainer.current_epoch}", batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._record(f"val{trainer.current_epoch}", batch)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def _config(tmp_path: Path, shards: Path, *, devices: int, preset: str, every_n_train_steps: int) -> Path:
    """The quickstart config shrunk (TINY_ARCH at 32 px, 2 epochs, 2 loader workers) on the shards."""
    cfg = resume_config(devices, every_n_train_steps)
    cfg["trainer"]["num_sanity_val_steps"] = 0
    cfg["data"].update(root=str(shards), batch_size=8 // devices, num_workers=2, image_size=32, preset=preset)
    cfg["data"] = {"class_path": "datamodules.ShardsDataModule", "init_args": cfg["data"]}
    path = tmp_path / f"config{devices}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path




@pytest.mark.slow
def test_fit_from_shards_killed_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path, converted):
    """One process, 2 loader workers, random crops and flips (preset imagenet), a step checkpoint every 3 steps, 4
    steps an epoch, 2 epochs. Killed after step 4, the same command resumes from step 3's checkpoint, whose loader
    had yielded 3 batches (2 from one worker, 1 from the other): it must go on with the second worker, then start
    epoch 1 afresh. It ends with the weights of the run never killed."""
    _, shards, _ = converted
    config = _config(tmp_path, shards, devices=1, preset="imagenet", every_n_train_steps=3)
    assert killed_and_resumed(config, tmp_path, kill_after=4, resumes_from=3) <= 1e-6


@pytest.mark.slow
def test_ddp_from_shards_sees_each_image_once_per_epoch(tmp_path):
    """2 processes, batch 4 each, 2 loader workers each: the 32 training images are dealt out disjointly, each seen
    once per epoch, in a new order each epoch; the 10 validation images too, uneven (4 and 6) but each counted once."""
    src = _id_folder(tmp_path / "src", {"train": 32, "val": 10})
    with contextlib.redirect_stdout(io.StringIO()):
        main([str(src), str(tmp_path / "shards"), "--num_workers", "2"])
    config = _config(tmp_path, tmp_path / "shards", devices=2, preset="none", every_n_train_steps=100)
    out = tmp_path / "seen"
    _fit(config, tmp_path / "run", f"--trainer.callbacks+={__name__}.SeenImages", f"--trainer.callbacks.out_dir={out}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        train = [r[f"train{epoch}"] for r in ranks]
        assert len(train[0]) == len(train[1]) == 16 and sorted(train[0] + train[1]) == list(range(32)), train
        val = [r[f"val{epoch}"] for r in ranks]
        assert sorted(val[0] + val[1]) == list(range(10)), val
    assert ranks[0]["train0"] != ranks[0]["train1"]
