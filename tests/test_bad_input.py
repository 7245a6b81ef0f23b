"""Bad images, bad folder layouts and bad config values: each gets a clear error naming the file or key, before
training."""

from __future__ import annotations

import os
import struct
import zlib
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torchvision
from PIL import Image

import datamodules.bad_images as bad_images
from datamodules import ImageFolderDataModule
from datamodules.bad_images import find_bad_images, image_problem
from imgcls.commands import main
from lightning_modules import BackboneWithHead, ImageClassifier
from tests.helpers import CONFIGS, TINY, TINY_ARCH, make_image_folder, run_cli


def _truncated_jpeg(path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _bomb_png(path: Path, side: int = 40_000) -> Path:
    """A 40,000 x 40,000 PNG header (1.6 G pixels, past PIL's 2 x 89 M guard) in a few hundred bytes."""
    Image.new("L", (8, 8)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", side, side)
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr: ihdr + 17])))
    path.write_bytes(bytes(data))
    return path


BAD_FILES = {  # file name -> (maker, expected reason)
    "truncated.jpg": (_truncated_jpeg, "cannot be decoded (image file is truncated"),
    "empty.jpg": (lambda p: (p.touch(), p)[1], "empty file (0 bytes)"),
    "notes.jpg": (lambda p: (p.write_text("these are my notes, not a photo\n"), p)[1],
                  "not an image (PIL cannot identify the format)"),
    "bomb.png": (_bomb_png, "too large, refused by the decompression-bomb guard"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_each_bad_image_kind_is_found_with_its_reason(tmp_path, name):
    maker, reason = BAD_FILES[name]
    path = maker(tmp_path / name)
    problem = image_problem(str(path))
    assert problem is not None and problem.startswith(reason), problem


def test_unreadable_file_is_reported(tmp_path, monkeypatch):
    path = make_image_folder(tmp_path, {"a": 1}, splits=("train",)) / "train" / "a" / "000.png"
    path.chmod(0)
    if os.geteuid() == 0:
        # root ignores file modes, so the permission check is simulated (as on a file owned by another user).
        real_access = os.access
        monkeypatch.setattr(bad_images.os, "access", lambda p, m: False if str(p) == str(path) else real_access(p, m))
    assert image_problem(str(path)) == "no read permission"


SCANNED = 24  # good images of _bad_dataset: 12 in train/ and 12 in val/, scanned together


def _bad_dataset(tmp_path: Path) -> tuple[Path, list[Path]]:
    root = make_image_folder(tmp_path / "data", {"a": 6, "b": 6}, size=32)
    bad = [maker(root / "train" / ("a" if i % 2 else "b") / name) for i, (name, (maker, _)) in
           enumerate(sorted(BAD_FILES.items()))]
    return root, bad


def test_raise_lists_every_bad_file_before_training(tmp_path):
    root, bad = _bad_dataset(tmp_path)
    dm = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=32)
    with pytest.raises(ValueError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert message.startswith(f"{len(bad)} of {SCANNED + len(bad)} images cannot be used:")
    for path in bad:
        assert str(path) in message
    assert message.endswith("remove or fix these files, or set data.bad_images: skip")


def test_one_scan_lists_the_bad_files_of_train_and_val_together(tmp_path):
    """A truncated JPEG and an empty file in train/, a text file named .jpg in val/: one error names all three."""
    root = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, splits=("train", "val"), size=32)
    bad = [_truncated_jpeg(root / "train" / "a" / "truncated.jpg"), root / "train" / "b" / "empty.jpg",
           root / "val" / "a" / "notes.jpg"]
    bad[1].write_bytes(b"")
    bad[2].write_text("not an image")
    dm = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=32)
    with pytest.raises(ValueError) as info:
        dm.setup("fit")
    assert str(info.value).startswith("3 of 19 images cannot be used:")
    for path in bad:
        assert str(path) in str(info.value)


