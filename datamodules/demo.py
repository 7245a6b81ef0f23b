"""The demo dataset: scikit-learn's bundled handwritten digits written out as an ImageFolder tree of PNGs, or
composited several to an image as a multi-label dataset (a labels.csv per split).

    imgcls demo-data data/digits
    imgcls demo-data data/digits_multilabel --multilabel
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from core.command_line import parse_settings
from core.config_types import PositiveInt

MANIFEST = "demo_manifest.json"
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}


def _built_already(out: Path, settings: dict) -> bool:
    """True when `out` holds a complete demo dataset built with `settings`; refuses any other non-empty folder."""
    manifest = out / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()).get("settings") == settings:
        return True
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a demo dataset built with these settings; "
                              "remove it or choose another folder")
    return False


def build_demo_data(out_dir: str | os.PathLike, *, size: int = 64, seed: int = 0) -> Path:
    """Write the 1,797 8x8 digits, upsampled to `size` px, into train/val/test (80/10/10, stratified).

    Idempotent: a complete tree with the same settings is left alone. The tree is built in a temporary
    sibling folder and renamed into place, so an interrupted run never leaves half a dataset.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    out = Path(out_dir)
    settings = {"source": "sklearn.datasets.load_digits", "size": size, "seed": seed, "splits": SPLITS}
    if _built_already(out, settings):
        return out

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


def build_multilabel_demo_data(out_dir: str | os.PathLike, *, size: int = 64, seed: int = 0,
                               counts: dict[str, int] | None = None) -> Path:
    """Multi-label digits: each image is a 2 x 2 grid of 8x8 cells holding 1 to 3 different digits (the others
    blank), upsampled to `size` px; its labels are those digits. Each split composites its own share of the 1,797
    digits (80/10/10, stratified), so no digit drawing is in two splits. `counts`: images per split (default 1,500
    train, 200 val, 200 test). Written as `<split>/images/NNNNN.png` and `<split>/labels.csv`; idempotent and
    atomic like `build_demo_data`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    counts = counts or {"train": 1500, "val": 200, "test": 200}
    out = Path(out_dir)
    settings = {"source": "sklearn.datasets.load_digits, 1-3 per 2x2 grid", "size": size, "seed": seed,
                "counts": counts}
    if _built_already(out, settings):
        return out
    digits = load_digits()
    images, targets = digits.images, digits.target
    idx = np.arange(len(targets))
    train_idx, rest = train_test_split(idx, train_size=SPLITS["train"], stratify=targets, random_state=seed)
    val_idx, test_idx = train_test_split(rest, test_size=0.5, stratify=targets[rest], random_state=seed)
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for split, pool in (("train", train_idx), ("val", val_idx), ("test", test_idx)):
            (tmp / split / "images").mkdir(parents=True)
            rows = ["path,labels"]
            for n in range(counts[split]):
                k = int(rng.integers(1, 4))
                classes = rng.choice(10, size=k, replace=False)
                canvas = np.zeros((16, 16))
                for cell, digit in zip(rng.choice(4, size=k, replace=False), classes, strict=True):
                    drawing = images[rng.choice(pool[targets[pool] == digit])]
                    r, c = divmod(int(cell), 2)
                    canvas[8 * r:8 * r + 8, 8 * c:8 * c + 8] = drawing
                pixels = (canvas * (255.0 / 16.0)).round().astype(np.uint8)
                name = f"images/{n:05d}.png"
                Image.fromarray(pixels, mode="L").resize((size, size), Image.BICUBIC).save(tmp / split / name)
                rows.append(f"{name},{'|'.join(str(d) for d in sorted(classes))}")
            (tmp / split / "labels.csv").write_text("\n".join(rows) + "\n")
        (tmp / MANIFEST).write_text(json.dumps({"settings": settings, "counts": counts}, indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass
class DemoDataSettings:
    """The settings of `imgcls demo-data`."""

    out_dir: str
    """folder to create, e.g. data/digits"""
    _: KW_ONLY
    size: PositiveInt = 64
    """side of the written PNGs in pixels"""
    seed: int = 0
    """seed of the stratified split"""
    multilabel: bool = False
    """1 to 3 digits per image, labels in <split>/labels.csv (multi-label classification)"""


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(DemoDataSettings, argv, prog="imgcls demo-data", description=__doc__)
    build = build_multilabel_demo_data if args.multilabel else build_demo_data
    out = build(args.out_dir, size=args.size, seed=args.seed)
    counts = json.loads((out / MANIFEST).read_text())["counts"]
    kind = "10 labels, 1 to 3 per image" if args.multilabel else "10 classes"
    print(f"demo data in {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" images, {kind}")
