"""GPU throughput: ResNet-50 training images/s and estimated FLOP utilisation on a CUDA device; skips without one.

    python -m benchmarks.run --only gpu_throughput [--quick]

The step is the production recipe's compute: channels_last, fp16 autocast, torch.compile and fused SGD, on a
synthetic batch already on the GPU and without the fit's GradScaler, normalisation and metrics, so the figure is the
compute ceiling the input pipeline has to feed. Then the GPU side of `data.augment_on_device` (nvJPEG decode,
RandomResizedCrop, flip, normalize) on photo-like JPEGs.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import photo_folder, table
from benchmarks.compute_levers import train_step
from datamodules import ImageFolderDataModule

TITLE = "GPU throughput"
# Dense fp16/bf16 tensor-core peaks (FLOP/s) of common training GPUs, from the vendors' data sheets.
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "L40S": 362e12, "A10": 125e12, "V100": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12}


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def step_flops(batch: int, arch: str, size: int, device: str) -> float:
    """FLOPs of one training step (forward and backward), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    step = train_step(arch=arch, size=size, batch=batch, device=device)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


def device_augment_rate(batch: int, batches: int, count: int, size: int, device: str) -> float:
    """Images/s of `DeviceBatches.augment` on the device: files read beforehand, so only the device's work is timed."""
    dm = ImageFolderDataModule(root=str(photo_folder(count)), batch_size=batch, num_workers=0, image_size=size,
                               augment_on_device=True)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    read = [next(loader)[0] for _ in range(batches)]

    def run(items):
        return dm.device_batches.float_stage(dm.device_batches.augment(items, device, train=True))

    run(read[0])  # warm-up: nvJPEG handles, kernels
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for items in read:
        run(items)
    sync()
    return batch * batches / (time.perf_counter() - start)


def main(quick: bool = False) -> dict:
    """A full run needs CUDA and is skipped without it; quick: tiny sizes on whatever device there is, no compile
    on a CPU (a check that the section runs, not a figure)."""
    cuda = torch.cuda.is_available()
    if not quick and not cuda:
        return {"skipped": "no CUDA device on this machine", "needs": "cuda"}
    device = "cuda" if cuda else "cpu"
    arch, size, batch, steps = ("resnet50", 224, 256, 30) if not quick else (
        ("resnet50", 224, 32, 3) if cuda else ("resnet18", 32, 4, 2))
    recipes = [("fp32, NCHW, eager", {}),
               ("channels_last + 16-mixed + fused SGD", {"channels_last": True, "bf16": True, "impl": "fused"})]
    if cuda:  # inductor on a CPU takes minutes, and a CPU's compiled step is the compute levers section's row
        recipes.append(("the same + torch.compile (production)", {"channels_last": True, "bf16": True,
                                                                   "impl": "fused", "compile": True}))
    img_s = {}
    for label, options in recipes:
        step = train_step(arch=arch, size=size, batch=batch, device=device, **options)
        for _ in range(3):  # warm-up: cuDNN autotuning, compilation
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()  # synchronizes on CUDA
        img_s[label] = batch * steps / (time.perf_counter() - start)
    augment = device_augment_rate(batch=16 if quick else 256, batches=2 if quick else 7, count=50 if quick else 2000,
                                  size=size, device=device)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {"device": name, "arch": arch, "size": size, "batch": batch, "steps": steps, "img_s": img_s,
            "flop_per_image": step_flops(batch, arch, size, device) / batch, "peak_flops": peak_flops(name),
            "augment_img_s": augment}


def render(r: dict) -> tuple[str, str]:
    flops, peak = r["flop_per_image"], r["peak_flops"]
    rows = [[label, rate, f"{rate * flops / peak:.0%}" if peak else "unknown peak"]
            for label, rate in r["img_s"].items()]
    body = table(["recipe", "img/s", "FLOP utilisation"], rows)
    body += f"\n\n{flops / 1e9:.1f} GFLOP per image and step (forward + backward, counted)"
    body += f"; peak taken as {peak / 1e12:.0f} TFLOP/s (dense fp16)." if peak else "."
    body += (f"\n\nWith `data.augment_on_device`, this device decodes (nvJPEG on a GPU) and augments "
             f"{r['augment_img_s']:,.0f} img/s of 500x375 JPEGs to {r.get('size', 224)} px, besides training; the "
             "loader workers only read the files.")
    return body, (f"{r['device']}, {r.get('arch', 'resnet50')} at {r.get('size', 224)} px, batch {r['batch']}, "
                  f"{r['steps']} timed steps, synthetic data on the device")

