"""A full disk, on a real one: a small tmpfs (root; under CI=true a disk that cannot be mounted fails the test). A fit
says at its start when its disk cannot hold its checkpoints, a save that does not fit stops it in one line (exit 74)
that names the checkpoint to continue from, and the same command resumes exactly once space is freed; a logger that
finds the disk full stops it the same way, and a figure that does not fit is skipped."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from PIL import Image

from tests.fault_injection import fill
from tests.helpers import fit_run, last_weights, make_image_folder, max_diff, resume_config, service_unavailable
from training.records.plots import publish
from training.resume.checkpoints import AtomicCheckpointIO, CheckpointWriteError, checkpoint_problem
from training.resume.curves import CurvesAcrossResumes
from training.resume.disk import optimizer_state_bytes
from training.resume.faults import WriteError

MIB = 2**20
WRITE_FAILED = 74  # training/cli/errors.py's EXIT_CODES


@pytest.fixture
def disk(tmp_path) -> Path:
    """A 64 MiB tmpfs, unmounted after the test."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0:
        service_unavailable(f"mounting a tmpfs needs root (uid {os.geteuid()})")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        service_unavailable(f"mount -t tmpfs failed: {(mounted.stderr or mounted.stdout).strip()}")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], capture_output=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"), {"a": 16, "b": 16}, size=32)


def _config(folder: Path, data: Path, loggers: bool = False) -> Path:
    """The quickstart shrunk as the kill tests shrink it: 2 epochs of 4 steps, a step checkpoint every 2 steps, the
    shipped best-k (2) and last.ckpt; `loggers`: TensorBoard and CSV, every step."""
    cfg = resume_config()
    cfg["data"].update(root=str(data), batch_size=8, num_workers=0, image_size=32)
    if loggers:
        cfg["trainer"]["logger"].append({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                         "init_args": {"save_dir": "", "name": "", "version": ""}})
    path = folder / f"config{'_loggers' if loggers else ''}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The run's one error line (and no traceback)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("imgcls: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def _leftovers(run: Path) -> list[Path]:
    """Temporary files of interrupted writes anywhere in the run folder."""
    return [p for p in run.rglob("*") if ".tmp" in p.name]


def _checkpoint_bytes(run: Path) -> int:
    return (run / "checkpoints" / "last.ckpt").stat().st_size