def test_skip_logs_the_bad_files_and_trains_on_the_rest(tmp_path, caplog):
    root, bad = _bad_dataset(tmp_path)
    dm = ImageFolderDataModule(root=str(root), batch_size=4, num_workers=0, image_size=32, bad_images="skip",
                               persistent_workers=False)
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=8),
                            class_names=dm.class_names, batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    assert len(dm.train_set) == 12
    assert f"data.bad_images=skip: skipping {len(bad)} of {SCANNED + len(bad)} images cannot be used" in caplog.text
    for path in bad:
        assert str(path) in caplog.text


def test_scan_runs_in_threads_and_keeps_order(tmp_path):
    root, bad = _bad_dataset(tmp_path)
    paths = sorted(str(p) for p in root.rglob("*.*"))
    assert [p for p, _ in find_bad_images(paths, workers=4)] == sorted(str(p) for p in bad)


# ---- layout ---------------------------------------------------------------------------------------------------

def _layout(tmp_path: Path, case: str) -> tuple[Path, dict, str]:
    """(root, extra DataModule args, expected message start) for one broken layout."""
    root = tmp_path / "data"
    if case == "missing root":
        return root, {}, f"data.root={root} does not exist"
    if case == "no images":
        (root / "train" / "a").mkdir(parents=True)
        (root / "train" / "b").mkdir(parents=True)
        return root, {}, f"class folder {root / 'train' / 'a'} holds no images"
    if case == "no class folders":
        (root / "train").mkdir(parents=True)
        return root, {}, f"{root / 'train'} has no class folders"
    make_image_folder(root, {"a": 5, "b": 5}, splits=("train",), size=32)
    if case == "empty class folder":
        (root / "train" / "c").mkdir()
        return root, {}, f"class folder {root / 'train' / 'c'} holds no images"
    if case == "val classes differ":
        make_image_folder(root, {"a": 2, "c": 2}, splits=("val",), size=32)
        return root, {}, (f"val/ classes differ from train/ (root: {root}): missing from val/: ['b'], "
                          "not in train/: ['c']")
    if case == "single class":
        for f in (root / "train" / "b").iterdir():
            f.unlink()
        (root / "train" / "b").rmdir()
        return root, {}, f"{root / 'train'} has a single class (a)"
    if case == "val split leaves a class empty":
        for f in sorted((root / "train" / "b").iterdir())[1:]:
            f.unlink()  # class b keeps 1 image: nothing left for validation
        return root, {"val_split": 0.2}, f"data.val_split=0.2 of {root / 'train'} leaves a class empty"
    if case == "val split draws no image of a small class":
        make_image_folder(root, {"a": 12}, splits=("train",), size=32)
        for f in sorted((root / "train" / "b").iterdir())[2:]:
            f.unlink()  # 12 a, 2 b: a stratified 10% (2 images) draws both from a
        return root, {"val_split": 0.1}, f"data.val_split=0.1 of {root / 'train'} leaves class(es) ['b'] with no"
    raise AssertionError(case)


LAYOUTS = ["missing root", "no images", "no class folders", "empty class folder", "val classes differ",
           "single class", "val split leaves a class empty", "val split draws no image of a small class"]


@pytest.mark.parametrize("case", LAYOUTS)
def test_bad_layout_names_the_path(tmp_path, case):
    root, extra, expected = _layout(tmp_path, case)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        ImageFolderDataModule(root=str(root), num_workers=0, image_size=32, **extra).setup("fit")
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message


# ---- through the real command: one line on stderr, exit 2, nothing trained --------------------------------------

