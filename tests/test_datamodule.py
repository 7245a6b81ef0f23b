"""The image-folder DataModule: splits, class agreement, image modes, transforms, loaders, demo data."""

from __future__ import annotations

import functools
import gc
import json
import types

import lightning as L
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from PIL import Image

from datamodules import ImageFolderDataModule
from datamodules.datasets import ImageFiles, PredictImages
from datamodules.decoding import load_rgb
from datamodules.demo import MANIFEST, build_demo_data
from datamodules.presets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ClassificationPresetEval,
    ClassificationPresetTrain,
)
from tests.helpers import make_image_folder


def test_classes_are_sorted_folder_names(tmp_path):
    make_image_folder(tmp_path, {"zebra": 2, "ant": 2, "moth": 2})
    dm = ImageFolderDataModule(tmp_path, image_size=32)
    assert dm.class_names == ["ant", "moth", "zebra"]
    assert dm.num_classes == 3


def test_val_split_is_stratified_disjoint_and_repeatable(tmp_path):
    make_image_folder(tmp_path, {"a": 20, "b": 10, "c": 30}, splits=("train",))
    splits = []
    for _ in range(2):
        dm = ImageFolderDataModule(tmp_path, val_split=0.2, image_size=32)
        dm.setup("fit")
        splits.append((dm.train_set.samples, dm.val_set.samples))
    (train, val), (train2, val2) = splits
    assert (train, val) == (train2, val2)  # same split on every process and every run
    assert not {p for p, _ in train} & {p for p, _ in val}
    assert len(train) + len(val) == 60
    per_class = np.bincount([t for _, t in val], minlength=3)
    assert per_class.tolist() == [4, 2, 6]  # 20% of each class


def test_val_split_seed_changes_the_split(tmp_path):
    make_image_folder(tmp_path, {"a": 20, "b": 20}, splits=("train",))
    vals = []
    for seed in (0, 1):
        dm = ImageFolderDataModule(tmp_path, val_split=0.25, split_seed=seed, image_size=32)
        dm.setup("fit")
        vals.append({p for p, _ in dm.val_set.samples})
    assert vals[0] != vals[1]


def test_classes_must_agree_across_splits(tmp_path):
    make_image_folder(tmp_path, {"a": 2, "b": 2}, splits=("train",))
    make_image_folder(tmp_path, {"a": 2, "c": 2}, splits=("val",))
    with pytest.raises(ValueError,
                       match=r"val/ classes differ from train/.*missing from val/: \['b'\].*not in train/: \['c'\]"):
        ImageFolderDataModule(tmp_path)


@pytest.mark.parametrize(
    ("mode", "ext", "value"),
    [
        ("L", ".png", 200),
        ("P", ".PNG", 77),
        ("RGBA", ".webp", 90),
        ("CMYK", ".JPG", None),
        ("RGB", ".jpeg", 120),
        ("RGB", ".bmp", 33),
        ("I;16", ".png", 40000),  # 16-bit: rescaled to 8 bits, not clipped to white
    ],
)
def test_every_image_mode_loads_as_rgb(tmp_path, mode, ext, value):
    path = tmp_path / f"img{ext}"
    if mode == "I;16":
        Image.fromarray(np.full((16, 16), value, dtype=np.uint16)).save(path)
        expected = round(value * 255 / 65535)
    elif mode == "CMYK":
        Image.new("CMYK", (16, 16), (0, 0, 0, 0)).save(path, quality=100)  # no ink: white
        expected = 255
    elif mode == "P":
        Image.new("L", (16, 16), value).convert("P").save(path)
        expected = value
    else:
        fill = value if mode == "L" else (value,) * len(mode)
        Image.new(mode, (16, 16), fill).save(path, **({"lossless": True} if ext == ".webp" else {}))
        expected = value
    img = load_rgb(str(path))
    assert img.mode == "RGB" and img.size == (16, 16)
    assert abs(int(np.asarray(img)[8, 8, 0]) - expected) <= 2


def test_palette_with_transparency_loads(tmp_path):
    img = Image.new("P", (8, 8), 1)
    img.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    img.info["transparency"] = 0
    img.save(tmp_path / "t.png", transparency=0)
    assert np.asarray(load_rgb(str(tmp_path / "t.png")))[0, 0].tolist() == [10, 20, 30]


@pytest.mark.parametrize("preset", ["imagenet", "keras", "none"])
def test_presets_give_float_chw_of_image_size(preset):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    for tf in (ClassificationPresetTrain(preset=preset, image_size=40),
               ClassificationPresetEval(preset=preset, image_size=40)):
        out = tf(img)
        assert out.shape == (3, 40, 40) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        if preset == "imagenet":
            assert out.min() < 0  # normalised by ImageNet mean and std
        else:
            assert 0.0 <= out.min() and out.max() <= 1.0


