"""Streaming shards: images/s of the training loader from LitData shards (`datamodules.ShardsDataModule`) against
from the image folder they were converted from, on the same disk, and the conversion's own rate.

    python -m benchmarks.run --only shards [--quick]

Data: the input-pipeline benchmark's photo-like 500x375 JPEGs, converted by `imgcls prepare-data` into a temporary
folder beside them. Both loaders are the DataModule's with its defaults (ImageNet recipe at 224 px: decode,
RandomResizedCrop, flip, uint8 batches); the read-only rows (`data.augment_on_device`) only read each file or sample,
which isolates what the storage format changes. Every file is in the page cache: this measures the formats on one
local disk, not a network file system or a bucket, where the shards' few large reads matter most.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from torch.utils.data import DataLoader

from benchmarks.common import cores, interleaved, mean_jpeg_kb, one_torch_thread, photo_folder, table
from benchmarks.input_pipeline import per_image_with_workers
from datamodules import ImageFolderDataModule
from datamodules.bad_images import ScanCache

TITLE = "Streaming shards"
FOLDER = "image folder (ImageFolderDataModule)"
SHARDS = "LitData shards (ShardsDataModule)"
FOLDER_READ = "image folder, read only (augment_on_device)"
SHARDS_READ = "LitData shards, read only (augment_on_device)"


def loaders(folder: Path, shards: Path, size: int, batch: int, workers: int) -> dict[str, Callable[[], DataLoader]]:
    """name -> a function making that training loader (a new one, and new workers, each call)."""
    from datamodules.shards import ShardsDataModule  # here, not at the top: the figures import this module for its
    # TITLE, also where LitData is not installed (a lent GPU machine rendering its own sections)

    def make(root: Path, source: type, read_only: bool) -> Callable[[], DataLoader]:
        dm = source(root=str(root), batch_size=batch, num_workers=workers, image_size=size, persistent_workers=False,
                    augment_on_device=read_only)
        dm.setup("fit")
        return dm.train_dataloader

    # The labels are the stored results' names of the two sources.
    return {FOLDER: make(folder, ImageFolderDataModule, False), SHARDS: make(shards, ShardsDataModule, False),
            FOLDER_READ: make(folder, ImageFolderDataModule, True), SHARDS_READ: make(shards, ShardsDataModule, True)}


def per_image_after_one(make: Callable[[], DataLoader], batches: int | None = 1) -> list[float]:
    """Seconds per image of `batches` batches (None: the rest of the epoch) loaded in this process, after a first
    one (the iterator's start-up)."""
    it = iter(make())
    next(it)
    start, images = time.perf_counter(), 0
    for batch in itertools.islice(it, batches):
        images += len(batch[0])
    return [(time.perf_counter() - start) / images]


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def main(quick: bool = False) -> dict:
    from datamodules.shards import prepare_data

    count, (w, h) = (50, (160, 120)) if quick else (2000, (500, 375))
    size, batch, reps = (64, 8, 1) if quick else (224, 64, 24)
    workers, worker_batches, worker_reps = (1, 1, 1) if quick else (cores(), 8, 9)
    folder = photo_folder(count, width=w, height=h)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix="imgcls-bench-shards-") as tmp:
        shards = Path(tmp) / "shards"
        for file in ScanCache(folder, "prepare-data").files:  # a first conversion: every image decoded by its scan
            file.unlink(missing_ok=True)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # its summary lines; LitData's own progress goes to stderr
            meta = prepare_data(folder, shards, num_workers=workers)
        convert_s = time.perf_counter() - start
        # One core: each loader in this process (num_workers 0) with one torch thread, as a loader worker has.
        # Reading alone takes a few ms a batch: a lap is the rest of the epoch (the chunks' openings included), so
        # that it outlasts the scheduler's hiccups.
        one = {name: (lambda m=make, n=None if "read only" in name else 1: per_image_after_one(m, n))
               for name, make in loaders(folder, shards, size, batch, 0).items()}
        with one_torch_thread():
            t1 = interleaved(one, reps)
        # Worker processes: the first batches (start-up, first prefetch) are not counted. Not the folder's read-only
        # loader: its workers hang sending torchvision's read_file tensors (memory-mapped, no file descriptor to share).
        multi = loaders(folder, shards, size, batch, workers)
        tn = interleaved({name: (lambda m=multi[name]: per_image_with_workers(m, worker_batches, workers))
                          for name in (FOLDER, SHARDS)}, worker_reps)
        return {"images": sum(meta["counts"].values()), "train_images": meta["counts"]["train"], "width": w,
                "height": h, "mean_jpeg_kb": mean_jpeg_kb(folder), "size": size, "batch": batch, "reps": reps,
                "workers": workers, "worker_batches": worker_batches, "worker_reps": worker_reps,
                "convert_s": convert_s, "folder_bytes": folder_bytes(folder / "train") + folder_bytes(folder / "val"),
                "shards_bytes": folder_bytes(shards), "s_per_image_1_core": t1, "s_per_image_workers": tn}


