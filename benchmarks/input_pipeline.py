"""Input pipeline: images/s of the DataModule's training loader against torchvision ImageFolder + PIL + transforms v1.

    python -m benchmarks.run --only input_pipeline [--quick]

Data: photo-like 500x375 JPEGs (the mean ImageNet size) written once to the temp folder. Every loader does the
ImageNet training recipe at 224 px (RandomResizedCrop, horizontal flip, collate); the baseline and the float
variants also convert to float and normalize in the loader, the DataModule leaves that to the device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from torch.utils.data import DataLoader, Dataset
from torchvision import datasets
from torchvision import transforms as T

from benchmarks.common import (
    auto_cpu_precision,
    cores,
    interleaved,
    lap_times,
    mean_jpeg_kb,
    one_torch_thread,
    photo_folder,
    table,
    verdict,
)
from benchmarks.compute_levers import train_step
from datamodules import ClassificationPresetTrain, ImageFolderDataModule
from datamodules.decoding import load_rgb
from datamodules.presets import IMAGENET_MEAN, IMAGENET_STD

BASELINE = "torchvision ImageFolder + PIL + transforms v1 (baseline)"
DATAMODULE = "DataModule (defaults): torchvision.io decode, v2 uint8 crop, uint8 batches"
FAST_DECODE = "DataModule, data.fast_decode: libjpeg-turbo fast decode"
READ_ONLY = "DataModule, augment_on_device: workers read the files only"
TITLE = "Input pipeline"
NORMALIZE = "the same + float/normalize on this CPU (the device here)"
# ResNet-50 training throughput on one A100 with AMP (NVIDIA's reference), to size the loader for a GPU.
A100_IMAGES_PER_S = 2470


class _PilFiles(Dataset):
    """The pipeline before torchvision.io decoding: PIL decode, then the v2 preset (float output)."""

    def __init__(self, samples, transform) -> None:
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        return self.transform(load_rgb(path)), target


def loaders(root, size: int, batch: int, workers: int) -> dict[str, tuple[Callable[[], DataLoader], Callable]]:
    """name -> (make a loader, what runs on the batch after the loader: the device stage, or nothing)."""
    common = dict(batch_size=batch, shuffle=True, drop_last=True, num_workers=workers)
    v1 = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def datamodule(on_device: bool = True, **options) -> ImageFolderDataModule:
        dm = ImageFolderDataModule(root=str(root), batch_size=batch, num_workers=workers, image_size=size,
                                   persistent_workers=False, normalize_on_device=on_device, **options)
        dm.setup("fit")
        return dm

    float_dm, fast_dm = datamodule(on_device=False), datamodule()
    decode_dm, device_dm = datamodule(fast_decode=True), datamodule(augment_on_device=True)
    pil = _PilFiles(float_dm.train_set.samples, ClassificationPresetTrain(image_size=size))

    def identity(batch):
        return batch

    def normalize(batch):
        return fast_dm.on_after_batch_transfer(batch, 0)

    def augment(batch):  # what the device does with augment_on_device; here the device is this CPU
        x, y, seeds = batch  # each draw's seed, as in training
        on_device = device_dm.device_batches
        return on_device.float_stage(on_device.augment(x, "cpu", train=True, seed=seeds.tolist())), y

    return {
        BASELINE: (lambda: DataLoader(datasets.ImageFolder(str(root / "train"), transform=v1), **common), identity),
        "PIL decode + v2 uint8 crop, float in loader": (lambda: DataLoader(pil, **common), identity),
        "DataModule, float batches from the loader (normalize_on_device false)": (float_dm.train_dataloader, identity),
        DATAMODULE: (fast_dm.train_dataloader, identity),
        NORMALIZE: (fast_dm.train_dataloader, normalize),
        FAST_DECODE: (decode_dm.train_dataloader, identity),
        READ_ONLY: (device_dm.train_dataloader, identity),
        "the same + decode, augment, normalize on this CPU (the device here)": (device_dm.train_dataloader, augment),
    }


def per_image_laps(make: Callable[[], DataLoader], after: Callable, batches: int) -> list[float]:
    """Seconds per image of each batch, loaded in this process (num_workers=0)."""
    it, laps = iter(make()), []
    for _ in range(batches):
        start = time.perf_counter()
        x, *_ = after(next(it))  # (x, y), or for augment_on_device read-only (files, y, seeds)
        laps.append((time.perf_counter() - start) / len(x))
    return laps


def per_image_with_workers(make: Callable[[], DataLoader], batches: int, skip: int) -> list[float]:
    """Seconds per image over `batches` batches once `skip` have arrived (worker start-up is not counted).

    One figure per run, not per batch: workers finish their batches at about the same time, so single
    batches arrive in bursts and only the total rate is meaningful.
    """
    it = iter(make())
    for _ in range(skip):
        next(it)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        images += len(next(it)[0])
    seconds = time.perf_counter() - start
    del it  # shuts the workers down
    return [seconds / images]


def main(quick: bool = False) -> dict:
    count, (w, h) = (50, (160, 120)) if quick else (2000, (500, 375))
    # One batch per turn, many turns: bursts of load from other processes spread over every candidate alike.
    size, batch, batches, reps = (64, 8, 1, 2) if quick else (224, 64, 1, 24)
    root = photo_folder(count, width=w, height=h)

    # One core: the loader runs in this process (num_workers=0) with one torch thread, as in a loader worker
    # (DataLoader sets that), so images/s is per core.
    one = {name: (lambda m=make, a=after: per_image_laps(m, a, batches))
           for name, (make, after) in loaders(root, size, batch, 0).items()}
    with one_torch_thread():
        t1 = interleaved(one, reps)
    # All cores: worker processes; the first batches (worker start-up, first prefetch) are not counted.
    workers = cores()
    multi = loaders(root, size, batch, workers)
    worker_batches, worker_reps = (2, 1) if quick else (8, 5)
    tn = interleaved({name: (lambda m=multi[name][0]: per_image_with_workers(m, worker_batches, workers))
                      for name in (BASELINE, DATAMODULE, FAST_DECODE)}, worker_reps)

    # How many loader cores feed the training step: step images/s / loader images/s per core.
    arch, step_size, step_batch = ("resnet18", 64, 4) if quick else ("resnet50", 224, 8)
    precision = auto_cpu_precision()  # what the training step runs in here: bf16 only on a CPU with native bf16
    step = train_step(arch=arch, size=step_size, batch=step_batch, channels_last=True, bf16=precision == "bf16-mixed")
    step()
    return {"images": count, "width": w, "height": h, "mean_jpeg_kb": mean_jpeg_kb(root), "size": size,
            "batch": batch, "reps": reps, "workers": workers, "worker_batches": worker_batches,
            "worker_reps": worker_reps, "s_per_image_1_core": t1, "s_per_image_workers": tn,
            "step": {"arch": arch, "size": step_size, "batch": step_batch, "precision": precision,
                     "img_s": step_batch / min(lap_times(2, step))}}


def render(r: dict) -> tuple[str, str]:
    t1, tn, workers, step = r["s_per_image_1_core"], r["s_per_image_workers"], r["workers"], r["step"]
    # The read-only row moves decoding to the device: a ratio against a loader that decodes would mislead.
    rows = [[name, 1 / t, t1[BASELINE] / t if name != READ_ONLY else "(decodes nothing)",
             1 / tn[name] if name in tn else "", tn[BASELINE] / tn[name] if name in tn else ""]
            for name, t in t1.items()]
    body = table(["loader", "img/s, 1 core", "vs baseline (target >= 2x)", f"img/s, {workers} workers",
                  f"vs baseline, {workers} workers"], rows)
    default, fast = t1[BASELINE] / t1[DATAMODULE], t1[BASELINE] / t1[FAST_DECODE]
    body += (f"\n\nTarget, at least 2x the baseline per core: {default:.2f}x with the defaults "
             f"({verdict(default >= 2)}), {fast:.2f}x with `data.fast_decode` ({verdict(fast >= 2)}).")
    step_rate, loader_rate, fast_rate = step["img_s"], 1 / t1[NORMALIZE], 1 / t1[DATAMODULE]
    body += (
        f"\n\nFeeding the model: the {step['arch']} training step ({step['precision']}, channels_last, batch "
        f"{step['batch']}) runs at {step_rate:.1f} img/s on this CPU, so "
        f"{max(1, math.ceil(step_rate / loader_rate))} loader worker ({step_rate / loader_rate:.2g} of a core) keeps "
        f"it fed at {step['size']} px. A GPU that trains ResNet-50 at {A100_IMAGES_PER_S:,} img/s (one A100, AMP) "
        f"needs {math.ceil(A100_IMAGES_PER_S / fast_rate)} cores of this speed at {fast_rate:.0f} img/s each "
        f"({math.ceil(A100_IMAGES_PER_S * t1[FAST_DECODE])} with data.fast_decode, "
        f"{math.ceil(A100_IMAGES_PER_S * t1[BASELINE])} with the baseline loader): set data.num_workers to that, or "
        "as many CPUs as the node gives each GPU. With `data.augment_on_device` a worker core only reads files "
        f"({1 / t1[READ_ONLY]:,.0f} img/s), and decoding (nvJPEG) and augmentation move to the GPU: "
        "`benchmarks/gpu_throughput.py` measures that side on CUDA."
    )
    return body, (f"{r['images']} photo-like {r['width']}x{r['height']} JPEGs (mean {r['mean_jpeg_kb']:.0f} KB), "
                  f"{r['size']} px RandomResizedCrop + flip, batch {r['batch']}; 1 core: medians of {r['reps']} "
                  f"interleaved batches, one torch thread; {workers} workers: medians of {r['worker_reps']} "
                  f"interleaved runs of {r['worker_batches']} batches after start-up")


def figures(r: dict) -> dict[str, str]:
    """The DataModule's images/s per core over the baseline's, with its defaults and with data.fast_decode."""
    t1 = r["s_per_image_1_core"]
    return {"defaults_vs_baseline": f"{t1[BASELINE] / t1[DATAMODULE]:.2f}x",
            "fast_decode_vs_baseline": f"{t1[BASELINE] / t1[FAST_DECODE]:.2f}x"}