def test_eval_resize_size_sets_the_short_side_before_the_center_crop():
    image = Image.fromarray(np.tile(np.arange(256, dtype=np.uint8), (128, 1))).convert("RGB")  # 256 x 128: a ramp
    for resize, expected in ((None, 256), (232, 232)):  # 224 / 0.875 = 256 by default; torchvision V2's 232
        tf = ClassificationPresetEval(preset="imagenet", image_size=224, resize_size=resize, uint8_output=True)
        resized = tf.transforms.transforms[1](tf.transforms.transforms[0](image))
        assert min(resized.shape[-2:]) == expected
        assert tf(image).shape == (3, 224, 224)
    with pytest.raises(ValueError, match="data.eval_transform.resize_size=200 is below the crop, "
                                         "data.eval_transform.image_size=224"):
        ImageFolderDataModule(root=None, eval_transform=ClassificationPresetEval(image_size=224, resize_size=200))


def test_imagenet_eval_normalises_with_imagenet_stats():
    rgb = (124, 116, 104)  # ~ the ImageNet mean colour
    out = ClassificationPresetEval(preset="imagenet", image_size=32)(Image.new("RGB", (64, 64), rgb))
    expected = torch.tensor([(v / 255 - m) / s for v, m, s in zip(rgb, IMAGENET_MEAN, IMAGENET_STD, strict=True)])
    assert torch.allclose(out[:, 16, 16], expected, atol=1e-4)


def test_train_loader_batches(digits_root):
    dm = ImageFolderDataModule(digits_root, batch_size=8, num_workers=0, preset="none", image_size=32)
    dm.setup("fit")
    raw, y = next(iter(dm.train_dataloader()))
    assert raw.shape == (8, 3, 32, 32) and raw.dtype == torch.uint8  # workers ship uint8 (normalize_on_device)
    assert y.dtype == torch.int64 and y.max() < 10
    x, _ = dm.on_after_batch_transfer((raw, y), 0)  # what the model gets, after the copy to the device
    assert x.dtype == torch.float32 and torch.allclose(x, raw.float() / 255, rtol=0, atol=1e-6)
    assert len(dm.val_set) == 180 and len(dm.train_set) == 1437


def _large_python_containers(root: object, size: int) -> list[str]:
    """Lists, tuples, dicts and sets of `size` items or more reachable from `root`, and object arrays: per-sample
    Python objects, which every forked loader worker copies as it reads them (refcounts, pytorch/pytorch#13246)."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, types.FunctionType | types.ModuleType | type):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            found += ["object array"] if obj.dtype == object else []
            continue
        if isinstance(obj, list | tuple | dict | set) and len(obj) >= size:
            found.append(f"{type(obj).__name__} of {len(obj)}")
        stack.extend(gc.get_referents(obj))
    return found


def test_samples_are_stored_in_numpy_arrays_not_python_objects():
    paths = [f"/data/train/c{i % 7}/{i:05d}.jpg" for i in range(2000)]
    paths[5], paths[-1] = "/data/train/c5/été_日本.jpg", "/data/train/c6/naïve \udcff.png"  # undecodable byte too
    samples = [(p, i % 7) for i, p in enumerate(paths)]
    dataset = ImageFiles(samples, transform=None, read=lambda path: path)
    assert _large_python_containers(dataset, 100) == []
    assert dataset.paths.data.dtype == np.uint8 and dataset.targets.dtype == np.int64
    for i in (0, 5, 1234, len(paths) - 1, -1):
        assert dataset[i] == samples[i] and dataset.paths[i] == paths[i] and dataset.samples[i] == samples[i]
    assert len(dataset) == 2000 and dataset.samples == samples and dataset.samples[-2:] == samples[-2:]
    with pytest.raises(IndexError):
        dataset[2000]
    predict = PredictImages(paths, transform=None, read=lambda path: path)
    assert _large_python_containers(predict, 100) == []
    assert predict[-1] == (paths[-1], 1999) and predict.paths[5] == paths[5] and list(predict.paths) == paths


def test_predict_dir_nested(tmp_path):
    for sub in ("", "a", "a/b"):
        (tmp_path / "p" / sub).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (20, 20)).save(tmp_path / "p" / sub / "x.JPEG")
    (tmp_path / "p" / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(None, predict_dir=str(tmp_path / "p"), image_size=32, num_workers=0)
    dm.setup("predict")
    assert len(dm.predict_set) == 3
    x, index = dm.predict_set[2]
    assert x.shape == (3, 32, 32) and index == 2


def test_demo_data_is_stratified_and_idempotent(tmp_path):
    out = build_demo_data(tmp_path / "digits", size=16)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["counts"] == {"train": 1437, "val": 180, "test": 180}
    val_counts = [len(list((out / "val" / str(c)).iterdir())) for c in range(10)]
    assert min(val_counts) >= 17 and sum(val_counts) == 180
    stamp = (out / "train" / "0").stat().st_mtime_ns
    build_demo_data(tmp_path / "digits", size=16)  # second run: nothing rewritten
    assert (out / "train" / "0").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError):
        build_demo_data(tmp_path / "digits", size=32)  # other settings never overwrite a tree silently


class _WorkerProbe(torch.utils.data.Dataset):
    """Each item: random pixels from the worker's torch generator, and whether the worker's heap is frozen."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return torch.randint(0, 256, (3, 2, 2), dtype=torch.uint8), int(gc.get_freeze_count() > 0)


