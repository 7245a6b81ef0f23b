"""The loggers a run is built with: Lightning's TensorBoard, CSV and W&B loggers, which keep one continuous curve
across resumes and kills; W&B's command line masked (built by training/cli/instantiators.py).

A fit that starts at optimizer step N (0, or the step of the checkpoint it resumes from) logs steps N and up; what an
earlier process logged at steps N and up was lost work that this fit does again (a kill after the checkpoint), so the
curve shows it once, from this fit (docs/FAULT_TOLERANCE.md, "Logs across a resume"):
- TensorBoard: the fit writes a session start at step N into its event file, and TensorBoard itself (and
  `imgcls report`) then hides every earlier event at step N and up; the files keep them.
- CSV: metrics.csv keeps its rows of steps below N (Lightning's CSVLogger deletes the file when a run starts again).
- W&B: a run's history cannot be rewound, so rows reach W&B only once a checkpoint covers their step: a kill loses
  the rows of the work it loses, and the resumed fit logs them once.

Every row Lightning logs during a fit carries the number of optimizer steps done before it (the train loss and the
learning rate of a batch, the validation that follows it), and a checkpoint at global step N covers every row below N.
`training.resume.CurvesAcrossResumes`, which every run carries, tells the loggers both, and when a checkpoint is about
to be written: TensorBoard and CSV write the rows it covers first. Their first write that fails (a full disk) stops
the fit in one line (training/resume/disk.py) before a later checkpoint can cover a row they lost.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import shutil
import sys

# TensorBoard's writer, which Lightning imports on first use and jsonargparse as soon as it reads the logger's
# **kwargs: imported here, with the start-up's other imports (frozen, imgcls/startup.py), instead of in the
# middle of every fit's parse (~0.15 s). Every shipped config logs to TensorBoard.
import torch.utils.tensorboard  # noqa: F401
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.compat.proto.event_pb2 import Event, SessionLog

from training.records.secrets import redact_secrets
from training.resume.faults import WriteError, error_in


class _KeptMetrics(ExperimentWriter):
    """CSVLogger's writer, which appends to an existing metrics.csv instead of deleting it, and writes it all or
    nothing: a write that fails (a full disk) leaves the file as it was."""

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):  # its columns, so that rows with fewer keys append under them
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))

    def save(self) -> None:
        path = self.metrics_file_path
        size = os.path.getsize(path) if os.path.isfile(path) else None
        # New columns make Lightning write the file again from its first line: a copy to go back to.
        copy = f"{path}.tmp{os.getpid()}" if size is not None and set().union(*self.metrics) - set(
            self.metrics_keys) else None
        copied = False
        try:
            if copy:
                shutil.copyfile(path, copy)  # a full disk fails here, before the file is touched
                copied = True
            super().save()
        except OSError:
            if copied:
                os.replace(copy, path)
            elif copy is None and size is None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            elif copy is None:
                os.truncate(path, size)  # the rows appended, or part of one, taken off
            raise
        finally:
            if copy:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(copy)

    def starts_at(self, step: int) -> None:
        """Keep the file's rows of steps below `step`, in order."""
        self.save()
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            header, rows = reader.fieldnames or [], [row for row in reader if int(row["step"]) < step]
        kept = f"{self.metrics_file_path}.tmp{os.getpid()}"
        try:
            with open(kept, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header)
                writer.writeheader()
                writer.writerows(rows)
            os.replace(kept, self.metrics_file_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(kept)


class _StopsAtAFailedWrite:
    """A logger whose first write that fails (an OSError, such as a full disk's; TensorBoardLogger re-raises its
    writer's as a ValueError) is raised once, as a WriteError that names its files and folder, so that the fit stops in
    one line (training/resume/disk.py). It writes nothing after that: the calls Lightning makes on the way out
    (`finalize`, the flush of the last checkpoint's rows) do not raise it again. A loss of rows never goes unsaid, and
    none is ever covered by a later checkpoint: every row a checkpoint covers is written before it (`checkpointing`)."""

    FILES = "logs"  # what a write failure names
    write_failed = False

    def write(self, method, *args, **kwargs):
        """`method(*args, **kwargs)`, one of this logger's writes."""
        if self.write_failed:
            return None
        try:
            return method(*args, **kwargs)
        except Exception as err:
            cause = error_in(err)
            if cause is None:
                raise
            self.write_failed = True
            raise WriteError(cause, self.FILES, self.log_dir) from err

    def log_metrics(self, metrics, step: int | None = None) -> None:
        self.write(super().log_metrics, metrics, step)

    def log_hyperparams(self, params=None, *args, **kwargs) -> None:
        self.write(super().log_hyperparams, params, *args, **kwargs)

    def save(self) -> None:
        self.write(super().save)

    def finalize(self, status: str) -> None:
        if status == "success":
            self.write(super().finalize, status)
            return
        with contextlib.suppress(WriteError):  # a fit that failed: its own error says why, and its teardown goes on
            self.write(super().finalize, status)


def logger_write(logger: Logger, method, *args, **kwargs):
    """`method(*args, **kwargs)` (e.g. `logger.experiment.add_image`) as one of `logger`'s writes: a failure stops the
    fit as its own writes do, where the logger is one of ours."""
    if isinstance(logger, _StopsAtAFailedWrite):
        return logger.write(method, *args, **kwargs)
    return method(*args, **kwargs)


class ResumableCSVLogger(_StopsAtAFailedWrite, CSVLogger):
    """Lightning's CSVLogger whose metrics.csv holds the whole run: a resumed fit appends to it."""

    FILES = "metrics.csv"

    @property
    def experiment(self) -> _KeptMetrics:
        if self._experiment is None and rank_zero_only.rank == 0:  # Lightning's property, with our writer
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeptMetrics(log_dir=self.log_dir)
        return super().experiment

    @rank_zero_only
    def starts_at(self, step: int) -> None:
        self.write(self.experiment.starts_at, step)

    @rank_zero_only
    def checkpointing(self, step: int) -> None:
        self.write(self.experiment.save)  # the rows a checkpoint covers reach the disk before it


class ResumableTensorBoardLogger(_StopsAtAFailedWrite, TensorBoardLogger):
    """Lightning's TensorBoardLogger, whose fits hide what an earlier process logged at their steps and later, and
    which leaves out the `epoch` that Lightning adds to every row: TensorBoard draws each curve against the step, and
    sorts its cards by name, so that a staircase of the epoch came before the curves (CSV and W&B keep it)."""

    FILES = "the TensorBoard event file"

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        super().log_metrics({key: value for key, value in metrics.items() if key != "epoch"}, step)

    @rank_zero_only
    def log_result(self, params: dict, value: float, step: int) -> None:
        """The run's result, HP_METRIC, with its settings for TensorBoard's HPARAMS tab, in a run of its own below
        this one (RESULT_RUN). Its only scalar is then the only metric there, shown by default, and TensorBoard,
        finding no experiment summary (Lightning's log_hyperparams writes one), builds the table from every run's
        settings and shows first those that differ between the runs: a sweep's parameters."""
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        _, start, end = hparams(params, {HP_METRIC: value})
        with SummaryWriter(os.path.join(self.log_dir, RESULT_RUN)) as writer:
            writer.file_writer.add_summary(start, step)
            writer.file_writer.add_summary(end, step)
            writer.add_scalar(HP_METRIC, value, step)

    @rank_zero_only
    def starts_at(self, step: int) -> None:
        # What SummaryWriter(purge_step=step) writes: the experiment exists already (the run's hparams are logged).
        self.write(self.experiment.file_writer.add_event, Event(step=step, session_log=SessionLog(
            status=SessionLog.START)))
        self.write(self.experiment.flush)

    @rank_zero_only
    def checkpointing(self, step: int) -> None:
        self.write(self.experiment.flush)  # the events a checkpoint covers reach the disk before it


# The run's result in TensorBoard's HPARAMS tab: the best value of the metric that ranks its checkpoints. Under val/
# with the curves, whose cards TensorBoard sorts by name and opens the first two groups of (train/ and val/).
HP_METRIC = "val/hp_metric"
RESULT_RUN = "hparams"  # the folder of the run's result, in its TensorBoard folder
# Of the trainer's settings, those that change what a run learns: HPARAMS columns beside the model's and the data's.
LEARNING_KEYS = ("seed_everything", "trainer.max_epochs", "trainer.max_steps", "trainer.precision",
                 "trainer.accumulate_grad_batches", "trainer.gradient_clip_val", "trainer.devices", "trainer.num_nodes")


def hyperparameters(config: dict) -> dict[str, int | float | str | bool]:
    """A resolved config (config.yaml as a dict) -> the columns that runs and sweep trials are compared by in
    TensorBoard's HPARAMS tab, under their command-line names: every value of `model` and `data` (a part given by
    class_path under its own key, its arguments below it: `model.optimizer`, `model.optimizer.lr`) and LEARNING_KEYS.
    Null values are left out (TensorBoard takes none); a list is shown as text."""
    flat: dict[str, int | float | str | bool] = {}

    def walk(key: str, value) -> None:
        if isinstance(value, dict):
            if "class_path" in value:
                walk(key, value["class_path"])
                value = value.get("init_args") or {}
            for name, item in value.items():
                walk(f"{key}.{name}", item)
        elif value is not None:
            flat[key] = value if isinstance(value, int | float | str | bool) else str(value)

    for section in ("model", "data"):
        walk(section, config.get(section) or {})
    for key in LEARNING_KEYS:
        *parents, name = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent) or {}
        walk(key, node.get(name))
    return flat


