"""A checkpoint alone, with no network: validate, predict (predictions.csv, also under DDP), resume, and `imgcls export`
to ONNX and torch.export's program, never downloading the pretrained weights that the run was fine-tuned from."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torchvision
import yaml

from datamodules.decoding import load_rgb
from datamodules.listing import list_images
from datamodules.transforms import build_transform
from deploy.export import main as export_main
from deploy.publish import main as publish_main
from lightning_modules import ImageClassifier
from lightning_modules.network import without_pretrained_weights
from tests.helpers import CONFIGS, FREEZE_FIRST_EPOCH, ROOT, TINY, cli_env, free_port, run_cli, torchrun

# resnet18: the pretrained weights are a stand-in for its IMAGENET1K_V1 file in the hub cache
FIT = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--model.net.arch", "resnet18",
       "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1"]


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """A TORCH_HOME whose hub cache holds a stand-in for resnet18's IMAGENET1K_V1 file (random weights, seeded)."""
    home = tmp_path_factory.mktemp("hub_home")
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(),
               home / "hub" / "checkpoints" / "resnet18-f37072fd.pth")  # IMAGENET1K_V1's file name
    return home


@pytest.fixture
def offline_env(tmp_path_factory) -> dict[str, str]:
    """An empty TORCH_HOME: loading pretrained weights would mean a download (which fails without a network)."""
    return cli_env(TORCH_HOME=str(tmp_path_factory.mktemp("empty_torch_home")))


def assert_nothing_downloaded(env: dict[str, str]) -> None:
    assert not list(Path(env["TORCH_HOME"]).rglob("*")), ("pretrained weights were fetched although the checkpoint "
                                                          "had them")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, digits_root, hub_home):
    """A checkpoint of a tiny run on the digits, fine-tuned from model.net.weights=IMAGENET1K_V1 with the backbone
    frozen for its one short epoch: its hyperparameters name a torchvision weights enum, as a real fine-tuning run's
    do."""
    run = tmp_path_factory.mktemp("predict_run")
    run_cli(*FIT, "--data.root", str(digits_root), "--model.net.weights", "IMAGENET1K_V1",
            *FREEZE_FIRST_EPOCH, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(run),
            env=cli_env(TORCH_HOME=str(hub_home)))
    return run / "checkpoints" / "last.ckpt"


def load(checkpoint) -> ImageClassifier:
    net = torch.load(checkpoint, map_location="cpu", weights_only=True)["hyper_parameters"]["net"]
    return ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu",
                                                net=without_pretrained_weights(net)).float().eval()