def render(r: dict) -> tuple[str, str]:
    t1, tn, workers = r["s_per_image_1_core"], r["s_per_image_workers"], r["workers"]
    rows = [[name, 1 / t1[name], 1 / tn[name] if name in tn else "(not run)"] for name in t1]
    rows += [["shards / folder (decode + augment)", t1[FOLDER] / t1[SHARDS], tn[FOLDER] / tn[SHARDS]],
             ["shards / folder (read only)", t1[FOLDER_READ] / t1[SHARDS_READ], ""]]
    body = table(["loader", "img/s, 1 core", f"img/s, {workers} workers"], rows)
    body += (
        f"\n\nBoth loaders decode and augment the same bytes the same way, so on one local disk with every file "
        f"cached what differs is the storage format: the shards give {tn[FOLDER] / tn[SHARDS]:.2f}x the folder's "
        f"images/s on {workers} workers; reading alone, a sample from a memory-mapped chunk against an open, read and "
        f"close per file, {t1[FOLDER_READ] / t1[SHARDS_READ]:.2f}x per core. On a network file system or a bucket "
        "each file's open and request is a round trip, and there the shards' few large reads are the point; that was "
        f"not measured here. Converting took {r['convert_s']:.1f} s for {r['images']:,} images "
        f"({r['images'] / r['convert_s']:.0f} img/s: every image decoded once to find bad files, then copied into "
        f"chunks by {workers} processes); the shards hold {r['shards_bytes'] / 2**20:.1f} MB for the folder's "
        f"{r['folder_bytes'] / 2**20:.1f} MB."
    )
    return body, (f"{r['train_images']} photo-like {r['width']}x{r['height']} training JPEGs (mean "
                  f"{r['mean_jpeg_kb']:.0f} KB) and their shards, on the same disk; {r['size']} px, "
                  f"batch {r['batch']}; "
                  f"1 core: medians of {r['reps']} interleaved laps of a batch (read only: of the epoch) after a "
                  "first one, one torch thread; "
                  f"{workers} workers: medians of {r['worker_reps']} interleaved runs of {r['worker_batches']} batches "
                  "after start-up")


def figures(r: dict) -> dict[str, str]:
    """Images/s on all cores from the folder and from the shards, their ratio, and the conversion's rate."""
    t1, tn = r["s_per_image_1_core"], r["s_per_image_workers"]
    return {"folder_img_s": f"{1 / tn[FOLDER]:.0f} img/s", "shards_img_s": f"{1 / tn[SHARDS]:.0f} img/s",
            "shards_vs_folder": f"{tn[FOLDER] / tn[SHARDS]:.2f}x",
            "read_only_shards_vs_folder": f"{t1[FOLDER_READ] / t1[SHARDS_READ]:.2f}x",
            "convert_img_s": f"{r['images'] / r['convert_s']:.0f} img/s", "workers": str(r["workers"])}

