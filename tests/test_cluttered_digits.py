"""benchmarks.cluttered_digits: the harder task the accuracy benchmarks train on, built from the bundled digits."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
from PIL import Image

from benchmarks import cluttered_digits

SUBSET = 100  # drawings: the tests that build twice use the first ones only


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.png"))}


@pytest.fixture
def subset(monkeypatch):
    digits = sklearn.datasets.load_digits()
    digits.images, digits.target = digits.images[:SUBSET], digits.target[:SUBSET]
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: digits)


def test_the_whole_set_splits_the_drawings_80_20_by_class_and_renders_each_as_asked(tmp_path):
    out = cluttered_digits.build(tmp_path / "cd", train_renders=1, val_renders=2)
    counts = json.loads((out / cluttered_digits.MANIFEST).read_text())["counts"]
    drawings = len(sklearn.datasets.load_digits().target)
    assert counts["train"] + counts["val"] / 2 == drawings and counts["train"] == int(0.8 * drawings)
    for split in ("train", "val"):
        assert sorted(p.name for p in (out / split).iterdir()) == [str(d) for d in range(10)]
        assert len(list((out / split).rglob("*.png"))) == counts[split]
    image = Image.open(next((out / "val").rglob("*.png")))
    assert image.size == (cluttered_digits.SIDE, cluttered_digits.SIDE) and image.mode == "RGB"


def test_a_build_is_deterministic_and_a_second_one_leaves_it_alone(tmp_path, subset):
    first = cluttered_digits.build(tmp_path / "a")
    files = _files(first)
    assert len(files) == 0.8 * SUBSET * 2 + 0.2 * SUBSET * 5
    assert _files(cluttered_digits.build(tmp_path / "b")) == files  # the same images, byte for byte
    stamps = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    assert cluttered_digits.build(first) == first
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == stamps  # nothing rewritten
    assert _files(cluttered_digits.build(tmp_path / "c", seed=1)) != files


def test_another_setting_is_refused_over_a_built_tree(tmp_path, subset):
    out = cluttered_digits.build(tmp_path / "cd")
    with pytest.raises(FileExistsError, match="holds no cluttered digits built with .*'train_renders': 3"):
        cluttered_digits.build(out, train_renders=3)


def test_an_interrupted_build_leaves_nothing_behind(tmp_path, subset, monkeypatch):
    rendered, render = [], cluttered_digits.render

    def failing(drawing: np.ndarray, others: np.ndarray, rng: np.random.Generator) -> Image.Image:
        if len(rendered) == 50:
            raise KeyboardInterrupt
        rendered.append(1)
        return Image.new("RGB", (cluttered_digits.SIDE,) * 2)

    monkeypatch.setattr(cluttered_digits, "render", failing)
    with pytest.raises(KeyboardInterrupt):
        cluttered_digits.build(tmp_path / "cd")
    assert list(tmp_path.iterdir()) == []  # neither the tree nor its temporary folder
    monkeypatch.setattr(cluttered_digits, "render", render)
    assert cluttered_digits.build(tmp_path / "cd") == tmp_path / "cd"  # and the next build completes
