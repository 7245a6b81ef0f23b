"""The transform seam (datamodules/transforms.py): the shipped presets and a user's own transforms arrive by
class_path, the evaluation one becomes the model's input contract, and a checkpoint evaluates, predicts, exports and
resumes with what it was trained with."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from torchvision.transforms import v2

import datamodules.image_data
from datamodules import ClassificationData, ImageFolderDataModule
from datamodules.decoding import read_image
from datamodules.listing import list_images
from datamodules.presets import IMAGENET_MEAN, IMAGENET_STD, ClassificationPresetEval, ClassificationPresetTrain
from datamodules.transforms import build_transform, eval_pipeline
from deploy.export import preprocessing_section
from lightning_modules import ImageClassifier
from tests.helpers import CONFIGS, killed_and_resumed, make_image_folder, resume_config, run_cli
from tests.user_plugins import SquareResize
from training.records.saved_run import SavedRun

USER_TRANSFORMS = {  # by YAML alone: a v2 Compose holding a user's step, and a user's evaluation class
    "train_transform": {"class_path": "torchvision.transforms.v2.Compose", "init_args": {"transforms": [
        {"class_path": "torchvision.transforms.v2.RandomResizedCrop", "init_args": {"size": 32, "scale": [0.5, 1.0]}},
        {"class_path": "tests.user_plugins.ChannelJitter", "init_args": {"strength": 20}}]}},
    "eval_transform": {"class_path": "tests.user_plugins.SquareResize", "init_args": {"size": 32, "mean": 0.4}},
}
# The runs here swap the optimizer and schedule by YAML alone as well: torch's RMSprop and OneCycleLR
ONE_CYCLE = {"optimizer": {"class_path": "torch.optim.RMSprop", "init_args": {"lr": 0.01, "momentum": 0.9}},
             "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.OneCycleLR", "init_args": {"max_lr": 0.02}}}


def test_a_preset_runs_contract_holds_its_values_and_rebuilds_its_eval_transform():
    data = ImageFolderDataModule(None, train_transform=ClassificationPresetTrain(image_size=40),
                                 eval_transform=ClassificationPresetEval(image_size=48, resize_size=56))
    contract = data.input_contract
    assert {k: v for k, v in contract.items() if k != "transform"} == {
        "preset": "imagenet", "image_size": 48, "resize_size": 56, "crop": "center", "interpolation": "bilinear",
        "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    rebuilt = build_transform(contract["transform"])
    image = torch.randint(0, 256, (3, 70, 60), dtype=torch.uint8)
    expected = ClassificationPresetEval(image_size=48, resize_size=56)(image)  # float, normalised
    assert torch.equal(rebuilt(image), expected)
    assert torch.equal(eval_pipeline(contract)(image), expected)  # what serving runs and export lists
    # FixRes: each preset keeps its own side.
    assert (data.device_batches.train_size, contract["image_size"]) == (40, 48)


def test_a_users_eval_transform_states_the_contract_and_sets_the_float_stage():
    data = ImageFolderDataModule(None, eval_transform=SquareResize(32, mean=0.4, std=0.2),
                                 train_transform=v2.RandomResizedCrop(32))
    contract = data.input_contract
    assert (contract["image_size"], contract["mean"], contract["std"]) == (32, [0.4] * 3, [0.2] * 3)
    assert contract["transform"] is None  # built in Python: no config to rebuild it from
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    torch.testing.assert_close(data.device_batches.float_stage(x), (x.float() / 255 - 0.4) / 0.2)
    # A contract that cannot state what a server needs is refused in one line, never guessed.
    with pytest.raises(ValueError, match=r"states no image_size, mean, std: export writes them"):
        preprocessing_section(ImageFolderDataModule(None, eval_transform=v2.Resize([32, 32])).input_contract)
    with pytest.raises(ValueError, match="data.fast_decode decodes JPEGs inside the training transform, and "
                                         "RandomResizedCrop takes decoded images"):
        ImageFolderDataModule(None, train_transform=v2.RandomResizedCrop(32), fast_decode=True)


def test_normalize_in_the_workers_and_two_normalisations_refused_at_fit(tmp_path):
    root = make_image_folder(tmp_path / "img", {"a": 2, "b": 2}, size=40)
    data = ImageFolderDataModule(str(root), batch_size=4, num_workers=0, normalize_on_device=False,
                                 eval_transform=SquareResize(32), train_transform=v2.RandomResizedCrop(32),
                                 scan_cache=False)
    data.setup("fit")
    image, _ = data.val_set[0]
    expected = (SquareResize(32)(read_image(data.val_set.paths[0])).float() / 255 - 0.5) / 0.25
    assert image.dtype == torch.float32
    torch.testing.assert_close(image, expected, rtol=0, atol=1e-6)
    clash = ImageFolderDataModule(str(root), eval_transform=SquareResize(32), scan_cache=False,
                                  train_transform=ClassificationPresetTrain(preset="imagenet", image_size=32))
    with pytest.raises(ValueError, match="data.train_transform normalises with mean, std"):
        clash.setup("fit")


def test_the_short_forms_set_both_presets_over_their_own_and_say_what_they_replace(monkeypatch):
    said = []
    monkeypatch.setattr(datamodules.image_data, "rank_zero_info", said.append)
    data = ImageFolderDataModule(None, preset="none", image_size=48,
                                 train_transform=ClassificationPresetTrain(auto_augment="trivialaugment"))
    assert (data.train_transform.preset, data.train_transform.image_size) == ("none", 48)
    assert data.input_contract["transform"]["init_args"] == {"preset": "none", "image_size": 48, "resize_size": None}
    assert said == []  # the presets stated neither: nothing replaced
    data = ImageFolderDataModule(None, image_size=48, train_transform=ClassificationPresetTrain(image_size=160),
                                 eval_transform=ClassificationPresetEval(image_size=224, resize_size=236))
    assert (data.train_transform.image_size, data.eval_transform.image_size, data.eval_transform.resize_size) == (
        48, 48, 55)  # the usual crop ratio of the new side
    assert said == ["data.image_size=48 (short form) replaces data.train_transform.image_size=160, "
                    "data.eval_transform.image_size=224, data.eval_transform.resize_size=236"]
    with pytest.raises(ValueError, match="short forms for the shipped presets, and data.eval_transform is "
                                         "SquareResize: set its own arguments"):
        ImageFolderDataModule(None, image_size=48, eval_transform=SquareResize(32))


def test_the_short_form_typed_last_wins_over_a_recipes_sizes_and_says_so(monkeypatch):
    """The issue's command: the recipe sets 160 and 224 px, and --data.image_size 32, typed last, is what the data
    source built from the printed config uses (it was 160 and 224, beside data.image_size: 32)."""
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config",
                   str(CONFIGS / "recipes" / "rsb_a3.yaml"), "--data.image_size", "32", "--print_config")
    data = yaml.safe_load(proc.stdout)["data"]
    assert data["init_args"]["image_size"] == 32
    data["init_args"]["root"] = None  # built without reading a folder
    said = []
    monkeypatch.setattr(datamodules.image_data, "rank_zero_info", said.append)
    built = ClassificationData.from_config(data)
    assert (built.train_transform.image_size, built.eval_transform.image_size, built.input_contract["image_size"]) \
        == (32, 32, 32)
    assert said == ["data.image_size=32 (short form) replaces data.train_transform.image_size=160, "
                    "data.eval_transform.image_size=224, data.eval_transform.resize_size=236"]


# ---- a user's transforms, by YAML alone, through the real command -----------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("user_tf") / "images", {"a": 12, "b": 12},
                             splits=("train", "val"), size=40)


def _config(folder, images) -> str:
    cfg = resume_config()
    cfg["data"].update(root=str(images), batch_size=8, num_workers=0, **USER_TRANSFORMS)
    cfg["model"].update(**ONE_CYCLE)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, images):
    folder = tmp_path_factory.mktemp("user_run")
    proc = run_cli("fit", "--config", str(_config(folder, images)), "--trainer.default_root_dir", str(folder / "run"))
    assert "val/acc" in proc.stdout and "RMSprop lr 0.01 per 256 images" in proc.stdout + proc.stderr
    return folder / "run"


def test_a_checkpoint_evaluates_predicts_and_exports_with_the_users_eval_transform(user_run, images, tmp_path):
    ckpt = user_run / "checkpoints" / "last.ckpt"
    contract = SavedRun.read(ckpt).input_contract
    assert contract["transform"] == {"class_path": "tests.user_plugins.SquareResize",
                                     "init_args": {"size": 32, "mean": 0.4, "std": 0.25}}
    assert (contract["image_size"], contract["mean"], contract["std"]) == (32, [0.4] * 3, [0.25] * 3)
    # No config: the checkpoint's eval transform, said in one line.
    proc = run_cli("validate", "--ckpt_path", str(ckpt), "--data.root", str(images), "--data.num_workers", "0",
                   "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / "val"))
    assert "data.eval_transform=tests.user_plugins.SquareResize(size=32, mean=0.4, std=0.25)" in proc.stdout + \
        proc.stderr
    run_cli("predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(images / "val" / "a"),
            "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(tmp_path / "pred"))
    with open(tmp_path / "pred" / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    from lightning_modules import ImageClassifier

    model = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True, weights=None).eval()
    paths = list_images(images / "val" / "a")
    x = torch.stack([SquareResize(32, mean=0.4)(read_image(p)) for p in paths]).float() / 255
    with torch.no_grad():
        probs = model((x - 0.4) / 0.25).softmax(dim=1)
    assert [r["path"] for r in rows] == paths
    for row, p in zip(rows, probs, strict=True):
        assert float(row["confidence"]) == pytest.approx(float(p.max()), abs=1e-4)
    run_cli("export", "--ckpt_path", str(ckpt), "--format", "pt2", "--out", str(tmp_path / "export"))
    pre = json.loads((tmp_path / "export" / "model.json").read_text())["preprocessing"]
    assert (pre["image_size"], pre["mean"]) == (32, [0.4] * 3) and "SquareResize" in pre["steps"][0]


def test_a_users_transforms_optimizer_and_schedule_resume_after_kill_to_identical_weights(tmp_path, images,
                                                                                         user_run):
    """ChannelJitter and RandomResizedCrop draw from torch's generator, which the per-sample seed replays. RMSprop and
    OneCycleLR, named in YAML only: OneCycleLR gets the run's total_steps from the model, and the checkpoint holds
    both as class_path and init_args (load_from_checkpoint rebuilds them). The run never killed is user_run's, of the
    same config."""
    assert killed_and_resumed(_config(tmp_path, images), tmp_path, kill_after=3, resumes_from=2,
                              reference=user_run) == 0.0
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    saved = ckpt["hyper_parameters"]
    assert saved["optimizer"]["class_path"] == "torch.optim.RMSprop" and saved["optimizer"]["init_args"]["lr"] == 0.01
    assert saved["lr_scheduler"]["init_args"]["max_lr"] == 0.02
    assert ckpt["lr_schedulers"][0]["total_steps"] == 6  # from the model: 2 epochs of 3 steps (24 images, batch 8)
    model = ImageClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True)
    assert isinstance(model.make_optimizer(), torch.optim.RMSprop)
