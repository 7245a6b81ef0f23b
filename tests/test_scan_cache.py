"""The start scan's cache: a restart decodes only the files added or changed since, and a bad cache is never trusted."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import datamodules.bad_images as bad_images
from datamodules import ImageFolderDataModule
from tests.helpers import make_image_folder

IMAGES = 16  # make_image_folder(root, {"a": 4, "b": 4}): 8 in train/, 8 in val/


@pytest.fixture
def decoded(monkeypatch) -> list[str]:
    """The paths the scan decodes, in the order it decodes them."""
    calls: list[str] = []
    real = bad_images.image_problem
    monkeypatch.setattr(bad_images, "image_problem", lambda path: calls.append(path) or real(path))
    return calls


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """The fallback location of the cache, away from the real ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))


def _age(path: Path, seconds: float = 3600) -> None:
    """`path` and everything below it as last written `seconds` ago: data at rest, older than timestamps' resolution."""
    when = time.time() - seconds
    for each in (path, *path.rglob("*")):
        os.utime(each, (when, when))


def _data(tmp_path: Path) -> Path:
    root = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, size=16)
    _age(root)
    return root


def _fit_setup(root: Path, **options) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=32, **options)
    dm.setup("fit")
    return dm


def test_a_warm_start_decodes_nothing(tmp_path, decoded, caplog):
    root = _data(tmp_path)
    cold = _fit_setup(root)
    assert len(decoded) == IMAGES and (root / ".imgcls-scan-cache-train-val.npz").is_file()
    decoded.clear()
    warm = _fit_setup(root)
    assert decoded == []
    assert (warm.train_set.samples, warm.val_set.samples) == (cold.train_set.samples, cold.val_set.samples)
    assert f"{IMAGES:,} images known unchanged" in caplog.text
    _fit_setup(root, scan_cache=False)  # the switch off: every image decoded, as before the cache
    assert len(decoded) == IMAGES


def test_files_changed_within_the_timestamps_resolution_are_not_trusted(tmp_path, decoded):
    """Written a moment ago, a file could change again keeping its size and mtime: checked at every start until
    it is older than that (git's "racy clean" rule)."""
    root = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, size=16)
    _fit_setup(root)
    _fit_setup(root)
    assert len(decoded) == 2 * IMAGES
    _age(root)
    _fit_setup(root)
    decoded.clear()
    _fit_setup(root)
    assert decoded == []


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_changed_file_is_checked_again(tmp_path, decoded):
    root = _data(tmp_path)
    _fit_setup(root)
    good = root / "train" / "a" / "001.png"
    _truncate(good)  # was good, is now cut in half: found bad at the next start
    _age(good)
    decoded.clear()
    with pytest.raises(ValueError, match=r"1 of 16 images cannot be used:\n  .*001.png: cannot be decoded"):
        _fit_setup(root)
    assert decoded == [str(good)]
    decoded.clear()
    with pytest.raises(ValueError, match="001.png: cannot be decoded"):  # a bad verdict is cached too
        _fit_setup(root)
    assert decoded == []
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(good)  # replaced by a good image: usable again
    _age(good, 1800)
    dm = _fit_setup(root)
    assert decoded == [str(good)] and str(good) in {p for p, _ in dm.train_set.samples}


def test_the_cache_keeps_one_message_for_all_splits(tmp_path, decoded):
    """Bad files in train/ and val/ are listed together, from the cache too, and a deleted one leaves the list."""
    root = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, size=16)
    bad = [root / "train" / "a" / "empty.jpg", root / "train" / "b" / "cut.png", root / "val" / "a" / "notes.jpg"]
    bad[0].write_bytes(b"")
    _truncate(root / "train" / "b" / "000.png")
    (root / "train" / "b" / "000.png").rename(bad[1])
    bad[2].write_text("not an image")
    _age(root)
    messages = []
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            _fit_setup(root)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].startswith(f"3 of {IMAGES + 2} images cannot be used:")
    assert all(str(p) in messages[0] for p in bad)
    assert len(decoded) == IMAGES + 2  # all by the first start, none by the second
    bad[2].unlink()
    with pytest.raises(ValueError) as info:
        _fit_setup(root)
    assert str(info.value).startswith(f"2 of {IMAGES + 1} images cannot be used:")
    assert str(bad[2]) not in str(info.value)
    assert len(decoded) == IMAGES + 2


