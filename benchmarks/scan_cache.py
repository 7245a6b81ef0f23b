"""Start scan: listing the images and checking that each decodes, at a first start (no cache) and at a later one
(`data.scan_cache`: only files added or changed since are decoded).

    python -m benchmarks.run --only scan_cache [--quick]

Data: 100,000 16x16 JPEGs (random pixels, each one decodable) in 10 class folders of train/ and val/, written once
to the temp folder and dated an hour back (a file younger than 2 s is never cached). Tiny files are the cheapest to
decode, so the cold scan here is as fast, and the warm/cold ratio as small, as they get: a warm start costs a stat
per file whatever its size, a cold one a decode. All files sit in the page cache: "cold" means no cache file, not a
cold disk.
"""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import table, verdict
from datamodules.bad_images import ScanCache, find_bad_images
from datamodules.listing import find_classes, scan_split

TITLE = "Start scan"
IMAGENET_TRAIN = 1_281_167
TARGET = 20  # warm scan at least this many times faster than cold


def tiny_folder(count: int, classes: int = 10) -> Path:
    """`count` 16x16 JPEGs, one in ten in val/, cached in the temp folder; every file dated an hour back."""
    root = Path(tempfile.gettempdir()) / f"imgcls-bench-tiny-{count}"
    done = root / ".complete"
    if done.is_file():
        return root
    rng = np.random.default_rng(0)
    past = time.time() - 3600
    for i in range(count):
        folder = root / ("val" if i % 10 == 9 else "train") / f"class{i // 10 % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        encoded = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(encoded, "JPEG", quality=90)
        path = folder / f"{i:06d}.jpg"
        path.write_bytes(encoded.getvalue())
        os.utime(path, (past, past))
    done.touch()
    return root


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(count: int, reps: int) -> dict:
    root = tiny_folder(count)
    classes = find_classes(root / "train")

    def listing() -> list[str]:  # what every rank does at setup: the sorted walk of each split
        return [p for split in ("train", "val") for p, _ in scan_split(root / split, classes)]

    paths = listing()
    list_s = statistics.median(seconds(listing) for _ in range(reps))
    stat_s = statistics.median(seconds(lambda: [os.stat(p) for p in paths]) for _ in range(reps))
    cache = ScanCache(root, "train-val")
    for file in cache.files:
        file.unlink(missing_ok=True)
    bad: list = []
    no_cache_s = seconds(lambda: bad.extend(find_bad_images(paths)))  # before the cache, or data.scan_cache false
    cold_s = seconds(lambda: find_bad_images(paths, cache=cache))  # a first start: decodes all, writes the cache
    assert cache.checked == len(paths) and cache.written is not None and not bad
    warm = []
    for _ in range(reps):
        warm.append(seconds(lambda: find_bad_images(paths, cache=cache)))
        assert cache.checked == 0, cache.summary()
    changed = paths[::100]  # 1% of the files rewritten since the last start
    for path in changed:
        os.utime(path, (time.time() - 60, time.time() - 60))
    changed_s = seconds(lambda: find_bad_images(paths, cache=cache))
    assert cache.checked == len(changed), cache.summary()
    return {"images": len(paths), "listing_s": list_s, "stat_s": stat_s,
            "no_cache_s": no_cache_s, "cold_s": cold_s, "warm_s": statistics.median(warm), "warm_reps": reps,
            "changed": len(changed), "changed_s": changed_s, "cache_bytes": cache.written.stat().st_size,
            "mean_jpeg_bytes": sum(os.path.getsize(p) for p in paths[:1000]) / min(1000, len(paths))}


def render(r: dict) -> tuple[str, str]:
    n, listing = r["images"], r["listing_s"]
    rows = [
        ["no cache (before it; data.scan_cache false)", r["no_cache_s"], listing + r["no_cache_s"], ""],
        ["cold: first start (decodes all, writes the cache)", r["cold_s"], listing + r["cold_s"], ""],
        ["warm: cache present, nothing changed", r["warm_s"], listing + r["warm_s"],
         f"{r['cold_s'] / r['warm_s']:.0f}x"],
        [f"warm, {r['changed']:,} files ({r['changed'] / n:.0%}) changed", r["changed_s"], listing + r["changed_s"],
         f"{r['cold_s'] / r['changed_s']:.0f}x"],
    ]
    body = table(["start", "scan s", "listing + scan s", "scan: cold / this"], rows)
    ratio, start_ratio = r["cold_s"] / r["warm_s"], (listing + r["cold_s"]) / (listing + r["warm_s"])
    body += (
        f"\n\nTarget, a warm scan at least {TARGET}x faster than a cold one: {ratio:.0f}x ({verdict(ratio >= TARGET)});"
        f" listing + scan, {start_ratio:.0f}x. Listing {n:,} files takes {listing:.3g} s on every rank; the stat "
        f"of each file for the cache key, {r['stat_s']:.3g} s of the warm scan, runs on rank 0 only (os.scandir's "
        "DirEntry.stat does the same system call on Linux, so listing with it saves nothing). At these per-file "
        f"costs a warm start lists and checks ImageNet's {IMAGENET_TRAIN:,} training images in about "
        f"{(listing + r['warm_s']) / n * IMAGENET_TRAIN:.0f} s; cold it decodes every one of them (photo-sized "
        f"JPEGs take far longer than these). The cache file holds {r['cache_bytes'] / n:.0f} bytes per image "
        f"({r['cache_bytes'] / 2**20:.1f} MB here)."
    )
    settings = (f"{n:,} 16x16 JPEGs (mean {r['mean_jpeg_bytes']:.0f} bytes) in 10 classes, train/ and val/, in the "
                f"page cache; listing, stat and warm: medians of {r['warm_reps']}; cold and no-cache runs once each")
    return body, settings


def main(quick: bool = False) -> dict:
    return measure(2_000 if quick else 100_000, reps=2 if quick else 5)

