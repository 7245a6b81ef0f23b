"""Input pipeline profile: where a training image's CPU time goes, stage by stage, in the baseline loader and in the
DataModule's, and the bound that decoding sets on how much faster the DataModule's loader can get.

    python -m benchmarks.run --only input_profile [--quick]

Data: the photo-like 500x375 JPEGs of benchmarks/input_pipeline.py. Each stage of each pipeline runs on every image
in turn, timed in this thread's CPU time (`time.thread_time`), so other processes on the machine do not inflate it;
one torch thread, as in a loader worker. Stages: read (the file's bytes), decode, crop and resize (the ImageNet
training recipe's RandomResizedCrop at 224 px), flip, to-tensor (PIL image -> float tensor, the baseline only),
normalize (the baseline only: the DataModule does it on the device), and collate (a batch stacked, per image).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from benchmarks import input_pipeline
from benchmarks.common import one_torch_thread, photo_folder, table, verdict
from datamodules.datasets import stack_images
from datamodules.decoding import decode_for_crop, read_encoded
from datamodules.presets import IMAGENET_MEAN, IMAGENET_STD, RandomResizedCropFlip

TITLE = "Input pipeline profile"
STAGES = ("read", "decode", "crop + resize", "flip", "to tensor", "normalize", "collate")
BASELINE = "baseline: PIL + transforms v1"
EXACT = "DataModule (defaults)"
FAST = "DataModule, data.fast_decode"


class _Clock:
    """Per-stage CPU seconds of this thread, summed over the images."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def __call__(self, stage: str, fn: Callable, *args):
        start = time.thread_time()
        out = fn(*args)
        self.seconds[stage] += time.thread_time() - start
        return out


def baseline(paths: list[str], size: int, batch: int, clock: _Clock) -> None:
    crop, flip = T.RandomResizedCrop(size), T.RandomHorizontalFlip()
    to_tensor, normalize = T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    images = []
    for path in paths:
        data = clock("read", lambda p: open(p, "rb").read(), path)
        image = clock("decode", lambda d: Image.open(io.BytesIO(d)).convert("RGB"), data)
        image = clock("crop + resize", crop, image)
        image = clock("flip", flip, image)
        tensor = clock("to tensor", to_tensor, image)
        images.append(clock("normalize", normalize, tensor))
        if len(images) == batch:
            clock("collate", torch.stack, images)
            images = []


def datamodule(paths: list[str], size: int, batch: int, clock: _Clock, fast: bool) -> None:
    """The steps of the DataModule's training transform (`RandomResizedCropFlip` on a JPEG's bytes), one by one."""
    recipe = RandomResizedCropFlip(size, fast_decode=fast)
    images = []
    for path in paths:
        encoded = clock("read", read_encoded, path)
        if fast:  # the crop is drawn from the header, then the JPEG decoded at the scale the crop allows
            image, params = clock("decode", lambda e: decode_for_crop(e, recipe._params, recipe.crop.size, fast=True),
                                  encoded)
        else:
            image = clock("decode", decode_jpeg, encoded, ImageReadMode.RGB)
            params = recipe._params(image.shape[-2], image.shape[-1])

        def crop_resize(image=image, params=params):
            crop = F.crop(image, **params).unsqueeze(0).contiguous(memory_format=torch.channels_last)
            return F.resize(crop, recipe.crop.size, antialias=True)[0]

        image = clock("crop + resize", crop_resize)
        images.append(clock("flip", lambda i: F.horizontal_flip(i) if torch.rand(1) < 0.5 else i, image))
        if len(images) == batch:
            clock("collate", stack_images, images)
            images = []


def whole_loader(make: Callable, batches: int) -> float:
    """CPU seconds of this thread per image for `batches` batches of a loader that runs in this process."""
    it = iter(make())
    start, images = time.thread_time(), 0
    for _ in range(batches):
        images += len(next(it)[0])
    return (time.thread_time() - start) / images


