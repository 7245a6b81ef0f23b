"""A checkpoint evaluates and predicts with the preprocessing and classes it was trained with, and a fit continues a
checkpoint only when it is the same, unfinished run (training/resume/same_run.py).

One tiny run, trained once: the quickstart recipe (preset none, 32 px) on digits whose class folders are named
`zero` ... `nine`, so that the DataModule's defaults (imagenet preset, 224 px, `data/digits` with folders `0` ... `9`)
differ from the run in every way that used to pass in silence.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import CONFIGS, TINY, printed_metrics, run_cli
from training.records.report import read_tensorboard

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EVAL = ["--data.num_workers", "0", "--trainer.accelerator", "cpu"]
# TINY with resnet18: in the run's 30 steps it learns to tell the digits apart, which TINY_ARCH does not
# 30 steps of resnet18 from scratch: blocks that start as the identity (the default) are still at chance there, and
# these tests are about what the checkpoint carries, not the init
LEARNS = [*TINY, "--model.net.arch", "resnet18", "--model.net.zero_init_residual", "false"]


def copy_digits(digits_root: Path, out: Path, names: list[str], per_split: dict[str, int]) -> Path:
    """A subset of the demo digits with class folder `d` renamed to names[d]."""
    for split, count in per_split.items():
        for digit, name in enumerate(names):
            folder = out / split / name
            folder.mkdir(parents=True)
            for path in sorted((digits_root / split / str(digit)).iterdir())[:count]:
                shutil.copy(path, folder / path.name)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory, digits_root) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("named")
    sizes = {"train": 24, "val": 8, "test": 4}
    return {"named": copy_digits(digits_root, base / "named", NAMES, sizes),
            "numbered": copy_digits(digits_root, base / "numbered", [str(d) for d in range(10)], sizes),
            "predict": copy_digits(digits_root, base / "predict", NAMES, {"test": 3}) / "test"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, data) -> Path:
    folder = tmp_path_factory.mktemp("run")
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *LEARNS, "--data.root", str(data["named"]),
            "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(folder))
    return folder


@pytest.fixture
def run_copy(run, tmp_path) -> Path:
    """The run, for a test that writes into it (resumes, validations); its config names the copy as run directory."""
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    (copy / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(run), str(copy)))
    return copy


def best_of(run: Path) -> tuple[Path, float]:
    """The best checkpoint and its val/acc, as the fit's ModelCheckpoint recorded them."""
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["callbacks"]
    best = next(s for k, s in state.items() if k.startswith("ModelCheckpoint") and s.get("monitor") == "val/acc")
    return Path(best["best_model_path"]), float(best["best_model_score"])


