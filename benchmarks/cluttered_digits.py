"""Cluttered digits: a harder task than the demo digits, built from the same bundled drawings, for the benchmarks that
judge accuracy (the recipe ablation, imgcls against timm's train.py).

The demo digits are solved in a few epochs: the ingredients of a modern recipe (augmentation, mixing, averaging)
regularise, and have nothing to regularise there. Here each 8x8 drawing is scaled, rotated, coloured and placed on a
textured background among fragments of other digits; the training set renders each training writer's digit
`train_renders` times and the validation set each held-out writer's `val_renders` times, so a model must generalise
to new writers and new clutter, and a validation image weighs 1/1,800 of val/acc rather than the demo's 1/180.

    python -m benchmarks.cluttered_digits OUT_DIR   # writes OUT_DIR/train, OUT_DIR/val as an image folder
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

SIDE = 48  # the written PNGs; the benchmarks train at 32 px, as the quickstart does
# The digit's side before rotation: at 32 px its strokes stay a pixel or more wide (smaller digits left resnet18 at
# chance on new writers while it learnt the training images by heart), and rotated it still fits the canvas.
DIGIT = (22, 34)
MANIFEST = "cluttered_manifest.json"


def _background(rng: np.random.Generator) -> np.ndarray:
    """A smooth colour field with mid-scale texture and noise, float32 HxWx3 in 0..255."""
    def smooth(cells: int) -> np.ndarray:
        grid = Image.fromarray(rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8))
        return np.asarray(grid.resize((SIDE, SIDE), Image.BICUBIC), dtype=np.float32)

    return np.clip(0.6 * smooth(3) + 0.4 * smooth(12) + rng.normal(0.0, 12.0, (SIDE, SIDE, 3)), 0, 255)


def _stroke(drawing: np.ndarray, side: int, angle: float) -> np.ndarray:
    """An 8x8 drawing (0..16) scaled to `side` px and rotated: an alpha mask in 0..1."""
    mask = Image.fromarray((drawing * (255.0 / 16.0)).astype(np.uint8), mode="L").resize((side, side), Image.BICUBIC)
    return np.asarray(mask.rotate(angle, resample=Image.BILINEAR, expand=True), dtype=np.float32) / 255.0


def _paste(canvas: np.ndarray, alpha: np.ndarray, colour: np.ndarray, rng: np.random.Generator) -> None:
    """Blend `colour` into `canvas` through `alpha` at a random position where the mask fits."""
    h, w = alpha.shape
    top, left = rng.integers(0, SIDE - h + 1), rng.integers(0, SIDE - w + 1)
    region = canvas[top:top + h, left:left + w]
    region[:] = region * (1.0 - alpha[..., None]) + colour * alpha[..., None]


def render(drawing: np.ndarray, others: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """One cluttered image of `drawing`: a background, two fragments of `others` (4x4 corners of other digits) in
    faint colours, then the digit itself at DIGIT px, rotated by up to 30 degrees, in a colour far from the
    background's mean."""
    canvas = _background(rng)
    for fragment in others[:2]:
        r, c = rng.integers(0, 5, size=2)
        piece = np.zeros((8, 8), dtype=np.float64)
        piece[r:r + 4, c:c + 4] = fragment[r:r + 4, c:c + 4]
        alpha = 0.6 * _stroke(piece, int(rng.integers(14, 25)), float(rng.uniform(-45, 45)))
        _paste(canvas, alpha, rng.uniform(0, 255, 3), rng)
    mean = canvas.mean(axis=(0, 1))
    colour = np.where(mean > 127, rng.uniform(0, 60, 3), rng.uniform(195, 255, 3))
    digit = _stroke(drawing, int(rng.integers(DIGIT[0], DIGIT[1] + 1)), float(rng.uniform(-30, 30)))
    _paste(canvas, digit, colour, rng)
    return Image.fromarray(canvas.round().astype(np.uint8))


def build(out_dir: str | Path, *, train_renders: int = 2, val_renders: int = 5, seed: int = 0) -> Path:
    """Write train/ and val/ image folders (one folder per digit) under `out_dir`: the bundled digits split 80/20 by
    drawing, stratified, each drawing rendered `train_renders` or `val_renders` times. Idempotent and atomic: a
    complete tree with the same settings is left alone, and an interrupted build leaves nothing behind."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    out = Path(out_dir)
    settings = {"side": SIDE, "digit": list(DIGIT), "train_renders": train_renders, "val_renders": val_renders,
                "seed": seed}
    manifest = out / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text())["settings"] == settings:
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and holds no cluttered digits built with {settings}; remove it")
    digits = load_digits()
    images, targets = digits.images, digits.target
    train_idx, val_idx = train_test_split(np.arange(len(targets)), train_size=0.8, stratify=targets,
                                          random_state=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    counts = {}
    try:
        for split_no, (split, pool, renders) in enumerate((("train", train_idx, train_renders),
                                                          ("val", val_idx, val_renders))):
            for i in pool:
                folder = tmp / split / str(targets[i])
                folder.mkdir(parents=True, exist_ok=True)
                for k in range(renders):
                    rng = np.random.default_rng([seed, split_no, int(i), k])  # each image from its own seed
                    others = images[rng.choice(pool, size=2)]
                    render(images[i], others, rng).save(folder / f"{i:04d}-{k}.png")
            counts[split] = len(pool) * renders
        (tmp / MANIFEST).write_text(json.dumps({"settings": settings, "counts": counts}, indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m benchmarks.cluttered_digits OUT_DIR  ({__doc__.splitlines()[0]})")
    built = build(sys.argv[1])
    print(f"cluttered digits in {built}: {json.loads((built / MANIFEST).read_text())['counts']}")