def test_fresh_fit_loads_the_pretrained_backbone(checkpoint, hub_home):
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["net"]["init_args"]["weights"] == "IMAGENET1K_V1"
    pretrained = torch.load(hub_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth", weights_only=True)
    for key in ("conv1.weight", "layer4.1.bn2.running_var"):  # frozen for the whole run: still the cached values
        assert torch.equal(saved["state_dict"][f"net.backbone.{key}"], pretrained[key])


def test_validate_from_checkpoint_alone_downloads_nothing(checkpoint, digits_root, tmp_path, offline_env):
    proc = run_cli("validate", "--ckpt_path", str(checkpoint), "--data.root", str(digits_root), "--data.image_size",
                   "32", "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.limit_val_batches", "1",
                   "--trainer.default_root_dir", str(tmp_path), env=offline_env)
    assert "val/acc" in proc.stdout and "not loaded: the checkpoint supplies every weight" in proc.stdout + proc.stderr
    assert_nothing_downloaded(offline_env)


def test_resumed_fit_downloads_nothing_and_keeps_the_configured_weights(checkpoint, digits_root, tmp_path,
                                                                        offline_env):
    # The run's own settings (its frozen first epoch too): a resume that changes one is refused (test_from_checkpoint).
    run_cli(*FIT, "--data.root", str(digits_root), "--model.net.weights", "IMAGENET1K_V1", "--trainer.max_epochs", "2",
            *FREEZE_FIRST_EPOCH, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir",
            str(tmp_path), env=offline_env)
    assert_nothing_downloaded(offline_env)
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 1
    # A fresh fit of the resolved config, or of the new checkpoint's hyperparameters, still starts from them.
    assert resumed["hyper_parameters"]["net"]["init_args"]["weights"] == "IMAGENET1K_V1"
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["model"]["net"]["init_args"]["weights"] == "IMAGENET1K_V1"


@pytest.fixture(scope="module")
def images(tmp_path_factory, digits_root):
    """Seven unlabeled test digits in nested folders (odd on purpose: two ranks would need a padded sampler)."""
    folder = tmp_path_factory.mktemp("unlabeled")
    for i, path in enumerate(list_images(digits_root / "test")[::25][:7]):
        target = folder / f"batch{i % 2}" / f"img{i}.png"
        target.parent.mkdir(exist_ok=True)
        shutil.copy(path, target)
    return folder


def read_predictions(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def reference(checkpoint, paths: list[str]) -> torch.Tensor:
    """Probabilities computed here, in-process, with the run's eval transform: (N, num_classes)."""
    model = load(checkpoint)
    data = torch.load(checkpoint, map_location="cpu", weights_only=True)["datamodule_hyper_parameters"]
    tf = build_transform(data["eval_transform"])  # the DataModule's, as it ran (its preset's float output)
    with torch.no_grad():
        return model(torch.stack([tf(load_rgb(p)) for p in paths])).softmax(dim=1)


def test_predict_from_checkpoint_alone_writes_csv(checkpoint, images, tmp_path, offline_env):
    run_cli("predict", "--ckpt_path", str(checkpoint), "--data.root", "null", "--data.predict_dir", str(images),
            "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
            env=offline_env)
    assert_nothing_downloaded(offline_env)
    rows = read_predictions(tmp_path / "predictions.csv")
    paths = list_images(images)
    assert [r["path"] for r in rows] == paths  # every image once, in file order
    probs = reference(checkpoint, paths)
    names = load(checkpoint).class_names
    for row, p in zip(rows, probs, strict=True):
        top = p.topk(5)
        assert int(row["label"]) == int(top.indices[0]) and row["class_name"] == names[int(top.indices[0])]
        assert float(row["confidence"]) == pytest.approx(float(top.values[0]), abs=1e-4)
        top5 = [item.split(":") for item in row["top5"].split()]
        assert [name for name, _ in top5] == [names[i] for i in top.indices.tolist()]
        assert [float(v) for _, v in top5] == sorted((float(v) for _, v in top5), reverse=True)


@pytest.mark.slow
def test_predict_under_ddp_gathers_the_ranks_without_a_shared_disk(checkpoint, images, tmp_path, offline_env):
    """2 torchrun processes, each with its own run directory (two nodes, no shared disk): the parts travel through
    the process group, and rank 0 writes every image once, in order, none of the sampler's padding."""
    proc = subprocess.run(
        [*torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), module="tests.per_rank_run_dir"),
         str(tmp_path), "predict", "--ckpt_path", str(checkpoint),
         "--data.root", "null", "--data.predict_dir", str(images), "--data.num_workers", "0",
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
        cwd=ROOT, env=offline_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_predictions(tmp_path / "rank0" / "predictions.csv")
    paths = list_images(images)
    assert [r["path"] for r in rows] == paths  # 7 images on 2 ranks: each once, in order, none padded in
    assert [int(r["label"]) for r in rows] == reference(checkpoint, paths).argmax(dim=1).tolist()
    assert not (tmp_path / "rank1" / "predictions.csv").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "predictions" in p.name and p.parent.name != "rank0"]


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_export_matches_pytorch(checkpoint, tmp_path, fmt, offline_env):
    run_cli("export", "--ckpt_path", str(checkpoint), "--format", fmt, "--out", str(tmp_path), env=offline_env)
    assert_nothing_downloaded(offline_env)
    meta = json.loads((tmp_path / "model.json").read_text())
    size = meta["preprocessing"]["image_size"]
    assert size == 32 and len(meta["class_names"]) == 10 and meta["preprocessing"]["steps"]
    model = load(checkpoint)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))  # batch 3 != export's 2
    with torch.no_grad():
        expected = model(x).numpy()
    if fmt == "onnx":
        session = ort.InferenceSession(str(tmp_path / meta["model_file"]), providers=["CPUExecutionProvider"])
        got = session.run(["logits"], {"image": x.numpy()})[0]
    else:
        assert meta["model_file"] == "model.pt2"
        got = torch.export.load(tmp_path / meta["model_file"]).module()(x).detach().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_export_rejects_missing_checkpoint(tmp_path, capsys):
    """One line to stderr and exit 2, as publish, serve and the training commands answer a user's mistake."""
    with pytest.raises(SystemExit) as exited:
        export_main(["--ckpt_path", str(tmp_path / "nope.ckpt")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("imgcls export: error: --ckpt_path")
    assert "nope.ckpt does not exist" in err


def test_export_and_publish_refuse_a_sharded_checkpoint_naming_the_command_that_joins_it(tmp_path, capsys):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    expected = (f"--ckpt_path {folder} is a sharded checkpoint (a folder); make one file of it first: python -m "
                f"training.distributed.fsdp {folder} {tmp_path / 'last-full.ckpt'}")
    with pytest.raises(SystemExit) as exported:
        export_main(["--ckpt_path", str(folder)])
    assert exported.value.code == 2 and capsys.readouterr().err == f"imgcls export: error: {expected}\n"
    with pytest.raises(SystemExit):
        publish_main([str(tmp_path / "model"), "--ckpt_path", str(folder)])
    assert capsys.readouterr().err == f"imgcls publish: error: {expected}\n"
    assert not (tmp_path / "model").exists()
