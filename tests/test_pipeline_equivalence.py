"""The fast input pipeline gives the same tensors as the reference transform math: no silent changes."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from datamodules import ImageFolderDataModule
from datamodules.datasets import stack_images
from datamodules.decoding import decode_for_crop, load_rgb, read_encoded, read_image
from datamodules.presets import (
    PRESETS,
    ClassificationPresetEval,
    ClassificationPresetTrain,
    RandomResizedCropFlip,
    float_stage,
    normalization,
)
from tests.helpers import make_image_folder


def _photo(path, mode: str = "RGB", size=(120, 90)) -> str:
    """A smooth, photo-like JPEG (random noise JPEGs are not what cameras write)."""
    rng = np.random.default_rng(len(str(path)))
    base = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
    base.convert(mode).save(path, quality=90)
    return str(path)


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_read_image_jpeg_equals_pil_decode(tmp_path, mode):
    path = _photo(tmp_path / "img.jpg", mode)
    fast = read_image(path)
    reference = torch.from_numpy(np.array(load_rgb(path))).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W)
    assert fast.dtype == torch.uint8 and fast.shape == (3, 90, 120)
    assert torch.equal(fast, reference)


def test_read_image_falls_back_to_pil(tmp_path):
    png = tmp_path / "a.png"
    Image.fromarray(np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 20).save(png)  # 16-bit grayscale
    assert torch.equal(read_image(str(png)), torch.from_numpy(np.array(load_rgb(str(png)))).permute(2, 0, 1))
    mislabeled = tmp_path / "b.jpg"  # a PNG named .jpg: libjpeg refuses it, PIL reads it
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(mislabeled, format="PNG")
    assert read_image(str(mislabeled)).shape == (3, 8, 8)
    broken = tmp_path / "c.jpg"
    broken.write_bytes(b"not an image")
    with pytest.raises(OSError, match="c.jpg"):
        read_image(str(broken))


@pytest.mark.parametrize("preset", PRESETS)
def test_eval_uint8_path_then_device_float_equals_float_path(tmp_path, preset):
    path = _photo(tmp_path / "img.jpg", size=(75, 50))
    reference = ClassificationPresetEval(preset=preset, image_size=32)(load_rgb(path))  # the PIL -> float path
    fast = ClassificationPresetEval(preset=preset, image_size=32, uint8_output=True)(read_image(path))
    assert fast.dtype == torch.uint8
    batch = torch.stack([fast, fast])  # (2, 3, 32, 32): the device stage runs on whole batches
    assert torch.equal(float_stage(*normalization(preset))(batch)[1], reference)


@pytest.mark.parametrize("preset", PRESETS)
def test_train_uint8_path_with_same_randomness_equals_float_path(tmp_path, preset):
    path = _photo(tmp_path / "img.jpg", size=(75, 50))
    torch.manual_seed(3)
    reference = ClassificationPresetTrain(preset=preset, image_size=32)(load_rgb(path))
    torch.manual_seed(3)
    fast = ClassificationPresetTrain(preset=preset, image_size=32, uint8_output=True)(read_image(path))
    assert torch.equal(float_stage(*normalization(preset))(fast.unsqueeze(0))[0], reference)


def test_the_float_stage_matches_reference_normalization():
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(float_stage(*normalization("imagenet"))(x), (x.float() / 255 - mean) / std, rtol=0,
                               atol=1e-6)
    assert torch.equal(float_stage(*normalization("none"))(x), v2.functional.to_dtype(x, torch.float32, scale=True))


def test_datamodule_batches_match_with_and_without_normalize_on_device(tmp_path):
    root = make_image_folder(tmp_path / "data", {"a": 3, "b": 3}, size=40, ext=".jpg")
    batches = {}
    for on_device in (True, False):
        dm = ImageFolderDataModule(root=str(root), batch_size=6, num_workers=0, image_size=32,
                                   normalize_on_device=on_device)
        dm.setup("validate")
        x, y = next(iter(dm.val_dataloader()))
        assert x.dtype == (torch.uint8 if on_device else torch.float32)
        batches[on_device] = dm.on_after_batch_transfer((x, y), 0)
    assert torch.equal(batches[True][0], batches[False][0])
    assert torch.equal(batches[True][1], batches[False][1])


@pytest.mark.parametrize("augment_on_device", [False, True])
def test_trainer_feeds_the_model_normalized_floats(tmp_path, augment_on_device):
    """The hooks run inside Lightning's loops: training and validation steps see float32, normalized batches."""
    root = make_image_folder(tmp_path / "data", {"a": 2, "b": 2}, size=40, ext=".jpg")
    dm = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=32,
                               augment_on_device=augment_on_device)
    seen = {}

    class Probe(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            seen["train"] = batch[0]
            return (self.w * batch[0].mean()).sum()

        def validation_step(self, batch, batch_idx):
            seen["val"] = batch[0]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0).fit(Probe(), datamodule=dm)
    for x in seen.values():
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and x.min() < 0  # normalized: below zero