CLI_CASES = {
    "negative lr": (["--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "-0.1"],
                    "model.optimizer (SGD): Invalid learning rate: -0.1"),
    "unknown preset": (["--data.preset", "fancy"], "data.preset"),
    "image_size < 32": (["--data.image_size", "16"], "data.image_size=16 is below 32"),
    "negative num_workers": (["--data.num_workers", "-1"], "data.num_workers=-1 must be >= 0"),
    "BCE label smoothing of 1": (["--model.loss", "lightning_modules.losses.BinaryCrossEntropy",
                                  "--model.loss.label_smoothing", "1.0"],
                                 "model.loss.label_smoothing=1.0 must be in [0, 1)"),
    "misspelt arch": (["--model.net.arch", "resnt50"], "model.net.arch='resnt50' is unknown; did you mean resnet50"),
    "val split leaves a class empty": (["--data.val_split", "0.01"], "data.val_split=0.01 of"),
    "a batch of one image with BatchNorm": (["--data.batch_size", "1"],  # was torch's traceback at the first step
                                            "data.batch_size=1: the network's BatchNorm layers need at least 2"),
    # ViTs are built for one side (torchvision's and timm's asserted at the first step)
    "a ViT at 32 px": (["--model.net.arch", "vit_b_16"], "data.train_transform.image_size=32: the network takes 224"),
    "a timm ViT at 32 px": (["--model.net.arch", "timm/vit_tiny_patch16_224"],
                            "data.train_transform.image_size=32: the network takes 224 px images only"),
    "a file as the run directory": (["--trainer.default_root_dir", str(CONFIGS / "quickstart.yaml")],
                                    f"trainer.default_root_dir={CONFIGS / 'quickstart.yaml'} is a file; the run "
                                    "directory is a folder"),
    "a ViT with progressive resizing": (["--model.net.arch", "timm/vit_tiny_patch16_224", "--data.image_size", "224",
                                         "--data.progressive_resizing", "{0: 128, 1: 224}"],
                                        "data.progressive_resizing={0: 128, 1: 224}: the network takes 224 px images "
                                        "only (its position embeddings are built for that side); set "
                                        "data.progressive_resizing null"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_config_value_is_one_line_naming_the_key(tmp_path, case, capsys):
    """`imgcls fit` in this process (the console script's function; the next test runs the real command)."""
    args, expected = CLI_CASES[case]
    root = make_image_folder(tmp_path / "data", {"a": 5, "b": 5}, splits=("train",), size=32)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *TINY, "--data.root", str(root), "--trainer.default_root_dir", str(run),
              "--trainer.max_epochs", "1", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert expected in err
    assert "Traceback" not in err
    assert not (run / "checkpoints").exists()  # nothing trained


def test_weights_that_cannot_be_downloaded_are_one_line_naming_the_offline_file(tmp_path, monkeypatch, capsys):
    """A machine without network access asked for torchvision's pretrained weights: one line with the file to put in
    the cache and the command (a RuntimeError's traceback before), exit 2, nothing trained."""
    import urllib.error

    import lightning_modules.network as network

    def offline(url: str) -> Path:
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(network, "cached_download", offline)
    root = make_image_folder(tmp_path / "data", {"a": 5, "b": 5}, splits=("train", "val"), size=32)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *TINY, "--data.root", str(root), "--trainer.default_root_dir", str(run), "--model.net.arch",
              "resnet18", "--model.net.weights", "IMAGENET1K_V1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert "imgcls: error: could not download resnet18 weights IMAGENET1K_V1 (URLError:" in err
    assert "cp resnet18-f37072fd.pth" in err and not (run / "checkpoints").exists()


@pytest.mark.parametrize(("args", "expected"), [
    (["--model.recipe.lr_scalling", "none"],
     "--model.recipe.lr_scalling is not an option; did you mean --model.recipe.lr_scaling"),
    (["--data.roott", "x"], "--data.roott is not an option; did you mean --data.root"),
    (["--model.optimizer.lrr", "0.1"],
     "model.optimizer.lrr: torch.optim.AdamW takes no argument lrr; did you mean model.optimizer.lr?"),
    (["--model.optimizer", "torch.optim.AdamWW"],
     "model.optimizer=torch.optim.AdamWW: torch.optim has no AdamWW; did you mean torch.optim.AdamW"),
    (["--model.lr_scheduler.warmup_epoch", "1"], "model.lr_scheduler.warmup_epoch: "
     "lightning_modules.schedules.WarmupCosine takes no argument warmup_epoch; did you mean "
     "model.lr_scheduler.warmup_epochs?"),
    (["--model.loss", "torch.nn.CrossEntropyLos"],
     "model.loss=torch.nn.CrossEntropyLos: torch.nn has no CrossEntropyLos; did you mean torch.nn.CrossEntropyLoss"),
    (["--model.loss.label_smoothin", "0.1"],
     "--model.loss.label_smoothin is not an option; did you mean --model.loss.label_smoothing? "
     "(model.loss.class_path: torch.nn.CrossEntropyLoss)"),
    (["--data.train_transform.auto_augmnt", "augmix"], "--data.train_transform.auto_augmnt is not an option; did "
     "you mean --data.train_transform.auto_augment"),
    # a value of the wrong type: a plain one, one of a union, a restricted number's, a bool
    (["--trainer.max_epochs", "x"], "trainer.max_epochs='x' is not an int or null"),
    (["--data.batch_size", "x"], "data.batch_size='x' is not an int"),
    (["--data.val_split", "a"], "data.val_split='a' is not a number"),
    (["--auto_resume", "maybe"], "auto_resume='maybe' is not true or false"),
])
def test_a_parse_error_is_one_line_not_a_usage_page(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err.startswith(f"imgcls: error: {expected}") and "\n" not in err, err[-3000:]
    assert err.endswith("(`imgcls fit --help` lists every option)")


@pytest.mark.parametrize(("text", "expected"), [
    ("trainer:\n  max_epochss: 3\n", "--trainer.max_epochss is not an option; did you mean --trainer.max_epochs"),
    ("model:\n  net:\n    init_args:\n      archh: resnet18\n",
     "model.net.archh: lightning_modules.BackboneWithHead takes no argument archh; did you mean model.net.arch?"),
])
def test_an_unknown_key_in_a_config_file_is_one_line_naming_the_closest(tmp_path, text, expected, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(text)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(typo)])
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"imgcls: error: {expected}") and "\n" not in err, err[-3000:]


def test_bad_images_through_the_command_stop_before_training(tmp_path):
    root, bad = _bad_dataset(tmp_path)
    run = tmp_path / "run"
    proc = run_cli("fit", *TINY, "--data.root", str(root), "--trainer.default_root_dir", str(run),
                   "--trainer.max_epochs", "1", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"imgcls: error: {len(bad)} of {SCANNED + len(bad)} images cannot be used:" in proc.stderr
    for path in bad:
        assert str(path) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "checkpoints").exists()


def test_a_file_broken_after_the_scan_is_one_line_naming_it(tmp_path):
    """The scan passed; the file breaks before a loader worker reads it: one line naming it, no worker traceback."""
    root = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, splits=("train", "val"), size=32, ext=".jpg")
    victim = sorted((root / "train" / "a").iterdir())[0]
    proc = run_cli("fit", *TINY, "--data.root", str(root), "--data.num_workers", "1", "--data.batch_size", "4",
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_epochs", "1",
                   "--trainer.num_sanity_val_steps", "0", "--trainer.callbacks+=tests.fault_injection.BreakFile",
                   f"--trainer.callbacks.path={victim}", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"imgcls: error: cannot read image {victim}: "), last
    assert "Traceback" not in proc.stderr


def test_a_progressive_resizing_schedule_is_refused_for_a_vit_fit_only():
    """validate, test and predict never resize by epoch: a config that still names a schedule evaluates as it is."""
    from types import SimpleNamespace

    from training.cli.preflight import check_input_side

    vit = torchvision.models.VisionTransformer(image_size=64, patch_size=16, num_layers=1, num_heads=1,
                                               hidden_dim=16, mlp_dim=16, num_classes=2)
    side = SimpleNamespace(image_size=64)
    data = SimpleNamespace(train_transform=side, eval_transform=side, progressive_resizing={0: 32, 1: 64})
    check_input_side(vit, data)  # an evaluation
    with pytest.raises(ValueError, match=r"^data.progressive_resizing=\{0: 32, 1: 64\}: the network takes 64 px"):
        check_input_side(vit, data, fit=True)
