"""Loggers chosen by config file: read back what TensorBoard and W&B will show (event files, the offline wandb run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import CONFIGS, ROOT, TINY, cli_env, free_port, run_cli

EPOCHS = 2


def git_head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, digits_root) -> Path:
    """One tiny 2-epoch run with configs/loggers/wandb.yaml (TensorBoard + W&B offline), no network, no API key."""
    run = tmp_path_factory.mktemp("wandb_run")
    env = {k: v for k, v in cli_env(WANDB_SILENT="true").items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "wandb.yaml"),
            *TINY, "--data.root", str(digits_root), "--trainer.max_epochs", str(EPOCHS),
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
            "--trainer.default_root_dir", str(run), env=env)
    return run


def test_tensorboard_events_hold_val_acc_every_epoch_and_pictures(wandb_run):
    scalars, images = {}, set()
    for events in wandb_run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(acc.Scalars(tag))
        images |= set(acc.Tags()["images"])
    epochs = {int(e.value) for e in scalars["epoch"]}
    assert epochs >= set(range(EPOCHS))
    # val/acc once per epoch, plus the final validation of the best checkpoint
    assert len(scalars["val/acc"]) == EPOCHS + 1
    assert all(0.0 <= e.value <= 1.0 for e in scalars["val/acc"])
    assert {"val/confusion_matrix", "val/misclassified"} <= images


def test_hyperparameters_hold_config_git_and_data_summary(wandb_run, digits_root):
    hparams = yaml.safe_load((wandb_run / "hparams.yaml").read_text())  # what TensorBoard's HPARAMS tab shows
    assert hparams["git"]["commit"] == git_head() and isinstance(hparams["git"]["dirty"], bool)
    train_counts = {c.name: len(list(c.iterdir())) for c in (digits_root / "train").iterdir()}
    assert hparams["data"]["train"] == train_counts
    assert yaml.safe_load(hparams["config"])["trainer"]["max_epochs"] == EPOCHS


def _wandb_inspect(run_dir: Path, *args: str) -> str:
    wandb = Path(sys.executable).parent / "wandb"  # the CLI installed with the wandb package
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, f"expected one offline wandb run, found {offline}"
    proc = subprocess.run([str(wandb), "leet", "inspect", *args, str(offline[0])], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_wandb_offline_run_holds_metrics_config_and_images(wandb_run):
    # wandb's own reader of the .wandb transaction log (what `wandb sync` uploads).
    records = [json.loads(line) for line in _wandb_inspect(wandb_run, "--json").splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    val = [h for h in history if "val/acc" in h]
    assert len(val) == EPOCHS + 1 and {h["epoch"] for h in val[:EPOCHS]} == set(range(EPOCHS))
    for tag in ("val/confusion_matrix", "val/misclassified"):  # image records: one per validation epoch
        logged = [h for h in history if f"{tag}._type" in h]
        assert len(logged) == EPOCHS + 1
        media = Path(next(wandb_run.glob("wandb/offline-run-*"))) / "files" / logged[-1][f"{tag}.filenames"][0]
        assert media.is_file()
    summary = json.loads(_wandb_inspect(wandb_run, "--summary", "--json"))
    assert summary["config"]["git"]["commit"] == git_head()
    assert sum(summary["config"]["data"]["val"].values()) > 0


@pytest.mark.slow
def test_ddp_run_makes_one_wandb_run_and_a_confusion_matrix_of_every_rank(tmp_path, digits_root):
    env = {k: v for k, v in cli_env(WANDB_SILENT="true", MASTER_PORT=str(free_port())).items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "wandb.yaml"),
            *TINY, "--data.root", str(digits_root), "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
            "--trainer.default_root_dir", str(tmp_path), env=env)
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # rank 0 only
    matrix = np.loadtxt(tmp_path / "figures" / "confusion_matrix.csv", delimiter=",")
    assert matrix.shape == (10, 10) and matrix.sum() == 2 * 2 * 16  # 2 ranks x 2 batches x 16 images
