"""Room for a run's checkpoints: a fit says at its start when its disk cannot hold them, and a write that fails (a
full disk, or any other OSError) stops it in one line (exit 74) that names the checkpoint to continue from:

    imgcls: error: No space left on device while writing checkpoint step0000006.ckpt: a checkpoint of this run needs
    ~N MiB and runs/x/checkpoints has F MiB free; free space there and run the same command, which continues from
    runs/x/checkpoints/last.ckpt (intact)
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from lightning.pytorch.utilities import rank_zero_info

from training.resume.checkpoints import newest_intact_checkpoint, tensor_bytes
from training.resume.faults import WriteError, checkpoint_dir, error_in

# What torch.save adds to the tensors' bytes (the pickled structure, zip headers and 64-byte alignment of each record),
# and the rest of a checkpoint (loops, callbacks, the loaders' positions, hyperparameters): an allowance, not a count.
OVERHEAD = 1.02, 256 * 1024
ADAM_SLOTS = 2.0  # the state an optimizer keeps per parameter byte when it cannot be probed: Adam's two moments
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class RunWriteError(OSError):
    """A fit stopped because a file of its run could not be written, or will not fit on its disk: one line (exit 74)."""

    def __str__(self) -> str:
        return str(self.strerror)


def checkpoint_bytes(trainer: Trainer) -> int:
    """About how many bytes one checkpoint of this fit takes: the module's state (weights, buffers, metric states), the
    optimizers' states (as they will be once every parameter has stepped), a weight average's second copy of the
    weights, and the gradients a checkpoint inside an accumulation window holds."""
    module = trainer.lightning_module
    weights = tensor_bytes(module.state_dict())
    params = [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
    total = weights + sum(optimizer_state_bytes(optimizer) for optimizer in trainer.optimizers)
    if any(isinstance(c, WeightAveraging) for c in trainer.callbacks):
        total += weights  # the average as state_dict, the trained weights as current_model_state
    if trainer.accumulate_grad_batches > 1:
        total += sum(p.numel() * p.element_size() for p in params)  # accumulated_grads (ExactResume)
    scale, extra = OVERHEAD
    return int(total * scale) + extra


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of `optimizer`'s state once every parameter has one: measured per parameter byte on the parameters
    that have stepped, else on a probe (the same optimizer class and settings, one step on a small tensor)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return 0
    stepped = [p for p in params if optimizer.state.get(p)]
    if stepped:
        per_byte = tensor_bytes([optimizer.state[p] for p in stepped]) / _bytes(stepped)
    else:
        per_byte = _probed_state_per_byte(optimizer, params[0])
    return int(per_byte * _bytes(params))


def _bytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _probed_state_per_byte(optimizer: torch.optim.Optimizer, like: torch.Tensor) -> float:
    """The state bytes per parameter byte that `optimizer`'s class keeps, from one step of a copy on a probe tensor
    (before a fit's first step no parameter has a state yet); Adam's where the class cannot be built so."""
    probe = torch.zeros(4096, dtype=like.dtype, device=like.device, requires_grad=True)
    settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    try:
        copy = type(optimizer)([{**settings, "params": [probe]}])
        probe.grad = torch.zeros_like(probe)
        copy.step()
    except Exception:  # noqa: BLE001 - a user's optimizer with required arguments or a closure: assume Adam's
        return ADAM_SLOTS
    return tensor_bytes(copy.state[probe]) / _bytes([probe])


def checkpoint_files(trainer: Trainer) -> dict[Path, int]:
    """The most checkpoint files this fit keeps in each folder: each ModelCheckpoint's best k (a `save_top_k` of -1
    counted as one a epoch) and its last.ckpt, and preempted.ckpt in the run's checkpoint folder."""
    files: dict[Path, int] = {}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            kept = callback.save_top_k if callback.save_top_k >= 0 else max(trainer.max_epochs or 1, 1)
            folder = Path(callback.dirpath)
            files[folder] = files.get(folder, 0) + kept + bool(callback.save_last)
    if files:
        files[checkpoint_dir(trainer)] = files.get(checkpoint_dir(trainer), 0) + 1  # Preemption's save
    return files


