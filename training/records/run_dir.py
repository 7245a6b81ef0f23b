"""The run directory: where a run's config, checkpoints and logs go, the config saved into it, and the summary
printed at the end of a fit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run directory: the W&B run that a resumed fit continues


def run_dir(config) -> Path:
    """The run directory of a subcommand's config: trainer.default_root_dir, with one sub-folder per W&B run under
    `wandb agent`, which runs the sweep file's single command line for every trial (and sets these variables)."""
    folder = Path(config.trainer.default_root_dir or "runs/default")
    agent_run = os.environ.get("WANDB_RUN_ID") if os.environ.get("WANDB_SWEEP_ID") else None
    return folder / agent_run if agent_run and folder.name != agent_run else folder


def checkpoint_callbacks(config) -> list:
    """The ModelCheckpoint entries of a subcommand's config (not yet instantiated)."""
    return [c for c in config.trainer.callbacks or [] if c.class_path.endswith("ModelCheckpoint")]


def checkpoint_folders(config) -> list[Path]:
    """The folders the configured ModelCheckpoints name (those with no dirpath write to <run dir>/checkpoints)."""
    return [Path(c.init_args.dirpath) for c in checkpoint_callbacks(config) if c.init_args.dirpath]


def place_in_run_dir(config, subcommand: str) -> Path:
    """Point what a subcommand's config leaves unset into its run directory, and return it: trainer.default_root_dir,
    the loggers' empty save_dir, the ModelCheckpoints' dirpath (`<run>/checkpoints`)."""
    folder = run_dir(config)
    if folder.exists() and not folder.is_dir():  # Lightning's makedirs would raise FileExistsError, a traceback
        raise NotADirectoryError(f"trainer.default_root_dir={folder} is a file; the run directory is a folder (a new "
                                 "path is made one)")
    config.trainer.default_root_dir = str(folder)
    for logger in config_loggers(config):
        init = getattr(logger, "init_args", None)
        if init is not None and "save_dir" in init and init.save_dir in ("", None):
            init.save_dir = str(folder)
        if init is not None and subcommand != "fit" and init.get("version") == "":
            # validate/test/predict of a run log into a series of their own (<run>/validate/...), never into the
            # training curves at step 0.
            init.version = subcommand
    for callback in checkpoint_callbacks(config):
        if callback.init_args.dirpath is None:
            callback.init_args.dirpath = str(folder / "checkpoints")
    return folder


def config_loggers(config) -> list:
    """The logger entries of a subcommand's config (not yet instantiated; `True` or `False` as given)."""
    loggers = config.trainer.logger
    return loggers if isinstance(loggers, list) else [loggers]


def git_state() -> dict[str, str | bool]:
    """The commit of the code that runs, and whether tracked files differ from it ("unknown" outside a checkout)."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": False}


def hardware_summary(trainer: Trainer) -> str:
    """The devices a run trains on, in words (quoted by the model card of `imgcls publish`)."""
    from core.hardware import detect

    hw = detect()
    on_cuda = trainer.strategy.root_device.type == "cuda" and hw.cuda
    device = hw.cuda if on_cuda else f"{hw.cpu_model} ({hw.cores} cores)"
    return f"{trainer.num_nodes * trainer.num_devices} x {device}, precision {trainer.precision}"


def data_summary(datamodule) -> dict[str, dict[str, int]]:
    """Images per class for each split the DataModule has set up: {"train": {"cat": 120, ...}, "val": {...}} (for
    multi-label data, the images that carry each label)."""
    summary = {}
    names = getattr(datamodule, "class_names", None) or []
    for split in ("train", "val", "test"):
        targets = getattr(getattr(datamodule, f"{split}_set", None), "targets", None)
        if targets is None or not len(targets):
            continue
        targets = np.asarray(targets)
        counts = targets.sum(axis=0) if targets.ndim == 2 else np.bincount(targets)
        summary[split] = {names[c] if c < len(names) else str(c): int(n) for c, n in enumerate(counts) if n}
    return summary


def closing_summary(trainer, best: str, score, monitor: str | None, lasts: list[str]) -> str:
    """Where a finished fit left everything: run directory, checkpoints (only files that exist), config, loggers."""
    folder_of_run = Path(trainer.default_root_dir)
    lines = [f"run directory   {relative_to_cwd(folder_of_run)}"]
    # Only files that exist: a user's ModelCheckpoint may monitor nothing, keep no last.ckpt, or save elsewhere.
    if best and Path(best).exists():  # a file, or a sharded checkpoint's folder
        scored = f" ({monitor} {format_score(score)})" if monitor else ""
        lines.append(f"best checkpoint {relative_to_cwd(best)}{scored}")
    if lasts:
        lines.append(f"last checkpoint {relative_to_cwd(lasts[0])}  (resume: add --ckpt_path last)")
    # Each folder once: the shipped ModelCheckpoint and StepCheckpoint share one, named relative and absolute.
    folders = (c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint))
    for folder in {Path(f).resolve() if f else f: f for f in folders}.values():
        saved = sorted(Path(folder).glob("*.ckpt")) if folder and Path(folder).is_dir() else []
        lines.append(f"checkpoints     {relative_to_cwd(folder)}: {len(saved)} file(s)" if saved else
                     f"checkpoints     none saved in {relative_to_cwd(folder)}")
    lines.append(f"resolved config {relative_to_cwd(folder_of_run / 'config.yaml')}")
    for logger in trainer.loggers:
        name = next(c.__name__ for c in type(logger).__mro__ if c.__module__.startswith("lightning."))
        lines.append(f"{name:<15} {relative_to_cwd(logger.log_dir or logger.save_dir)}")
    lines.append(f"dashboard       make dashboard   (or: tensorboard --logdir {relative_to_cwd(folder_of_run.parent)})")
    return "\n".join(lines)


def metrics_table(metrics: dict, what: str) -> str:
    """The validation metrics of `metrics` (keys `val/...`) as a text table headed by `what` they are of."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(metrics.items()):
        if key.startswith("val/") and getattr(value, "numel", lambda: 1)() == 1:
            table.add_row(key, f"{float(value):.4f}")
    console = Console(width=100, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(table)
    return f"val metrics of {what}:\n" + captured.get().rstrip()


def relative_to_cwd(path: str | os.PathLike) -> str:
    """`path` relative to the working directory when it lies below it (short lines to copy), else as it is."""
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def format_score(score) -> str:
    return f"{float(score):.4f}" if score is not None else "-"
