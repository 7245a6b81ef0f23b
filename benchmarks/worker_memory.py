"""Loader-worker memory: what one DataLoader worker gains in private memory over an epoch, samples in numpy arrays
(ImageFiles) against the list of (path, class) tuples that ImageFiles held before.

    python -m benchmarks.run --only worker_memory [--quick]

A forked worker shares its parent's pages until it writes to one; reading a Python object writes its reference count,
so a worker that reads every sample of a list copies every page of it (pytorch/pytorch#13246): ranks x workers
copies. Numpy arrays are two objects whatever their length, and their data pages are only read. Reading the image is
stubbed (it returns the worker's pid), since memory is measured here, not decoding; the paths are ImageNet-like.
Memory comes from /proc/PID/smaps_rollup: private dirty pages are the copies; USS (Private_Clean + Private_Dirty)
adds the file pages only this worker maps (code first run in it); RSS counts shared pages too, so it barely moves.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import table
from datamodules.datasets import ImageFiles, PathArray
from datamodules.samplers import worker_init

TITLE = "Loader-worker memory"
IMAGENET_TRAIN = 1_281_167
ARRAYS = "numpy arrays (ImageFiles now)"
LIST = "list of (path, class) tuples (before, baseline)"
FROZEN = ", gc.freeze() in the worker"


class ListFiles(Dataset):
    """The storage ImageFiles had before: a list of (path, class index) tuples, read by every worker."""

    def __init__(self, samples: list[tuple[str, int]], read) -> None:
        self.samples, self.read = samples, read

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        return self.read(path), target


def read_pid(path: str) -> torch.Tensor:
    """The stubbed read: the worker's pid, so that the parent learns which process to measure."""
    return torch.tensor([os.getpid()])


def imagenet_like(count: int) -> list[tuple[str, int]]:
    """(path, class) pairs named as ImageNet's training images, 1,000 classes."""
    classes = 1000
    return [(f"/datasets/imagenet/train/n{c:08d}/n{c:08d}_{i // classes}.JPEG", c)
            for i in range(count) for c in (i % classes,)]


