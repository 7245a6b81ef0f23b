"""Loggers chosen by config file: read back what TensorBoard and W&B will show (event files, the offline wandb run)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.metadata import (
    EXPERIMENT_TAG,
    SESSION_START_INFO_TAG,
    parse_session_start_info_plugin_data,
)

from tests.helpers import (
    CONFIGS,
    ROOT,
    TINY,
    WANDB_VARS,
    free_port,
    kill_args,
    resume_config,
    run_cli,
    wandb_inspect,
    wandb_offline_env,
    wandb_offline_runs,
)
from training.cli.app import ImgclsCLI, cli_main
from training.records.loggers import HP_METRIC, RESULT_RUN, SecretSafeWandbLogger, hyperparameters
from training.records.report import read_run
from training.records.run_dir import WANDB_RUN_ID_FILE

EPOCHS = 2


def git_head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def fit_args(root: Path, run: Path) -> list[str]:
    return ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "wandb.yaml"),
            *TINY, "--data.root", str(root), "--trainer.max_epochs", str(EPOCHS), "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "2", "--trainer.default_root_dir", str(run)]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, digits_root) -> Path:
    """One tiny 2-epoch run with configs/loggers/wandb.yaml (TensorBoard + W&B offline), no network, no API key."""
    run = tmp_path_factory.mktemp("wandb_run")
    run_cli(*fit_args(digits_root, run), env=wandb_offline_env())
    return run


def tensorboard_events(run: Path) -> tuple[dict[str, list], dict[str, list]]:
    """The scalars and images of a run's own event files (not of the runs in its sub-folders), by tag."""
    scalars, images = {}, {}
    for events in run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(acc.Scalars(tag))
        for tag in acc.Tags()["images"]:
            images.setdefault(tag, []).extend(acc.Images(tag))
    return scalars, images


def test_tensorboard_events_hold_val_acc_every_epoch_and_pictures(wandb_run):
    scalars, images = tensorboard_events(wandb_run)
    # val/acc once per epoch; no closing validation: the fit's validation of the best weights is known
    values = [e.value for e in sorted(scalars["val/acc"], key=lambda e: e.wall_time)]
    assert len(values) == EPOCHS and all(0.0 <= v <= 1.0 for v in values)
    for tag in ("val/confusion_matrix", "val/misclassified"):  # the first and the last validation always drawn
        assert len(images[tag]) == EPOCHS


def test_tensorboard_opens_on_the_train_and_val_curves_without_an_epoch_card(wandb_run):
    """TensorBoard sorts its cards by tag and opens the first two groups: every tag of the run is under train/ or
    val/ (the learning rate too), and `epoch` is left out (CSV and W&B keep it)."""
    scalars, images = tensorboard_events(wandb_run)
    assert {tag.split("/")[0] for tag in [*scalars, *images]} == {"train", "val"}
    assert "epoch" not in scalars