def error_line(proc) -> str:
    """The one `imgcls: error:` line of a refused command (and no traceback)."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("imgcls: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- evaluation from a checkpoint --------------------------------------------------------------------------------


def test_validate_from_the_checkpoint_alone_reproduces_the_fits_val_acc(run, data, tmp_path):
    best, score = best_of(run)
    proc = run_cli("validate", "--ckpt_path", str(best), "--data.root", str(data["named"]), *EVAL,
                   "--trainer.default_root_dir", str(tmp_path))
    assert printed_metrics(proc.stdout)["val/acc"] == pytest.approx(score, abs=1e-6)
    assert score > 0.3  # trained: the defaults' 224 px imagenet preprocessing scored chance
    taken = [line for line in (proc.stdout + proc.stderr).splitlines() if "as the model was trained" in line]
    assert len(taken) == 1 and ("data.eval_transform=datamodules.presets.ClassificationPresetEval(preset=none, "
                                "image_size=32, resize_size=None)") in taken[0]


def test_predict_from_the_checkpoint_alone_writes_the_rows_of_the_runs_config(run, data, tmp_path):
    best, _ = best_of(run)
    alone, with_config = tmp_path / "alone", tmp_path / "with_config"
    run_cli("predict", "--ckpt_path", str(best), "--data.predict_dir", str(data["predict"]), *EVAL,
            "--trainer.default_root_dir", str(alone))
    run_cli("predict", "--config", str(run / "config.yaml"), "--ckpt_path", str(best), "--data.predict_dir",
            str(data["predict"]), "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
            str(with_config))
    rows, expected = read_rows(alone / "predictions.csv"), read_rows(with_config / "predictions.csv")
    assert len(rows) == 30
    for row, want in zip(rows, expected, strict=True):
        assert (row["path"], row["label"], row["class_name"]) == (want["path"], want["label"], want["class_name"])
        assert float(row["confidence"]) == pytest.approx(float(want["confidence"]), abs=1e-3)
    assert {r["class_name"] for r in rows} <= set(NAMES)  # the checkpoint's names, not data/digits' 0 ... 9
    right = sum(Path(r["path"]).parent.name == r["class_name"] for r in rows)
    assert right >= 10  # the digits are told apart (chance: 3 of 30)


def test_a_data_root_with_other_classes_is_refused_in_one_line(run, data, tmp_path):
    best, _ = best_of(run)
    for command in ("validate", "test"):
        proc = run_cli(command, "--ckpt_path", str(best), "--data.root", str(data["numbered"]), *EVAL,
                       "--trainer.default_root_dir", str(tmp_path), check=False)
        line = error_line(proc)
        assert f"data.root={data['numbered']}" in line and "only in the data: 0, 1" in line
        assert "only in the checkpoint: eight, five" in line
        assert f"{command} needs data with the model's classes" in line


def test_an_explicit_image_size_other_than_trainings_warns_and_is_obeyed(run, data, tmp_path):
    best, _ = best_of(run)
    proc = run_cli("validate", "--ckpt_path", str(best), "--data.root", str(data["named"]), "--data.image_size", "48",
                   *EVAL, "--trainer.default_root_dir", str(tmp_path))
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "data.image_size=48 is set" in line]
    assert len(warned) == 1 and "the model was trained with 32" in warned[0] and "validate uses 48" in warned[0]
    resolved = yaml.safe_load((tmp_path / "validate_config.yaml").read_text())["data"]["init_args"]
    # The short form decides the checkpoint's eval preset's side; its preset (none) is the checkpoint's.
    assert resolved["image_size"] == 48
    evaluated = resolved["eval_transform"]["init_args"]
    assert (evaluated["preset"], evaluated["image_size"], evaluated["resize_size"]) == ("none", 48, None)


def test_without_ckpt_path_the_runs_best_checkpoint_is_evaluated_or_the_command_refuses(run, data, tmp_path):
    """No --ckpt_path, or --ckpt_path best or last: the run directory's checkpoint of that name, found on the disk
    (Lightning looked only among this process's saves: `best` stopped with a traceback, and `last` without a
    last.ckpt evaluated an untrained network in silence); none there: one line, and nothing written."""
    best, score = best_of(run)
    quiet = ("--trainer.default_root_dir", str(run), "--trainer.logger", "false", "--trainer.enable_progress_bar",
             "false")
    proc = run_cli("validate", "--config", str(run / "config.yaml"), *quiet)
    assert f"no --ckpt_path, so the best checkpoint of {run}: {best}" in proc.stdout + proc.stderr
    assert printed_metrics(proc.stdout)["val/acc"] == pytest.approx(score, abs=1e-6)
    proc = run_cli("validate", "--config", str(run / "config.yaml"), "--ckpt_path", "best", *quiet)
    assert f"validate: --ckpt_path best of {run}: {best}" in proc.stdout + proc.stderr
    assert printed_metrics(proc.stdout)["val/acc"] == pytest.approx(score, abs=1e-6)
    for command, named in (("validate", None), ("predict", None), ("test", "last"), ("validate", "best")):
        proc = run_cli(command, "--data.root", str(data["named"]), "--data.predict_dir", str(data["predict"]), *EVAL,
                       "--trainer.default_root_dir", str(tmp_path / "fresh"),
                       *(("--ckpt_path", named) if named else ()), check=False)
        expected = f"--ckpt_path {named}: no checkpoint in" if named else "the network is untrained; pass --ckpt_path"
        assert expected in error_line(proc)
        assert not (tmp_path / "fresh").exists()


# ---- a fit continues only the same, unfinished run ---------------------------------------------------------------


@pytest.mark.parametrize("other", ["numbered", "moved"])
def test_auto_resume_onto_other_data_is_refused_and_the_run_is_untouched(run_copy, data, other, tmp_path):
    root = data["numbered"] if other == "numbered" else Path(shutil.copytree(data["named"], tmp_path / "moved"))
    before = {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")}
    config = (run_copy / "config.yaml").read_text()
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *LEARNS, "--data.root", str(root),
                   "--trainer.default_root_dir", str(run_copy), check=False)
    line = error_line(proc)
    assert line.startswith(f"imgcls: error: auto_resume: {run_copy} holds a run on ")
    assert "pass a new --trainer.default_root_dir" in line
    if other == "numbered":
        assert "other classes (eight, five" in line and f"data.root={root} (0, 1" in line
    else:
        assert f"data.root={data['named']}, not {root}" in line
    assert (run_copy / "config.yaml").read_text() == config
    assert {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")} == before  # nothing written, nothing trained


def test_a_finished_run_is_not_resumed_into_a_no_op_and_its_config_is_kept(run_copy):
    config = (run_copy / "config.yaml").read_text()
    proc = run_cli("fit", "--config", str(run_copy / "config.yaml"), check=False)  # auto_resume: true
    line = error_line(proc)
    assert "has finished its run (max_epochs=2 reached), so there is nothing to train" in line
    assert "--trainer.max_epochs" in line and f"imgcls validate --config {run_copy / 'config.yaml'}" in line
    # Raising max_epochs trains on; the run's record stays the config that trained it, the new one goes beside it.
    before = torch.load(run_copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    proc = run_cli("fit", "--config", str(run_copy / "config.yaml"), "--trainer.max_epochs", "3")
    out = proc.stdout + proc.stderr
    after = torch.load(run_copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert f"resuming from {run_copy / 'checkpoints'}" in out and after["epoch"] == 2  # trained on, not from scratch
    assert after["global_step"] == before // 2 * 3
    assert (f"lr schedule: {before} -> {after['global_step']} optimizer steps; the cosine follows the new length from "
            f"step {before}") in out
    assert after["lr_schedulers"][0]["_last_lr"] == [0.0] * 4  # the schedule's end, at the new end
    assert (run_copy / "config.yaml").read_text() == config
    assert yaml.safe_load((run_copy / "fit_config.yaml").read_text())["trainer"]["max_epochs"] == 3


def test_training_on_at_another_batch_size_ends_the_schedule_at_the_runs_last_step(run_copy):
    """Raising max_epochs with another batch size: the run's length is the steps taken plus the new epoch's, at the
    new size. Lightning's estimate (max_epochs x the steps of an epoch now) ended the cosine before the epoch began,
    which then trained at lr 0."""
    before = torch.load(run_copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    proc = run_cli("fit", "--config", str(run_copy / "config.yaml"), "--trainer.max_epochs", "3",
                   "--data.batch_size", "32")
    after = torch.load(run_copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert after["epoch"] == 2 and before < after["global_step"] < before * 3 // 2  # an epoch of fewer, larger steps
    assert (f"lr schedule: {before} -> {after['global_step']} optimizer steps; the cosine follows the new length from "
            f"step {before}") in proc.stdout + proc.stderr
    assert after["lr_plan"] == {"total_steps": after["global_step"]}
    assert after["lr_schedulers"][0]["_last_lr"] == [0.0] * 4  # reached at the run's last step, not before


@pytest.mark.parametrize(("override", "named"), [
    (["--model.optimizer.lr", "0.4"], "model.optimizer.init_args.lr=0.4 (the checkpoint's: 0.016)"),
    (["--model.lr_scheduler.warmup_epochs", "2"],
     "model.lr_scheduler.init_args.warmup_epochs=2.0 (the checkpoint's: 0.5)"),
    # an injected part's init_args too, named by its leaf
    (["--model.loss.label_smoothing", "0.3"], "model.loss.init_args.label_smoothing=0.3 (the checkpoint's: 0.1)"),
])
def test_a_model_value_changed_on_resume_is_refused_naming_both_values(run_copy, override, named):
    proc = run_cli("fit", "--config", str(run_copy / "config.yaml"), "--ckpt_path", "last", *override,
                   "--trainer.max_epochs", "3", check=False)
    line = error_line(proc)
    assert line.startswith("imgcls: error: --ckpt_path last: model.") and named in line
    assert "drop the override to resume" in line and "--model.net.weights" in line
    assert torch.load(run_copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 1


def test_validating_a_finished_run_writes_a_series_of_its_own(run_copy):
    curves = read_tensorboard(run_copy)
    events = sorted(run_copy.glob("events.out.tfevents.*"))
    run_cli("validate", "--config", str(run_copy / "config.yaml"), "--ckpt_path",
            str(run_copy / "checkpoints" / "last.ckpt"), "--trainer.enable_progress_bar", "false")
    assert sorted(run_copy.glob("events.out.tfevents.*")) == events and read_tensorboard(run_copy) == curves
    assert 0 not in dict(curves["val/acc"])  # the training curves start at the first epoch's validation
    validated = read_tensorboard(run_copy / "validate")
    assert list(validated["val/acc"]) and (run_copy / "validate_config.yaml").is_file()


# ---- a recipe on data it does not fit ------------------------------------------------------------------------------


def test_the_multilabel_recipe_on_class_folders_is_refused_before_training(data, tmp_path):
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config",
                   str(CONFIGS / "recipes" / "multilabel.yaml"), *LEARNS, "--data.root", str(data["named"]),
                   "--trainer.default_root_dir", str(tmp_path / "run"), check=False)
    line = error_line(proc)
    assert "monitors val/map, which this model never logs" in line
    assert "needs multi-label data (a labels.csv in each split folder)" in line and "has class folders" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