def memory_kb(pid: int) -> dict[str, int]:
    """RSS, PSS, USS and private dirty memory of a process, from /proc/PID/smaps_rollup (kB)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0])
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"],
            "private_dirty": fields["Private_Dirty"]}


def epoch_growth(dataset: Dataset, batch: int, freeze: bool) -> dict:
    """Memory of the one loader worker after its first batch and after the epoch (kB), and the epoch's seconds.

    `freeze`: the worker starts with gc.freeze(), so that its garbage collector never walks (and so copies) the
    objects inherited from the parent: what is left is the cost of reading the samples.
    """
    gc.collect()  # the last run's loader: freed by the parent now, not while this worker shares its pages
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=1, persistent_workers=True,
                        worker_init_fn=_freeze if freeze else None)
    it = iter(loader)
    start = time.perf_counter()
    pid = int(next(it)[0][0])
    before = memory_kb(pid)
    for _ in it:
        pass
    seconds = time.perf_counter() - start
    after = memory_kb(pid)  # persistent: the worker waits for the next epoch, its pages as the epoch left them
    del it, loader
    return {"before_kb": before, "after_kb": after, "epoch_s": seconds}


def _freeze(worker_id: int) -> None:
    worker_init(worker_id, rank=0)  # what the DataModule's loaders run at a worker's start: gc.freeze(), seeding


def storage(paths: list[str]) -> dict:
    """Bytes and per-item read time of the candidate stores of the paths, and their bytes when one path is 255
    bytes long (a fixed-width array pads every path to the longest)."""
    long = [paths[0].rsplit("/", 1)[0] + "/" + "x" * (254 - len(paths[0].rsplit("/", 1)[0])), *paths[1:]]
    picks = np.random.default_rng(0).integers(0, len(paths), 20_000).tolist()

    def per_item(read) -> float:
        start = time.perf_counter()
        for i in picks:
            read(i)
        return (time.perf_counter() - start) / len(picks)

    def array_bytes(strings: list[str]) -> int:
        array = PathArray(strings)
        return array.data.nbytes + array.offsets.nbytes

    def fixed(strings: list[str]) -> np.ndarray:  # dtype S<longest>
        return np.array([os.fsencode(p) for p in strings])

    def objects_bytes(strings: list[str]) -> int:  # the str objects and the list's pointers
        return sum(map(sys.getsizeof, strings)) + sys.getsizeof(list(strings))

    array, padded = PathArray(paths), fixed(paths)
    return {
        "PathArray: uint8 bytes + int64 offsets (chosen)": (array_bytes(paths), per_item(array.__getitem__),
                                                            array_bytes(long)),
        f"numpy fixed-width array ({padded.dtype.str[1:]})": (padded.nbytes, per_item(lambda i: os.fsdecode(padded[i])),
                                                             fixed(long).nbytes),
        "list of str (before)": (objects_bytes(paths), per_item(paths.__getitem__), objects_bytes(long)),
    }


def measure(count: int, batch: int) -> dict:
    samples = imagenet_like(count)
    stores = storage([p for p, _ in samples])
    arrays = ImageFiles(samples, transform=None, read=read_pid)
    del samples  # the arrays alone: a list left in the parent would be read by the worker's garbage collector
    gc.collect()
    results = {ARRAYS: epoch_growth(arrays, batch, freeze=False), ARRAYS + FROZEN: epoch_growth(arrays, batch, True)}
    del arrays
    listed = ListFiles(imagenet_like(count), read_pid)
    gc.collect()
    results[LIST] = epoch_growth(listed, batch, freeze=False)
    results[LIST + FROZEN] = epoch_growth(listed, batch, freeze=True)
    return {"samples": count, "batch": batch, "workers": results,
            "storage": {name: {"bytes": b, "read_us": t * 1e6, "bytes_one_long_path": long}
                        for name, (b, t, long) in stores.items()}}


def render(result: dict) -> tuple[str, str]:
    def mb(kb: float) -> float:
        return kb / 1024

    rows = []
    for name, r in result["workers"].items():
        before, after = r["before_kb"], r["after_kb"]
        rows.append([name, *(mb(after[k] - before[k]) for k in ("private_dirty", "uss", "pss", "rss")),
                     mb(after["uss"]), r["epoch_s"]])
    body = table(["sample storage", "private dirty growth over the epoch, MB", "USS growth, MB", "PSS growth, MB",
                  "RSS growth, MB", "USS at the end, MB", "epoch s (stubbed read)"], rows)
    growth = {name: mb(r["after_kb"]["private_dirty"] - r["before_kb"]["private_dirty"])
              for name, r in result["workers"].items()}
    samples = growth[LIST + FROZEN] - growth[ARRAYS + FROZEN]  # reading alone: the collector kept out of both
    walk = (growth[LIST] - growth[LIST + FROZEN] + growth[ARRAYS] - growth[ARRAYS + FROZEN]) / 2
    body += (
        f"\n\nReading the list copied {samples:.0f} MB more into the worker (private dirty) than reading the arrays "
        f"({samples * 2**20 / result['samples']:.0f} bytes per sample; rows with gc.freeze(), so that only reading "
        f"counts): {samples * 64 * IMAGENET_TRAIN / result['samples'] / 1024:.1f} GB over 8 ranks x 8 workers at "
        f"ImageNet's {IMAGENET_TRAIN:,} images. Without gc.freeze() both grew {walk:.0f} MB more on average: the "
        "parent's Python heap (imports, model), copied page by page when the worker's garbage collector walks it, "
        "whatever the sample storage. The DataModule's loaders therefore freeze it at each worker's start "
        "(`worker_init` in datamodules/samplers.py): the rows with gc.freeze() are what ships.\n"
    )
    stores = result["storage"]
    body += "\nWhere the paths live (shared by the workers, never copied):\n\n" + table(
        ["store", "MB", "read one path, us", "MB if one path is 255 bytes long"],
        [[name, s["bytes"] / 2**20, s["read_us"], s["bytes_one_long_path"] / 2**20] for name, s in stores.items()])
    settings = (f"{result['samples']:,} ImageNet-like paths, 1 worker (fork), batch {result['batch']}, shuffled, "
                "read stubbed; memory of the worker after its first batch and after the epoch (one epoch per row: "
                "a few MB vary from run to run), from /proc/PID/smaps_rollup")
    return body, settings


def main(quick: bool = False) -> dict:
    if not Path("/proc/self/smaps_rollup").is_file():
        return {"skipped": "needs Linux (/proc/PID/smaps_rollup)", "needs": "linux"}
    return measure(5_000 if quick else IMAGENET_TRAIN, 256 if quick else 1024)

