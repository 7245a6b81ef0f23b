"""`imgcls report`: curves and a Markdown summary from a run's CSV or TensorBoard logs."""

from __future__ import annotations

import csv

import pytest
from PIL import Image

from tests.helpers import CONFIGS, TINY, run_cli
from training.report import main as report_main
from training.report import read_csv, read_tensorboard


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
    assert len(series["train/loss"]) == 6 and len(series["lr-AdamW/pg4"]) == 6  # every step of 2 x 3 batches
    assert len(series["train/acc"]) == 2  # once per epoch, under the name the dashboards show
    assert not {"train/acc_step", "train/acc_epoch"} & set(series)
    with open(run / "metrics.csv", newline="") as f:
        last_val_acc = [float(r["val/acc"]) for r in csv.DictReader(f) if r["val/acc"]][-1]
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| val/acc |"))
    assert row.split("|")[2].strip() == f"{last_val_acc:.4f}"
    assert any(line.startswith("| train/acc |") for line in md.splitlines())
    assert "![loss](loss.png)" in md and "../figures/confusion_matrix.png" in md
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