def test_a_checkpoint_that_does_not_fit_fails_in_one_error_and_keeps_the_one_before(disk):
    """torch's zip writer reports ENOSPC as `RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`:
    the writer finds the OSError under it, removes its temporary file, and the previous checkpoint stays whole."""
    io, path = AtomicCheckpointIO(), disk / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(MIB // 4)}}, path)  # 1 MiB
    fill(disk / "filler", leave=MIB // 2)
    with pytest.raises(CheckpointWriteError, match=f"cannot write checkpoint last.ckpt in {disk}: No space") as err:
        io.save_checkpoint({"state_dict": {"w": torch.full((MIB // 4,), 2.0)}}, path)
    cause = err.value.__cause__  # torch 2.14: the RuntimeError of its zip writer, raised while the OSError was handled
    assert isinstance(cause, OSError) or "inline_container" in str(cause), repr(cause)
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "last.ckpt"]
    assert checkpoint_problem(path) is None and io.load_checkpoint(path)["state_dict"]["w"][0] == 1.0


def test_a_figure_that_does_not_fit_keeps_the_last_one_whole(disk):
    """publish writes the PNG beside the last one and renames it over it: a full disk raises (ValidationFigures then
    skips the epoch's figures in one line, seen in the logger test below) and leaves the last PNG and no temporary."""
    trainer = type("T", (), {"global_step": 3, "loggers": [], "default_root_dir": str(disk)})()
    first = np.zeros((64, 64, 3), np.uint8)
    publish(trainer, "val/confusion_matrix", first)
    fill(disk / "filler")
    with pytest.raises(OSError, match="No space left on device"):
        publish(trainer, "val/confusion_matrix", np.random.default_rng(0).integers(0, 255, (512, 512, 3), np.uint8))
    assert np.array_equal(np.asarray(Image.open(disk / "figures" / "confusion_matrix.png")), first)
    assert not _leftovers(disk)


@pytest.mark.parametrize(("optimizer", "per_parameter_byte"), [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0), (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.AdamW(p, lr=0.1), 2)])
def test_an_optimizers_state_is_counted_before_its_first_step(optimizer, per_parameter_byte):
    """Before a fit's first step no parameter has a state: it is measured on a probe of the same class and settings,
    and matches the state after a step."""
    net = torch.nn.Linear(256, 64)
    opt = optimizer(net.parameters())
    before = optimizer_state_bytes(opt)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    net(torch.ones(2, 256)).sum().backward()
    opt.step()
    assert before == pytest.approx(per_parameter_byte * params, rel=0.01)
    assert optimizer_state_bytes(opt) == pytest.approx(before, rel=0.01)


class _RowsNeverFit(Logger):
    """A logger on a full disk: the rows a checkpoint covers cannot be written."""

    name, version = "full", 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def checkpointing(self, step: int) -> None:
        raise WriteError(OSError(errno.ENOSPC, "No space left on device"), "metrics.csv", "/full")


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_logger_that_cannot_write_the_rows_a_checkpoint_covers_stops_the_fit_before_the_checkpoint(tmp_path):
    """CurvesAcrossResumes has the loggers write the rows a checkpoint covers before the checkpoint is written: a
    logger that fails then stops the save before it begins, so no checkpoint ever covers a row the logger lost."""
    writes = []

    class Recorded(AtomicCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            writes.append(path)
            super().save_checkpoint(checkpoint, path, storage_options)

    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=_RowsNeverFit(), plugins=[Recorded()],
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1), CurvesAcrossResumes()],
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    with pytest.raises(WriteError, match="cannot write metrics.csv in /full: No space left on device"):
        trainer.fit(_Linear(), loader)
    assert writes == [] and not list(tmp_path.iterdir())


def test_a_fit_on_a_small_disk_says_so_stops_in_one_line_and_resumes_exactly_once_space_is_freed(tmp_path, data,
                                                                                                   disk):
    """The same command three times on one disk: too small for one checkpoint (refused at the start), room for two
    and a half (a warning at the start, then the third checkpoint at once does not fit: step 6's beside step 2's and
    the best one of step 4), and, the filler deleted, the run resumes and ends with the weights of a run on a disk
    with room (bitwise)."""
    config = _config(tmp_path, data)
    reference = tmp_path / "reference"
    fit_run(config, reference)
    size = _checkpoint_bytes(reference)
    logs = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file() and p.parent.name != "checkpoints")
    run, filler = disk / "run", disk / "filler"

    fill(filler, leave=size // 2)
    refused = fit_run(config, run, check=False)
    assert refused.returncode == WRITE_FAILED, refused.stderr[-4000:]
    line = _error_line(refused)
    assert f"{run / 'checkpoints'} has " in line and "less than one checkpoint of this run" in line
    assert not list(run.rglob("*.ckpt"))

    filler.unlink()
    fill(filler, leave=int(2.5 * size) + logs)
    stopped = fit_run(config, run, check=False)
    warning = re.search(r"disk space: (\S+) has ([\d.]+) MiB free, and this run's checkpoints may need ([\d.]+) MiB "
                        r"more there \((\d+) files of ~([\d.]+) MiB", stopped.stdout + stopped.stderr)
    assert warning, (stopped.stdout + stopped.stderr)[-4000:]
    # best 2, last.ckpt, the step checkpoint, preempted.ckpt, the one being written
    assert warning[1] == str(run / "checkpoints") and int(warning[4]) == 6
    assert size <= float(warning[5]) * MIB <= 1.1 * size + 0.05 * MIB  # the estimate, before any save
    assert stopped.returncode == WRITE_FAILED, stopped.stderr[-4000:]
    line = _error_line(stopped)
    found = re.fullmatch(r"imgcls: error: No space left on device while writing checkpoint step0000006\.ckpt: a "
                         r"checkpoint of this run needs ~([\d.]+) MiB and (\S+) has ([\d.]+) MiB free; free space "
                         r"there and run the same command, which continues from (\S+) \(intact\)", line)
    assert found, line
    assert found[2] == str(run / "checkpoints") and float(found[3]) * MIB < size
    resume_from = Path(found[4])
    assert resume_from == run / "checkpoints" / "last.ckpt" and checkpoint_problem(resume_from) is None
    assert torch.load(resume_from, weights_only=True)["global_step"] == 4
    assert all(checkpoint_problem(p) is None for p in (run / "checkpoints").glob("*.ckpt"))
    assert not _leftovers(run)

    filler.unlink()
    resumed = fit_run(config, run)
    assert f"resuming from {resume_from} (auto_resume)" in resumed.stdout + resumed.stderr
    assert "disk space:" not in resumed.stdout + resumed.stderr
    assert max_diff(last_weights(reference), last_weights(run)) == 0.0


def test_a_logger_that_finds_the_disk_full_stops_the_fit_in_the_same_line_and_the_curves_stay_whole(tmp_path, data,
                                                                                                      disk):
    """The disk fills as the validation after step 4 starts, once the step's rows are logged: what is left is the
    slack in the last page of each open file, too little for a new file or an image. The validation skips its figures
    in one line; a logger's next write fails (TensorBoard's of the figures' images, or the rows of the checkpoint that
    follows, written before it), and the fit stops in the checkpoint's line, naming step 2's; step 4's checkpoint is
    never begun. Freed, the same command resumes from it: the weights and every logged value per step equal a run's
    on a disk with room, each step once."""
    config = _config(tmp_path, data, loggers=True)
    reference = tmp_path / "reference"
    fit_run(config, reference)
    run, filler = disk / "run", disk / "filler"
    fill_args = ["--trainer.callbacks+=tests.fault_injection.FillDisk", "--trainer.callbacks.step", "4",
                 "--trainer.callbacks.path", str(filler), "--trainer.callbacks.at_validation", "true"]

    stopped = fit_run(config, run, *fill_args, check=False)
    assert stopped.returncode == WRITE_FAILED, stopped.stderr[-4000:]
    output = stopped.stdout + stopped.stderr
    assert f"figures: epoch 0's not saved in {run / 'figures'} (No space left on device); the fit goes on" in output
    line = _error_line(stopped)
    found = re.fullmatch(r"imgcls: error: No space left on device while writing (metrics\.csv|the TensorBoard event "
                         rf"file): a checkpoint of this run needs ~[\d.]+ MiB and {run} has 0\.0 MiB free; free space "
                         r"there and run the same command, which continues from (\S+) \(intact\)", line)
    assert found, line
    assert Path(found[2]) == run / "checkpoints" / "step0000002.ckpt"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step0000002.ckpt"]  # step 4's never begun
    assert not _leftovers(run)

    filler.unlink()
    resumed = fit_run(config, run)
    assert f"resuming from {found[2]} (auto_resume)" in resumed.stdout + resumed.stderr
    assert max_diff(last_weights(reference), last_weights(run)) == 0.0
    assert _csv_rows(run) == _csv_rows(reference)
    assert _tensorboard_scalars(run) == _tensorboard_scalars(reference)


def _csv_rows(run: Path) -> list[tuple]:
    """metrics.csv's rows as (step, key, value), in order."""
    import csv

    with open(run / "metrics.csv", newline="") as f:
        return [(row["step"], k, v) for row in csv.DictReader(f) for k, v in sorted(row.items()) if v and k != "step"]


def _tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every curve as TensorBoard shows the folder (a resumed fit's events hide the earlier ones at its steps and up),
    but `hp_metric`: the placeholder each fit logs at step 0 with its hyperparameters, no step of the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag != "hp_metric"}