def existing(path: Path) -> Path:
    """`path`, or its nearest folder above it that exists (a run's folders are made at its first save)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(existing(folder)).free


def mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def space_problem(trainer: Trainer) -> tuple[str, bool] | None:
    """(the line, whether the fit cannot go on) when a disk of the fit's checkpoints cannot hold them, else None.

    Each file system is checked once, for every folder of the run on it: the files the callbacks keep there, plus
    one being written beside the one it replaces (an atomic save), less the bytes its checkpoints take already.
    """
    size, disks = checkpoint_bytes(trainer), {}
    for folder, kept in checkpoint_files(trainer).items():
        disk = os.stat(existing(folder)).st_dev
        folders, files = disks.get(disk, ([], 1))
        disks[disk] = ([*folders, folder], files + kept)
    for folders, files in disks.values():
        inodes = {(p.stat().st_ino): p.stat().st_size for f in folders if f.is_dir() for p in f.glob("*.ckpt")}
        need, free = max(files * size - sum(inodes.values()), size), free_bytes(folders[0])
        where = ", ".join(map(str, folders))
        if free < size:
            line = (f"{where} has {mib(free)} free, less than one checkpoint of this run (~{mib(size)}): its first "
                    "save would fail. Free space there, or start the run on another disk (--trainer.default_root_dir)")
            return line, True
        if free < need:
            return (f"disk space: {where} has {mib(free)} free, and this run's checkpoints may need {mib(need)} more "
                    f"there ({files} files of ~{mib(size)} at most, the one being written included); a save that does "
                    "not fit stops the run, naming the checkpoint to continue from"), False
    return None


class DiskSpace(Callback):
    """At the start of a fit, says in one line when a disk of its checkpoints cannot hold them, and stops the fit when
    it cannot hold even one (its first save would fail, after everything before it was trained): rank 0 decides."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        problem = space_problem(trainer) if trainer.is_global_zero else None
        problem = trainer.strategy.broadcast(problem)
        if problem is None:
            return
        line, fatal = problem
        if fatal:
            raise RunWriteError(errno.ENOSPC, line)
        rank_zero_info(line)


def write_failure(trainer: Trainer, err: BaseException) -> RunWriteError | None:
    """The one line a fit stops with when `err` comes from a file of the run that could not be written (a WriteError,
    or an OSError of a full disk anywhere in its chain): what, the folder, the bytes a checkpoint needs and the bytes
    free, and the intact checkpoint the same command continues from. None for any other error."""
    if isinstance(err, RunWriteError):
        return None
    cause = error_in(err)
    if not isinstance(cause, WriteError) and (cause is None or cause.errno not in SPACE_ERRNOS):
        return None
    if isinstance(cause, WriteError):
        what, folder = cause.what, cause.folder
    else:
        what = cause.filename or "a file of the run"
        folder = Path(cause.filename).parent if cause.filename else Path(trainer.default_root_dir)
    try:
        size = checkpoint_bytes(trainer)
    except Exception:  # noqa: BLE001 - the line goes out without the estimate rather than not at all
        size = getattr(cause, "needed", None)
    folders = [Path(trainer.default_root_dir) / "checkpoints",
               *(Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None))]
    found, _ = newest_intact_checkpoint(folders, report=False)
    then = f"continues from {found} (intact)" if found else "starts from scratch (no checkpoint was saved)"
    needs = f"a checkpoint of this run needs ~{mib(size)} and " if size else ""
    return RunWriteError(cause.errno, f"{cause.strerror} while writing {what}: {needs}{folder} has "
                                      f"{mib(free_bytes(folder))} free; free space there and run the same command, "
                                      f"which {then}")
