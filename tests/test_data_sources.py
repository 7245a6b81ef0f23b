"""The data seam (datamodules/base.py): the CSV manifest, Hugging Face datasets and a user's own DataModule plug in
by `data.class_path` alone, train, and resume after a SIGKILL to the weights of the run never killed."""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from datamodules import ClassificationData, CsvDataModule, ImageFolderDataModule
from datamodules.datasets import SeededImages
from datamodules.decoding import read_image
from tests.helpers import (
    CONFIGS,
    TINY,
    killed_and_resumed,
    make_image_folder,
    resume_config,
    run_cli,
)

CLASSES = ("0", "1")  # two digits: enough to learn, few images to decode
PER_CLASS = {"train": 16, "val": 4, "test": 2}


def _digit_files(digits_root: Path, split: str) -> list[tuple[Path, str]]:
    return [(path, digit) for digit in CLASSES
            for path in sorted((digits_root / split / digit).iterdir())[:PER_CLASS[split]]]


@pytest.fixture(scope="module")
def csv_root(tmp_path_factory, digits_root) -> Path:
    """train.csv, val.csv and test.csv of `path,label`, the images flat in one folder (no class folders)."""
    root = tmp_path_factory.mktemp("csv")
    (root / "images").mkdir()
    for split in PER_CLASS:
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label"])
            for path, digit in _digit_files(digits_root, split):
                shutil.copy(path, root / "images" / f"{split}-{digit}-{path.name}")
                writer.writerow([f"images/{split}-{digit}-{path.name}", digit])
    return root


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory, digits_root) -> Path:
    """A DatasetDict saved with save_to_disk: train and test splits (no validation: val_split of train is held
    out), an Image column and a ClassLabel column, built here from the digits' files (nothing downloaded)."""
    import datasets  # the dev extra installs it: a broken install fails here, never skips
    splits = {}
    for split in ("train", "test"):
        files = _digit_files(digits_root, split)
        splits[split] = (datasets.Dataset.from_dict({"image": [str(p) for p, _ in files],
                                                     "label": [CLASSES.index(d) for _, d in files]})
                         .cast_column("image", datasets.Image())
                         .cast_column("label", datasets.ClassLabel(names=list(CLASSES))))
    root = tmp_path_factory.mktemp("hf") / "digits"
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return root


# ---- the sources, in this process ----------------------------------------------------------------------------


def test_csv_manifest_lists_single_label_samples_and_refuses_a_multilabel_file(csv_root, tmp_path):
    data = CsvDataModule(str(csv_root), batch_size=4, num_workers=0, image_size=32, preset="none")
    assert isinstance(data, ClassificationData) and not isinstance(data, ImageFolderDataModule)  # siblings
    assert (data.class_names, data.multilabel) == (list(CLASSES), False)
    data.setup("fit")
    assert len(data.train_set) == 32 and len(data.val_set) == 8 and isinstance(data.train_set, SeededImages)
    assert sorted(np.bincount(data.train_set.targets).tolist()) == [16, 16]
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    # A manifest with the multi-label column is refused, naming where multi-label data goes.
    (tmp_path / "train.csv").write_text("path,labels\nimages/a.png,cat dog\n")
    with pytest.raises(ValueError, match="multi-label data goes in a labels.csv in each split folder"):
        CsvDataModule(str(tmp_path))
    (tmp_path / "train.csv").write_text(
        "path,label\n" + "".join(f"{p},{d}\n" for p, d in [("../x.png", "0")]))
    with pytest.raises(FileNotFoundError, match="train.csv line 2: .*x.png does not exist"):
        CsvDataModule(str(tmp_path))
    (tmp_path / "train.csv").write_text("path,label\n../x.png,\n")  # single-label: every row names its class
    with pytest.raises(ValueError, match="train.csv line 2: the label is empty"):
        CsvDataModule(str(tmp_path))


