"""`imgcls report`: curves and a Markdown summary from a run's CSV or TensorBoard logs."""

from __future__ import annotations

import csv

import pytest
from PIL import Image

from tests.helpers import CONFIGS, TINY, run_cli
from training.records.report import main as report_main
from training.records.report import read_csv, read_tensorboard


def test_report_from_csv_log_writes_curves_and_summary(tmp_path, digits_root):
    run = tmp_path / "run"
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "csv.yaml"),
            *TINY, "--data.root", str(digits_root), "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
            "--trainer.default_root_dir", str(run))
    assert not list(run.glob("events.out.tfevents.*"))  # the CSV logger replaced TensorBoard
    proc = run_cli("report", str(run))
    out = run / "report"
    for name in ("loss.png", "accuracy.png", "learning_rate.png"):
        with Image.open(out / name) as img:
            assert img.size[0] > 300 and img.size[1] > 200
    series = read_csv(run)
    assert len(series["train/loss"]) == 6 and len(series["train/lr/pg4"]) == 6  # every step of 2 x 3 batches
    assert len(series["train/acc"]) == 2  # once per epoch, under the name the dashboards show
    assert not {"train/acc_step", "train/acc_epoch"} & set(series)
    with open(run / "metrics.csv", newline="") as f:
        last_val_acc = [float(r["val/acc"]) for r in csv.DictReader(f) if r["val/acc"]][-1]
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| val/acc |"))
    assert row.split("|")[2].strip() == f"{last_val_acc:.4f}"
    assert any(line.startswith("| train/acc |") for line in md.splitlines())
    assert "![loss](loss.png)" in md and "../figures/confusion_matrix.png" in md
    assert "../figures/per_class.png" in md  # the per-class chart (10 digits)
    per_class = md.split("## Per class (last validation)", 1)[1].split("## Curves")[0]
    rows = [line.split("|")[1:-1] for line in per_class.splitlines() if line.startswith("| ") and "class" not in line]
    assert [r[0].strip() for r in rows] == [str(d) for d in range(10)]
    assert all(0.0 <= float(v) <= 1.0 for r in rows for v in r[1:4])
    assert f"imgcls fit --config {run / 'config.yaml'}" in md
    assert "report.md" in proc.stdout


def test_report_without_logs_says_what_to_pass(tmp_path):
    with pytest.raises(SystemExit, match="no TensorBoard events and no metrics.csv"):
        report_main([str(tmp_path)])


def test_tensorboard_reader_keeps_every_point(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        for step in range(50):
            writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    series = read_tensorboard(tmp_path)
    assert [s for s, _ in series["train/loss"]] == list(range(50))


def test_per_class_scores_match_torchmetrics():
    import numpy as np
    import torch
    from torchmetrics.functional.classification import (
        multiclass_confusion_matrix,
        multiclass_f1_score,
        multiclass_precision,
        multiclass_recall,
    )

    from training.records.plots import per_class_scores

    torch.manual_seed(0)
    target = torch.randint(0, 5, (300,))
    preds = torch.where(torch.rand(300) < 0.6, target, torch.randint(0, 5, (300,)))
    preds[preds == 4] = 3  # class 4 never predicted: precision 0 by convention
    scores = per_class_scores(multiclass_confusion_matrix(preds, target, 5).numpy())
    for k, fn in enumerate((multiclass_precision, multiclass_recall, multiclass_f1_score)):
        assert np.allclose(scores[:, k], fn(preds, target, 5, average=None).numpy(), atol=1e-6)
    assert scores[:, 3].tolist() == torch.bincount(target, minlength=5).tolist()