def test_crop_flip_draws_what_the_v2_transforms_draw(tmp_path):
    """RandomResizedCropFlip skips v2's dispatch, not its randomness: the same seed, the same pixels."""
    path = _photo(tmp_path / "img.jpg", size=(200, 150))
    reference = v2.Compose([v2.RandomResizedCrop(64, antialias=True), v2.RandomHorizontalFlip()])
    fast = RandomResizedCropFlip(64)
    inputs = {"tensor": read_image(path), "PIL": load_rgb(path), "JPEG bytes": read_encoded(path)}
    assert inputs["JPEG bytes"].ndim == 1
    flipped = set()
    for seed in range(12):
        torch.manual_seed(seed)
        expected = reference(read_image(path))
        for name, image in inputs.items():
            torch.manual_seed(seed)
            got = fast(image)
            assert torch.equal(got, expected), (seed, name)
        torch.manual_seed(seed)  # the same crop without the flip's draw: did this seed flip?
        flipped.add(not torch.equal(expected, v2.RandomResizedCrop(64, antialias=True)(read_image(path))))
    assert flipped == {False, True}  # both branches of the flip were compared
    assert got.stride(0) == 1  # (3, S, S) stored HWC: channels_last batches without a copy


def test_fast_decode_stays_close_to_the_exact_decode(tmp_path):
    path = _photo(tmp_path / "img.jpg", size=(500, 375))
    for size, limit in ((224, 3.0), (64, 12.0)):  # 64 px: most crops are decoded at 1/2 to 1/8 scale
        exact, fast = RandomResizedCropFlip(size), RandomResizedCropFlip(size, fast_decode=True)
        for seed in range(8):
            torch.manual_seed(seed)
            reference = exact(read_encoded(path))
            torch.manual_seed(seed)
            got = fast(read_encoded(path))
            assert got.shape == reference.shape == (3, size, size) and got.dtype == torch.uint8
            assert not torch.equal(got, reference)  # really the fast path
            assert (got.float() - reference.float()).abs().mean() < limit  # grey levels of 255


def test_fast_decode_decodes_at_reduced_size_only_when_the_crop_allows_it(tmp_path):
    encoded = read_encoded(_photo(tmp_path / "img.jpg", size=(512, 384)))

    def whole(height, width):
        return dict(top=0, left=0, height=height, width=width)

    for size, shape in ((32, (48, 64)), (96, (96, 128)), (192, (192, 256)), (200, (384, 512))):
        image, crop = decode_for_crop(encoded, whole, (size, size), fast=True)
        assert tuple(image.shape[1:]) == shape and (crop["height"], crop["width"]) == shape
    image, crop = decode_for_crop(encoded, whole, (32, 32), fast=False)
    assert torch.equal(image, read_image(str(tmp_path / "img.jpg"))) and crop["height"] == 384