# Seconds between W&B's writes of a run's file (`.wandb`, what `wandb sync` uploads): the rows a checkpoint covers are
# on disk this long after it.
WANDB_FLUSH_S = 1.0


class SecretSafeWandbLogger(WandbLogger):
    """WandbLogger whose run records the command line with secrets masked, and whose history only ever receives rows
    that a checkpoint covers (`covered_below`), once each.

    wandb stores sys.argv in the run's metadata (and `wandb sync` uploads it), out of reach of the masking of
    config.yaml and of the logged config; a password typed as a command-line value would land there. sys.argv is
    masked only while the logger's run is reached (started on the first access): Lightning's launcher still needs the
    real one to start the other ranks.
    """

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("settings") is None:  # W&B writes its run file every 15 s: a kill lost what came after
            import wandb

            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_S)
        super().__init__(*args, **kwargs)
        self._held: list[tuple[dict, int]] = []
        self._covered = math.inf  # until a fit says otherwise (a run without checkpoints never holds a row)

    @property
    def experiment(self):
        saved = sys.argv[:]
        sys.argv[1:] = [redact_secrets(arg) for arg in saved[1:]]
        try:
            return super().experiment
        finally:
            sys.argv[:] = saved

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        if step is not None and step >= self._covered:
            self._held.append((dict(metrics), step))
        else:
            super().log_metrics(metrics, step)

    def starts_at(self, step: int) -> None:
        self._covered = step

    def covered_below(self, step: float) -> None:
        """Send the held rows of steps below `step`, in the order they were logged."""
        self._covered = max(self._covered, step)
        ready = [(metrics, s) for metrics, s in self._held if s < self._covered]
        self._held = [(metrics, s) for metrics, s in self._held if s >= self._covered]
        for metrics, s in ready:
            super().log_metrics(metrics, s)


def wandb_online() -> bool:
    """Whether WandbLogger goes online although its config says offline: with WANDB_API_KEY set, or under `wandb
    agent` (WANDB_SWEEP_ID), whose login sits in ~/.netrc rather than in the environment. WANDB_MODE, when set, wins."""
    return "WANDB_MODE" not in os.environ and bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_SWEEP_ID"))


# Lightning's loggers -> ours, the same arguments: a config names Lightning's, and gets curves that survive a resume.
RESUMABLE: dict[type[Logger], type[Logger]] = {CSVLogger: ResumableCSVLogger, TensorBoardLogger:
                                               ResumableTensorBoardLogger, WandbLogger: SecretSafeWandbLogger}

