"""`imgcls predict` from a checkpoint alone (predictions.csv, also under DDP) and `imgcls export` to ONNX/TorchScript."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from datamodules.images import list_images, load_rgb
from datamodules.presets import ClassificationPresetEval
from lightning_modules import ImageClassifier
from tests.helpers import CONFIGS, TINY, cli_env, free_port, run_cli
from training.export import main as export_main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, digits_root):
    """A checkpoint of a tiny run on the digits (one short epoch: the weights only need to be non-trivial)."""
    run = tmp_path_factory.mktemp("predict_run")
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(digits_root),
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1",
            "--trainer.default_root_dir", str(run))
    return run / "checkpoints" / "last.ckpt"


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
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu").float().eval()
    data = torch.load(checkpoint, map_location="cpu", weights_only=True)["datamodule_hyper_parameters"]
    tf = ClassificationPresetEval(preset=data["preset"], image_size=data["image_size"])
    with torch.no_grad():
        return model(torch.stack([tf(load_rgb(p)) for p in paths])).softmax(dim=1)


def test_predict_from_checkpoint_alone_writes_csv(checkpoint, images, tmp_path):
    run_cli("predict", "--ckpt_path", str(checkpoint), "--data.root", "null", "--data.predict_dir", str(images),
            "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path))
    rows = read_predictions(tmp_path / "predictions.csv")
    paths = list_images(images)
    assert [r["path"] for r in rows] == paths  # every image once, in file order
    probs = reference(checkpoint, paths)
    names = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu").class_names
    for row, p in zip(rows, probs, strict=True):
        top = p.topk(5)
        assert int(row["label"]) == int(top.indices[0]) and row["class_name"] == names[int(top.indices[0])]
        assert float(row["confidence"]) == pytest.approx(float(top.values[0]), abs=1e-4)
        top5 = [item.split(":") for item in row["top5"].split()]
        assert [name for name, _ in top5] == [names[i] for i in top.indices.tolist()]
        assert [float(v) for _, v in top5] == sorted((float(v) for _, v in top5), reverse=True)


@pytest.mark.slow
def test_predict_under_ddp_merges_ranks_without_padding_duplicates(checkpoint, images, tmp_path):
    run_cli("predict", "--ckpt_path", str(checkpoint), "--data.root", "null", "--data.predict_dir", str(images),
            "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.strategy", "ddp", "--trainer.default_root_dir", str(tmp_path),
            env=cli_env(MASTER_PORT=str(free_port())))
    rows = read_predictions(tmp_path / "predictions.csv")
    paths = list_images(images)
    assert [r["path"] for r in rows] == paths  # 7 images on 2 ranks: each once, in order, none padded in
    assert [int(r["label"]) for r in rows] == reference(checkpoint, paths).argmax(dim=1).tolist()
    assert not list(tmp_path.glob(".predictions.csv.rank*"))  # the parts are merged and removed


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_matches_pytorch(checkpoint, tmp_path, fmt):
    run_cli("export", "--ckpt_path", str(checkpoint), "--format", fmt, "--out", str(tmp_path))
    meta = json.loads((tmp_path / "model.json").read_text())
    size = meta["preprocessing"]["image_size"]
    assert size == 32 and len(meta["class_names"]) == 10 and meta["preprocessing"]["steps"]
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu").float().eval()
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))  # batch 3 != export's 2
    with torch.no_grad():
        expected = model(x).numpy()
    if fmt == "onnx":
        session = ort.InferenceSession(str(tmp_path / meta["model_file"]), providers=["CPUExecutionProvider"])
        got = session.run(["logits"], {"image": x.numpy()})[0]
    else:
        got = torch.jit.load(str(tmp_path / meta["model_file"]))(x).detach().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_export_rejects_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="nope.ckpt does not exist"):
        export_main(["--ckpt_path", str(tmp_path / "nope.ckpt")])