def test_fast_decode_converts_cmyk_and_leaves_non_jpegs_to_the_exact_decoder(tmp_path):
    cmyk = _photo(tmp_path / "cmyk.jpg", "CMYK", size=(80, 60))
    png = tmp_path / "png.jpg"  # a PNG named .jpg: no JPEG header, decoded by PIL as read_image does
    Image.fromarray(np.full((40, 40, 3), 9, np.uint8)).save(png, format="PNG")
    for path, limit in ((cmyk, 3.0), (str(png), 0.0)):
        torch.manual_seed(0)
        expected = RandomResizedCropFlip(32)(read_image(path))
        torch.manual_seed(0)
        got = RandomResizedCropFlip(32, fast_decode=True)(read_encoded(path))
        assert (got.float() - expected.float()).abs().mean() <= limit, path


def test_stack_images_is_torch_stack_in_channels_last():
    planar = [torch.randint(0, 256, (3, 8, 6), dtype=torch.uint8) for _ in range(4)]
    interleaved = [x.unsqueeze(0).contiguous(memory_format=torch.channels_last)[0] for x in planar]
    for images in (planar, interleaved):
        assert torch.equal(stack_images(images), torch.stack(planar))
    crops = [x[:, 1:5, 1:4] for x in interleaved]  # HWC views with strides of the larger image
    assert torch.equal(stack_images(crops), torch.stack(crops))
    assert stack_images(interleaved).is_contiguous(memory_format=torch.channels_last)


def test_datamodule_fast_decode_changes_training_images_only(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "val"):
        for c in "ab":
            (root / split / c).mkdir(parents=True)
            for i in range(3):
                _photo(root / split / c / f"{i}.jpg", size=(160 + 10 * i, 120))
    batches = {}
    for fast in (False, True):
        dm = ImageFolderDataModule(root=str(root), batch_size=6, num_workers=0, image_size=64, fast_decode=fast)
        dm.setup("fit")
        torch.manual_seed(5)
        train = next(iter(dm.train_dataloader()))
        batches[fast] = (train, next(iter(dm.val_dataloader())))
    (train_exact, val_exact), (train_fast, val_fast) = batches[False], batches[True]
    assert torch.equal(train_exact[1], train_fast[1]) and not torch.equal(train_exact[0], train_fast[0])
    assert (train_exact[0].float() - train_fast[0].float()).abs().mean() < 12.0
    assert torch.equal(val_exact[0], val_fast[0])  # evaluation is always decoded exactly
    with pytest.raises(ValueError, match="data.fast_decode"):
        ImageFolderDataModule(root=str(root), preset="none", fast_decode=True)