class _Payload:
    """Unpickling this creates a file: a cache file that ran it would have executed code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _plant(cache: Path, kind: str, marker: Path) -> None:
    if kind == "garbage":
        cache.write_bytes(os.urandom(300))
    elif kind == "truncated":
        cache.write_bytes(cache.read_bytes()[:200])
    elif kind == "pickle":
        cache.write_bytes(pickle.dumps(_Payload(marker)))
    elif kind == "object array":
        with open(cache, "wb") as f:
            np.savez(f, version=np.array(bad_images.CACHE_VERSION), keys=np.array([_Payload(marker)], dtype=object))
    elif kind == "arrays that disagree":
        with np.load(cache) as z:
            arrays = dict(z)
        arrays["verdict"] = arrays["verdict"][:-1]
        with open(cache, "wb") as f:
            np.savez(f, **arrays)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "pickle", "object array", "arrays that disagree"])
def test_a_corrupt_cache_file_is_ignored(tmp_path, decoded, caplog, kind):
    root = _data(tmp_path)
    _fit_setup(root)
    cache, marker = root / ".imgcls-scan-cache-train-val.npz", tmp_path / "code-ran"
    _plant(cache, kind, marker)
    os.utime(cache)  # the newest cache file is the one read
    decoded.clear()
    dm = _fit_setup(root)
    assert len(decoded) == IMAGES and len(dm.train_set) + len(dm.val_set) == IMAGES
    assert f"data.scan_cache: ignoring {cache}" in caplog.text
    assert not marker.exists()
    decoded.clear()
    _fit_setup(root)  # rewritten whole: the next start is warm again
    assert decoded == []


def test_a_read_only_data_folder_keeps_its_cache_in_the_user_cache(tmp_path, decoded, monkeypatch):
    root = _data(tmp_path)
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for folder in folders:
        folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes through file modes: the read-only mount is simulated
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if Path(dir) == root:
                raise OSError(30, "Read-only file system")
            return real_mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(bad_images.tempfile, "mkstemp", mkstemp)
    try:
        _fit_setup(root)
        decoded.clear()
        dm = _fit_setup(root)
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert decoded == [] and len(dm.train_set) == 8
    assert not list(root.glob(".imgcls-scan-cache*"))
    assert len(list((tmp_path / "user-cache" / "imgcls" / "scan").glob("*-train-val.npz"))) == 1


def test_a_scan_interrupted_keeps_what_it_decoded_and_the_next_start_decodes_the_rest(tmp_path, monkeypatch):
    """Ctrl-C in a long cold scan (ImageNet's takes minutes): the verdicts reached are written, the next start
    decodes only the others."""
    root = _data(tmp_path)
    paths = [str(p) for p in sorted(root.rglob("*.png"))]
    real, seen = bad_images.image_problem, []

    def interrupted(path):
        if len(seen) == 5:
            raise KeyboardInterrupt
        seen.append(path)
        return real(path)

    monkeypatch.setattr(bad_images, "image_problem", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bad_images.find_bad_images(paths, workers=1, cache=bad_images.ScanCache(root, "all"))
    assert len(seen) == 5
    cache = bad_images.ScanCache(root, "all")
    decoded = []
    monkeypatch.setattr(bad_images, "image_problem", lambda path: decoded.append(path) or real(path))
    assert bad_images.find_bad_images(paths, workers=1, cache=cache) == []
    assert cache.known == 5 and sorted(decoded) == sorted(set(paths) - set(seen))