def test_hugging_face_dataset_gives_the_files_pixels_and_its_classlabel_names(hf_root, digits_root):
    from datamodules import HFDataModule

    options = dict(batch_size=4, num_workers=0, image_size=32, preset="imagenet", val_split=0.25)
    data = HFDataModule(str(hf_root), **options)
    assert (data.class_names, data.multilabel, data.num_classes) == (list(CLASSES), False, 2)
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (24, 8)  # val_split of train, stratified
    assert sorted(np.bincount(data.val_set.targets).tolist()) == [4, 4]
    # The stored bytes decode to the pixels of the files they came from, as the image folder reads them.
    files = _digit_files(digits_root, "train")
    for i in range(3):
        image, target = data.val_set[i]
        path, digit = files[int(data.val_set.rows[i])]
        assert target == CLASSES.index(digit) and torch.equal(image, data.val_set.transform(read_image(str(path))))
    # Training draws are a function of their seed: repeatable, different for another seed.
    assert torch.equal(data.train_set[(0, 7)][0], data.train_set[(0, 7)][0])
    assert not torch.equal(data.train_set[(0, 7)][0], data.train_set[(0, 8)][0])


def test_hugging_face_without_the_extra_is_one_line_naming_it(monkeypatch, tmp_path):
    from datamodules import HFDataModule

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'imgcls\[hf\]'"):
        HFDataModule(str(tmp_path))


# ---- through the real command -------------------------------------------------------------------------------


def _config(tmp_path: Path, class_path: str, init_args: dict) -> Path:
    """The quickstart config, shrunk (TINY_ARCH at 32 px, 2 epochs of 4 steps, a step checkpoint every 2 steps), on
    the data source `class_path`, with random crops and flips (preset imagenet) that a resume must draw again."""
    cfg = resume_config()
    cfg["data"] = {"class_path": class_path, "init_args": {"batch_size": 8, "num_workers": 0, "image_size": 32,
                                                           "preset": "imagenet", **init_args}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path




def _killed_and_resumed_matches_the_uninterrupted_run(tmp_path: Path, config: Path) -> None:
    """Killed after step 3 (mid-epoch 0), the same command resumes from step 2's checkpoint, the loader's position
    and the augmentation seeds with it, and ends with the weights of the run never killed."""
    assert killed_and_resumed(config, tmp_path, kill_after=3, resumes_from=2) == 0.0


def test_csv_manifest_fit_killed_mid_epoch_resumes_to_identical_weights_and_validates_from_its_checkpoint(
        tmp_path, csv_root):
    config = _config(tmp_path, "datamodules.CsvDataModule", {"root": str(csv_root)})
    _killed_and_resumed_matches_the_uninterrupted_run(tmp_path, config)
    # From the checkpoint alone: the run's data class (the CSV manifest, not the default image folder) reads the root.
    proc = run_cli("validate", "--ckpt_path", str(tmp_path / "reference" / "checkpoints" / "last.ckpt"),
                   "--data.root", str(csv_root), "--data.num_workers", "0", "--trainer.accelerator", "cpu",
                   "--trainer.default_root_dir", str(tmp_path / "validate"))
    assert "data.class_path=datamodules.CsvDataModule" in proc.stdout + proc.stderr and "val/acc" in proc.stdout
    resolved = yaml.safe_load((tmp_path / "validate" / "validate_config.yaml").read_text())["data"]
    assert resolved["class_path"] == "datamodules.CsvDataModule"


def test_hugging_face_fit_killed_mid_epoch_resumes_to_identical_weights(tmp_path, hf_root):
    config = _config(tmp_path, "datamodules.HFDataModule", {"root": str(hf_root), "val_split": 0.25})
    _killed_and_resumed_matches_the_uninterrupted_run(tmp_path, config)


@pytest.fixture(scope="module")
def user_source_run(tmp_path_factory):
    """A fit of tests/user_plugins.py's TensorData (in-memory tensors, no transforms: no input contract) on the
    quickstart config, and its output."""
    run = tmp_path_factory.mktemp("user_source") / "run"
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY,
                   "--data.class_path", "tests.user_plugins.TensorData", "--data.images", "16",
                   "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(run))
    return run, proc


def test_a_users_own_datamodule_plugs_in_by_class_path_alone(user_source_run):
    """TensorData on the quickstart config: the image-folder keys it does not take are dropped with the class, the
    ones it does (image_size, batch_size) are kept."""
    run, proc = user_source_run
    assert "val/acc" in proc.stdout
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["hyper_parameters"]["class_names"] == ["dark", "bright"]
    assert ckpt["datamodule_hyper_parameters"]["_class_path"] == "tests.user_plugins.TensorData"
    assert ckpt["TensorData"] == {"training_batches": 1}  # 16 images, batch 16: the batch counter is checkpointed
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert saved["class_path"] == "tests.user_plugins.TensorData" and "root" not in saved["init_args"]


def test_a_checkpoint_without_an_input_contract_validates_on_its_source_and_exports_the_default_preprocessing(
        user_source_run, tmp_path, caplog):
    """The model of a source that states no input contract: validate runs on that source (which preprocesses its
    tensors itself) without a word about preprocessing; export reads the contract where evaluate, publish and serve
    do (`SavedRun.input_contract`), which takes the default evaluation preset's and says so in one line."""
    from datamodules.presets import ClassificationPresetEval
    from datamodules.transforms import contract_of
    from deploy.export import load_for_export

    run, _ = user_source_run
    ckpt = run / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True, map_location="cpu")["hyper_parameters"]["input_contract"] is None
    proc = run_cli("validate", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(tmp_path / "validate"))
    said = proc.stdout + proc.stderr
    assert "val/acc" in proc.stdout and "data.class_path=tests.user_plugins.TensorData" in said
    assert "input contract" not in said and "eval_transform" not in said
    with caplog.at_level("WARNING"):
        _, contract = load_for_export(ckpt)
    default = contract_of(ClassificationPresetEval())
    assert contract == default and default["image_size"] == 224
    lines = [r.getMessage() for r in caplog.records if "carries no input contract" in r.getMessage()]
    assert lines == [f"{ckpt} carries no input contract (its data source stated none): its preprocessing is taken to "
                     "be the default, datamodules.presets.ClassificationPresetEval(preset=imagenet, image_size=224, "
                     "resize_size=256)"]