def test_the_runs_result_is_its_best_val_acc_with_its_settings(wandb_run):
    """The HPARAMS tab's row of the run (its `hparams` sub-run): val/hp_metric is the best val/acc, which the best
    checkpoint holds, logged once at the fit's last step, beside the run's settings under their command-line names."""
    scalars, _ = tensorboard_events(wandb_run)
    assert "hp_metric" not in scalars  # Lightning's placeholder (-1): configs say default_hp_metric: false
    best = max(e.value for e in scalars["val/acc"])
    acc = EventAccumulator(str(wandb_run / RESULT_RUN), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Tags()["scalars"] == [HP_METRIC]
    (result,) = acc.Scalars(HP_METRIC)
    last = torch.load(wandb_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    (ranking,) = [c for k, c in last["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert result.value == pytest.approx(best) == float(ranking["best_model_score"])
    assert result.step == last["global_step"]
    start = acc.summary_metadata[SESSION_START_INFO_TAG].plugin_data.content
    settings = parse_session_start_info_plugin_data(start).hparams
    assert settings["model.optimizer"].string_value == "torch.optim.AdamW"
    assert settings["model.optimizer.lr"].number_value == pytest.approx(0.016)
    assert settings["trainer.max_epochs"].number_value == EPOCHS and settings["git.commit"].string_value == git_head()
    assert EXPERIMENT_TAG not in acc.summary_metadata  # TensorBoard builds the table from every run: what differs first


def test_hyperparameters_hold_config_git_and_data_summary(wandb_run, digits_root):
    hparams = yaml.safe_load((wandb_run / "hparams.yaml").read_text())  # what TensorBoard's HPARAMS tab shows
    assert hparams["git"]["commit"] == git_head() and isinstance(hparams["git"]["dirty"], bool)
    train_counts = {c.name: len(list(c.iterdir())) for c in (digits_root / "train").iterdir()}
    assert hparams["data"]["train"] == train_counts
    assert yaml.safe_load(hparams["config"])["trainer"]["max_epochs"] == EPOCHS


def test_wandb_offline_run_holds_metrics_config_and_images(wandb_run):
    # wandb's own reader of the .wandb transaction log (what `wandb sync` uploads).
    records = [json.loads(line) for line in wandb_inspect(wandb_run, "--json").splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    val = [h for h in history if "val/acc" in h]
    assert len(val) == EPOCHS and {h["epoch"] for h in val} == set(range(EPOCHS))
    for tag in ("val/confusion_matrix", "val/misclassified"):  # image records: one per validation epoch
        logged = [h for h in history if f"{tag}._type" in h]
        assert len(logged) == EPOCHS
        media = Path(next(wandb_run.glob("wandb/offline-run-*"))) / "files" / logged[-1][f"{tag}.filenames"][0]
        assert media.is_file()
    summary = json.loads(wandb_inspect(wandb_run, "--summary", "--json"))
    assert summary["config"]["git"]["commit"] == git_head()
    assert sum(summary["config"]["data"]["val"].values()) > 0


@pytest.mark.parametrize(("env", "online", "agent_run"), [
    ({}, False, None),
    ({"WANDB_API_KEY": "k" * 40}, True, None),
    ({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}, False, None),
    ({"WANDB_SWEEP_ID": "sweep1", "WANDB_RUN_ID": "run1"}, True, "run1"),  # what `wandb agent` sets for its runs
], ids=["no-key", "api-key", "key-but-WANDB_MODE", "wandb-agent"])
def test_wandb_goes_online_with_a_key_or_under_an_agent(monkeypatch, digits_root, tmp_path, env, online, agent_run):
    for var in WANDB_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr("sys.argv", ["imgcls"])
    # Configure and instantiate everything, but run nothing: an online run would need the network.
    monkeypatch.setattr(ImgclsCLI, "_run_subcommand", lambda self, subcommand: None)
    cli = cli_main(fit_args(digits_root, tmp_path))
    config = next(c for c in cli.config.fit.trainer.logger if c.class_path.endswith("WandbLogger"))
    assert config.init_args.offline is (not online)  # what the logger was built with, and what config.yaml records
    run_dir = tmp_path / agent_run if agent_run else tmp_path  # the agent runs one command line for every trial
    assert Path(cli.trainer.default_root_dir) == run_dir
    logger = next(lg for lg in cli.trainer.loggers if isinstance(lg, WandbLogger))
    assert isinstance(logger, SecretSafeWandbLogger) and logger.save_dir == str(run_dir)


@pytest.mark.slow
def test_ddp_run_makes_one_wandb_run_and_a_confusion_matrix_of_every_rank(tmp_path, digits_root):
    env = wandb_offline_env(MASTER_PORT=str(free_port()))
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "wandb.yaml"),
            *TINY, "--data.root", str(digits_root), "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
            "--trainer.default_root_dir", str(tmp_path), env=env)
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # rank 0 only
    matrix = np.loadtxt(tmp_path / "figures" / "confusion_matrix.csv", delimiter=",")
    assert matrix.shape == (10, 10) and matrix.sum() == 2 * 2 * 16  # 2 ranks x 2 batches x 16 images


@pytest.mark.slow  # two tiny fits, the first SIGKILLed
def test_every_logger_holds_each_step_once_after_a_kill_and_a_resume(tmp_path, digits_root):
    """TensorBoard, CSV and W&B (offline), named by Lightning's class paths as a user's config would: a fit of 12
    steps SIGKILLed after step 5 (its newest checkpoint is step 4's: the steps after it are trained again), then
    resumed. Each logger then holds every step from 0 to 11 once, the resumed fit continues the same W&B run, and
    `imgcls report` draws one curve."""
    config = resume_config()  # a step checkpoint every 2 steps, deterministic
    config["trainer"]["logger"] = [
        {"class_path": f"lightning.pytorch.loggers.{name}", "init_args": {"save_dir": "", "name": "", "version": ""}}
        for name in ("TensorBoardLogger", "CSVLogger")] + [
        {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": "", "offline": True}}]
    path = tmp_path / "loggers.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    args = ["fit", "--config", str(path), *TINY, "--data.root", str(digits_root), "--trainer.limit_train_batches", "6",
            "--trainer.limit_val_batches", "2", "--trainer.default_root_dir", str(run)]
    # W&B writes its run file every second (training.records.loggers.WANDB_FLUSH_S): the kill comes 1.5 s after step 5.
    killed = run_cli(*args, *kill_args(5, "train"), "--trainer.callbacks.wait", "1.5", check=False,
                     env=wandb_offline_env())
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli(*args, env=wandb_offline_env())
    assert f"resuming from {run / 'checkpoints' / 'step0000004.ckpt'}" in resumed.stdout + resumed.stderr
    every = list(range(12))
    keys = ("train/loss", "train/lr/pg1")

    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for key in keys:
        assert [int(r["step"]) for r in rows if r.get(key)] == every, key

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})  # the folder as TensorBoard reads it
    acc.Reload()
    for key in keys:
        assert [e.step for e in acc.Scalars(key)] == every, key

    (first, _), (second, _) = offline = wandb_offline_runs(run)  # one per process, the same W&B run
    assert first["run_id"] == second["run_id"] == (run / WANDB_RUN_ID_FILE).read_text().strip()
    assert second.get("resume") is True and not first.get("resume")
    # The id stays out of the resolved config: rerun elsewhere, config.yaml starts a W&B run of its own.
    loggers = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["logger"]
    assert next(lg for lg in loggers if lg["class_path"].endswith("WandbLogger"))["init_args"].get("id") is None
    history = [row for _, rows in offline for row in rows]
    for key in keys:
        assert [h["trainer/global_step"] for h in history if key in h] == every, key

    series = read_run(run)  # imgcls report's reading
    for key in keys:
        assert [step for step, _ in series[key]] == every, key
    # From the fit that continued: step 4's loss as the resumed fit logged it (bitwise, as the resume is exact).
    assert dict(series["train/loss"])[4] == pytest.approx(float(next(r for r in rows if r.get("train/loss")
                                                                      and int(r["step"]) == 4)["train/loss"]))


def test_the_hparams_columns_are_the_settings_under_their_command_line_names():
    config = {"seed_everything": 42, "ckpt_path": None,
              "trainer": {"max_epochs": 8, "precision": "auto", "max_steps": -1, "gradient_clip_val": None,
                          "logger": [{"class_path": "x"}], "default_root_dir": "runs/q"},
              "model": {"net": {"class_path": "lightning_modules.BackboneWithHead",
                                "init_args": {"arch": "resnet50", "weights": None, "dropout": 0.2}},
                        "optimizer": {"class_path": "torch.optim.AdamW",
                                      "init_args": {"lr": 0.016, "betas": [0.9, 0.99]}},
                        "recipe": {"mixup_alpha": 0.0, "lr_scaling": "linear"}, "multilabel": False},
              "data": {"class_path": "datamodules.ImageFolderDataModule", "init_args": {"batch_size": 64}}}
    assert hyperparameters(config) == {
        "model.net": "lightning_modules.BackboneWithHead", "model.net.arch": "resnet50", "model.net.dropout": 0.2,
        "model.optimizer": "torch.optim.AdamW", "model.optimizer.lr": 0.016, "model.optimizer.betas": "[0.9, 0.99]",
        "model.recipe.mixup_alpha": 0.0, "model.recipe.lr_scaling": "linear", "model.multilabel": False,
        "data": "datamodules.ImageFolderDataModule", "data.batch_size": 64,
        "seed_everything": 42, "trainer.max_epochs": 8, "trainer.max_steps": -1, "trainer.precision": "auto"}