def main(quick: bool = False) -> dict:
    count, (w, h) = (50, (160, 120)) if quick else (2000, (500, 375))
    size, batch, images, reps = (64, 8, 16, 1) if quick else (224, 64, 512, 3)
    root = photo_folder(count, width=w, height=h)
    paths = sorted(str(p) for p in root.glob("train/*/*.jpg"))[:images]
    runs = {BASELINE: lambda c: baseline(paths, size, batch, c),
            EXACT: lambda c: datamodule(paths, size, batch, c, fast=False),
            FAST: lambda c: datamodule(paths, size, batch, c, fast=True)}
    seconds = {name: [] for name in runs}
    torch.manual_seed(0)
    with one_torch_thread():
        for _ in range(reps):  # interleaved turns; the fastest turn of each stage (least disturbed caches)
            for name, run in runs.items():
                clock = _Clock()
                run(clock)
                seconds[name].append(clock.seconds)
    per_image = {name: {stage: min(turn[stage] for turn in turns) / len(paths) for stage in STAGES}
                 for name, turns in seconds.items()}
    # The same pipelines as whole loaders (num_workers=0: in this thread): what the stages leave out is the loader's
    # own work per sample (sampler, dataset indexing, per-sample seeding, the fetch loop).
    made = input_pipeline.loaders(root, size, batch, 0)
    names = {BASELINE: input_pipeline.BASELINE, EXACT: input_pipeline.DATAMODULE, FAST: input_pipeline.FAST_DECODE}
    with one_torch_thread():
        whole = {name: min(whole_loader(made[key][0], len(paths) // batch) for _ in range(reps))
                 for name, key in names.items()}
    return {"images": len(paths), "width": w, "height": h, "size": size, "batch": batch, "reps": reps,
            "s_per_image": per_image, "s_per_image_whole_loader": whole}


def render(r: dict) -> tuple[str, str]:
    p = r["s_per_image"]
    total = {name: sum(stages.values()) for name, stages in p.items()}
    rows = [[stage, *(f"{1e3 * p[name][stage]:.2f} ms ({p[name][stage] / total[name]:.0%})" for name in p)]
            for stage in STAGES]
    rows.append(["**sum of the stages**", *(f"{1e3 * total[name]:.2f} ms" for name in p)])
    whole = r["s_per_image_whole_loader"]
    rows.append(["the whole loader (in this thread)", *(f"{1e3 * whole[name]:.2f} ms" for name in p)])
    rows.append(["loader's own work (whole - stages)", *(f"{1e3 * (whole[name] - total[name]):.2f} ms" for name in p)])
    body = table(["stage (CPU time per image)", *p], rows)
    speedup = {name: total[BASELINE] / total[name] for name in (EXACT, FAST)}
    bound = {name: total[BASELINE] / (p[name]["read"] + p[name]["decode"]) for name in (EXACT, FAST)}
    loader_speedup = {name: whole[BASELINE] / whole[name] for name in (EXACT, FAST)}
    own = (whole[EXACT] - total[EXACT]) / whole[EXACT]
    body += (
        f"\n\nImages per CPU second over the baseline's: {loader_speedup[EXACT]:.2f}x for the DataModule's whole "
        f"loader ({loader_speedup[FAST]:.2f}x with `data.fast_decode`), {speedup[EXACT]:.2f}x for its stages alone "
        f"({speedup[FAST]:.2f}x). The loader's own work per sample (sampler, dataset, per-sample seeding, fetch) is "
        f"{own:.0%} of the DataModule's whole time. Reading and decoding take "
        f"{(p[EXACT]['read'] + p[EXACT]['decode']) / total[EXACT]:.0%} of its stages: even if every other stage and "
        f"the loader's own work were free, an exact full-size decode would cap the gain at **{bound[EXACT]:.2f}x** "
        f"the baseline per core ({verdict(bound[EXACT] >= 2)} as a bound for the 2x target), and the fast decode "
        f"at reduced size at **{bound[FAST]:.2f}x** ({verdict(bound[FAST] >= 2)})."
    )
    settings = (f"{r['images']} photo-like {r['width']}x{r['height']} JPEGs, {r['size']} px RandomResizedCrop + flip, "
                f"batch {r['batch']}, one torch thread; each stage's CPU time of this thread, the least of "
                f"{r['reps']} interleaved turns")
    return body, settings


def figures(r: dict) -> dict[str, str]:
    """The cap that decoding puts on the DataModule's speed-up over the baseline, per core."""
    p = r["s_per_image"]
    total = sum(p[BASELINE].values())
    return {name: f"{total / (p[key]['read'] + p[key]['decode']):.2f}x"
            for name, key in (("decode_bound", EXACT), ("fast_decode_bound", FAST))}