def test_hugging_face_reads_a_folder_of_images_with_its_imagefolder_builder(tmp_path, monkeypatch):
    import datasets  # the dev extra installs it: a broken install fails here, never skips

    from datamodules import HFDataModule

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))  # not the user's cache
    root = make_image_folder(tmp_path / "images", {"cat": 3, "dog": 3}, splits=("train", "val"), size=32)
    data = HFDataModule(str(root), batch_size=2, num_workers=0, image_size=32, preset="none")
    assert data.class_names == ["cat", "dog"] and sorted(data.splits) == ["train", "validation"]
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (6, 6)  # validation/ is the val split: nothing held out
    path = data.train_set._cell(0)["path"]
    assert torch.equal(data.train_set[0][0], data.train_set.transform(read_image(path)))


def test_a_batch_without_seeds_is_augmented_from_the_datamodules_own_checkpointed_batch_count(tmp_path):
    """augment_on_device with a sampler that gives no per-draw seeds: each training batch draws from the count of
    training batches the DataModule has transferred, which its state_dict carries into a resumed run (no loop
    internals of the trainer are read)."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision

    from datamodules.datasets import collate_encoded

    root = make_image_folder(tmp_path / "images", {"a": 2, "b": 2}, splits=("train", "val"), size=48, ext=".jpg")

    def datamodule() -> ImageFolderDataModule:
        data = ImageFolderDataModule(str(root), batch_size=2, num_workers=0, image_size=32, preset="imagenet",
                                     augment_on_device=True, scan_cache=False)
        data.setup("fit")
        data.trainer = SimpleNamespace(training=True, global_rank=0, current_epoch=0,  # what the hooks read
                                       precision_plugin=Precision())
        return data

    data = datamodule()
    batch = collate_encoded([data.train_set[i] for i in range(2)])  # plain indices: no seeds in the batch
    first = data.on_after_batch_transfer(batch, 0)[0]
    state = data.state_dict()
    second = data.on_after_batch_transfer(batch, 0)[0]
    assert state == {"training_batches": 1} and not torch.equal(first, second)  # each batch its own crops
    resumed = datamodule()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.on_after_batch_transfer(batch, 0)[0], second)


def test_the_shipped_sources_are_named_by_their_class_name_alone():
    """`data.class_path: CsvDataModule`, as configs/quickstart.yaml offers it: the parser finds a short name among the
    ClassificationData subclasses imported, and `datamodules` imports a name only when it is first used."""
    for name in ("CsvDataModule", "HFDataModule", "ImageFolderDataModule"):
        printed = yaml.safe_load(run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.class_path",
                                         name, "--print_config").stdout)
        assert printed["data"]["class_path"] == f"datamodules.{name}"
