"""The demo dataset: scikit-learn's bundled handwritten digits written out as an ImageFolder tree of PNGs.

    imgcls demo-data data/digits
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

MANIFEST = "demo_manifest.json"
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}


def build_demo_data(out_dir: str | os.PathLike, *, size: int = 64, seed: int = 0) -> Path:
    """Write the 1,797 8x8 digits, upsampled to `size` px, into train/val/test (80/10/10, stratified).

    Idempotent: a complete tree with the same settings is left alone. The tree is built in a temporary
    sibling folder and renamed into place, so an interrupted run never leaves half a dataset.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    out = Path(out_dir)
    settings = {"source": "sklearn.datasets.load_digits", "size": size, "seed": seed, "splits": SPLITS}
    manifest = out / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()).get("settings") == settings:
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a demo dataset built with these settings; "
                              "remove it or choose another folder")

    digits = load_digits()  # (1797, 8, 8) values 0..16, bundled with scikit-learn
    images, targets = digits.images, digits.target
    idx = np.arange(len(targets))
    train_idx, rest = train_test_split(idx, train_size=SPLITS["train"], stratify=targets, random_state=seed)
    val_idx, test_idx = train_test_split(rest, test_size=0.5, stratify=targets[rest], random_state=seed)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    counts = {}
    try:
        for split, split_idx in (("train", train_idx), ("val", val_idx), ("test", test_idx)):
            for i in sorted(split_idx):
                folder = tmp / split / str(targets[i])
                folder.mkdir(parents=True, exist_ok=True)
                pixels = (images[i] * (255.0 / 16.0)).round().astype(np.uint8)
                Image.fromarray(pixels, mode="L").resize((size, size), Image.BICUBIC).save(folder / f"{i:04d}.png")
            counts[split] = len(split_idx)
        (tmp / MANIFEST).write_text(json.dumps({"settings": settings, "counts": counts}, indent=2))
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="imgcls demo-data", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to create, e.g. data/digits")
    parser.add_argument("--size", type=int, default=64, help="side of the written PNGs in pixels (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stratified split (default 0)")
    args = parser.parse_args(argv)
    out = build_demo_data(args.out_dir, size=args.size, seed=args.seed)
    counts = json.loads((out / MANIFEST).read_text())["counts"]
    print(f"demo data in {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + " images, 10 classes")