def test_loader_workers_freeze_the_inherited_heap_and_keep_lightnings_seeding(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 2, "b": 2}, splits=("train",), size=32)
    data = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=1, persistent_workers=False)
    L.seed_everything(5, workers=True)  # what LightningCLI does: Lightning then seeds each worker
    ours = next(iter(data._loader(_WorkerProbe(), train=False)))
    L.seed_everything(5, workers=True)
    lightnings = next(iter(torch.utils.data.DataLoader(_WorkerProbe(), batch_size=4, num_workers=1,
                                                       worker_init_fn=functools.partial(pl_worker_init_function,
                                                                                        rank=0))))
    assert ours[1].tolist() == [1, 1, 1, 1]  # frozen in the worker
    assert torch.equal(ours[0], lightnings[0])  # and seeded exactly as Lightning seeds a worker


def test_class_folders_may_nest_and_hidden_folders_are_no_class(tmp_path):
    """Images in sub-folders of a class folder belong to it (torchvision's make_dataset); a hidden folder beside the
    classes (.ipynb_checkpoints) is not a class, as torchvision's own find_classes would make it."""
    root = make_image_folder(tmp_path, {"a": 3, "b": 3}, splits=("train",), size=32)
    (root / "train" / "a" / "more" / "deeper").mkdir(parents=True)
    Image.new("RGB", (32, 32)).save(root / "train" / "a" / "more" / "deeper" / "x.png")
    (root / "train" / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (32, 32)).save(root / "train" / ".ipynb_checkpoints" / "y.png")
    dm = ImageFolderDataModule(str(root), batch_size=2, num_workers=0, image_size=32, val_split=0.34, preset="none",
                               scan_cache=False)
    dm.setup("fit")
    assert dm.class_names == ["a", "b"]
    paths = [path for path, _ in dm.train_set.samples] + [path for path, _ in dm.val_set.samples]
    assert len(paths) == 7 and str(root / "train" / "a" / "more" / "deeper" / "x.png") in paths


@pytest.mark.timeout(120)
def test_augment_on_device_batches_come_from_loader_workers(tmp_path):
    """augment_on_device: a loader worker reads the JPEG files and sends their bytes; the batch is then decoded and
    augmented in this process. torchvision's read_file gave file-mapped tensors, which a worker cannot send: the
    loader waited forever."""
    root = make_image_folder(tmp_path, {"a": 4, "b": 4}, splits=("train", "val"), size=48, ext=".jpg")
    dm = ImageFolderDataModule(str(root), batch_size=4, num_workers=1, image_size=32, preset="imagenet",
                               augment_on_device=True, persistent_workers=False, scan_cache=False)
    dm.setup("fit")
    x, y, *_ = next(iter(dm.train_dataloader()))
    assert isinstance(x, list) and len(x) == 4 and all(item.dtype == torch.uint8 for item in x)
    batch = dm.device_batches.augment(x, "cpu", train=True, seed=0)
    assert batch.shape == (4, 3, 32, 32) and y.shape == (4,)


def test_augment_on_device_seeds_the_cpus_generator_alone_and_restores_it(tmp_path, monkeypatch):
    """The device's augmentation draws each image's crop from the CPU's generator seeded by the draw's seed, and
    leaves every generator as it found it: torch.manual_seed (its first form) also reseeded the GPU's, whose dropout
    stream then followed the data's seeds, and on a CPU machine it queued each seeding with a captured stack trace
    (70% of the augmentation's time on 40x30 images)."""
    root = make_image_folder(tmp_path, {"a": 2, "b": 2}, splits=("train", "val"), size=48, ext=".jpg")
    dm = ImageFolderDataModule(str(root), batch_size=4, num_workers=0, image_size=32, preset="imagenet",
                               augment_on_device=True, scan_cache=False)
    dm.setup("fit")
    items = next(iter(dm.train_dataloader()))[0]
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    before = torch.get_rng_state()
    per_image = dm.device_batches.augment(items, "cpu", train=True, seed=[5, 6, 7, 8])
    one = dm.device_batches.augment(items, "cpu", train=True, seed=9)
    assert seeded == [] and torch.equal(torch.get_rng_state(), before)
    for i, seed in enumerate([5, 6, 7, 8]):  # image i drawn as alone after its own seed
        assert torch.equal(per_image[i], dm.device_batches.augment(items[i:i + 1], "cpu", train=True, seed=[seed])[0])
    assert torch.equal(one, dm.device_batches.augment(items, "cpu", train=True, seed=9))