def _mixed_folder(root):
    """JPEGs of several sizes, a PNG, and a PNG named .jpg (the JPEG decoder refuses it; PIL reads it)."""
    for split in ("train", "val"):
        for c, name in enumerate("ab"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(3):
                _photo(folder / f"{i}.jpg", size=(60 + 9 * i + c, 45 + 4 * i))
            Image.fromarray(np.full((30, 40, 3), 50 * c, np.uint8)).save(folder / "p.png")
            Image.fromarray(np.full((20, 20, 3), 9, np.uint8)).save(folder / "q.jpg", format="PNG")
    return root


@pytest.mark.parametrize("preset", PRESETS)
def test_augment_on_device_gives_the_worker_batches(tmp_path, preset):
    """Decoding and augmenting after the transfer gives the tensors the workers would have made, draw for draw."""
    root = _mixed_folder(tmp_path / "data")
    batches = {}
    for on_device in (False, True):
        dm = ImageFolderDataModule(root=str(root), batch_size=10, num_workers=0, image_size=32, preset=preset,
                                   augment_on_device=on_device)
        dm.setup("fit")
        torch.manual_seed(7)
        x, y, *seeds = next(iter(dm.train_dataloader()))
        if on_device:  # each image's crop drawn from its draw's seed, as a worker draws it (SeededDraws)
            assert isinstance(x, list) and {t.ndim for t in x} == {1, 3}  # JPEGs read, not decoded; PNGs decoded
            assert len(seeds) == 1 and seeds[0].shape == (len(x),)
            x = dm.device_batches.augment(x, "cpu", train=True, seed=seeds[0].tolist())
        else:
            assert not seeds
        xv, yv = next(iter(dm.val_dataloader()))
        if on_device:
            xv = dm.device_batches.augment(xv, "cpu", train=False)
        batches[on_device] = (x, y, xv, yv)
    for fast, reference in zip(batches[True], batches[False], strict=True):
        assert torch.equal(fast, reference)


def test_augment_on_device_draws_from_the_given_seed_only(tmp_path):
    """With a seed, a batch's crops depend on it alone (exact resumes), and the global generator is left alone."""
    root = _mixed_folder(tmp_path / "data")
    dm = ImageFolderDataModule(root=str(root), batch_size=10, num_workers=0, image_size=32, augment_on_device=True)
    dm.setup("fit")
    items, *_ = next(iter(dm.train_dataloader()))  # files, targets, the draws' seeds
    torch.manual_seed(0)
    first = dm.device_batches.augment(items, "cpu", train=True, seed=11)
    state = torch.get_rng_state()
    torch.rand(5)  # what a model's dropout would draw in between
    again = dm.device_batches.augment(items, "cpu", train=True, seed=11)
    assert torch.equal(first, again)
    assert not torch.equal(first, dm.device_batches.augment(items, "cpu", train=True, seed=12))
    torch.set_rng_state(state)
    dm.device_batches.augment(items, "cpu", train=True, seed=13)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.cuda
def test_augment_on_device_on_cuda_matches_the_cpu_pipeline(tmp_path):
    """nvJPEG and the float resize on the GPU round differently from libjpeg-turbo and the uint8 CPU resize."""
    root = _mixed_folder(tmp_path / "data")
    dm = ImageFolderDataModule(root=str(root), batch_size=10, num_workers=0, image_size=32, augment_on_device=True)
    dm.setup("validate")
    items, y = next(iter(dm.val_dataloader()))
    gpu = dm.device_batches.augment(items, "cuda", train=False)
    cpu = dm.device_batches.augment(items, "cpu", train=False)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.uint8 and gpu.shape == cpu.shape
    assert (gpu.cpu().float() - cpu.float()).abs().mean() < 2.0  # grey levels of 255


def _fit_one_step(optimizer: str, impl: str) -> dict[str, torch.Tensor]:
    from functools import partial

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_modules import BackboneWithHead, ImageClassifier, Levers
    from lightning_modules.schedules import WarmupCosine

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,)))
    optimizer_class = {"sgd": partial(torch.optim.SGD, momentum=0.9, nesterov=True), "adamw": torch.optim.AdamW}
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                            batch_size=4, optimizer=partial(optimizer_class[optimizer], lr=0.5),
                            lr_scheduler=partial(WarmupCosine, warmup_epochs=0), levers=Levers(optimizer_impl=impl))
    L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model, DataLoader(data, batch_size=4))
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_foreach_and_fused_optimizers_give_the_default_update(optimizer):
    # One step: the fused AdamW kernel rounds differently (~1e-7), and Adam's division by sqrt(v) amplifies that
    # over later steps on parameters with tiny gradients, so one update is what can be compared exactly.
    reference = _fit_one_step(optimizer, "default")
    for impl in ("foreach", "fused"):
        got = _fit_one_step(optimizer, impl)
        changed = [k for k in reference if not torch.equal(reference[k], got[k])]
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6, msg=f"{impl} {optimizer}: {changed[:3]}")


def test_compile_option_keeps_checkpoint_keys():
    from functools import partial

    from lightning_modules import BackboneWithHead, ImageClassifier, Levers

    plain = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8))
    compiled = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                               levers=Levers(compile=True))
    compiled.configure_model()  # what the Trainer calls; compilation itself happens lazily at the first forward
    assert compiled.net._compiled_call_impl is not None and plain.net._compiled_call_impl is None
    assert list(compiled.state_dict()) == list(plain.state_dict())  # checkpoints load either way
    with pytest.raises(ValueError, match="optimizer_impl"):
        ImageClassifier(num_classes=3, levers=Levers(optimizer_impl="apex"))
