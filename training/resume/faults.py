"""What the fault guards share (their callbacks are beside, in training/resume/): the preemption checkpoint's name, a
sampler's epoch, the run's checkpoints, the one-line message for a lost peer, and the error of a file that could not
be written."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED = "preempted.ckpt"  # Preemption's checkpoint, in the run's checkpoint folder


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


def set_sampler_epoch(loader, epoch: int) -> None:
    """`set_epoch` on a loader's sampler (and its batch sampler's), where it has one: a DistributedSampler's order is
    a function of the epoch."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in {id(s): s for s in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
                    if s is not None}.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def checkpoint_dir(trainer: Trainer) -> Path:
    """The folder of the run's checkpoints: the first ModelCheckpoint's dirpath, else <run>/checkpoints."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def last_good_checkpoint(trainer: Trainer) -> str | None:
    """The newest file any ModelCheckpoint has written in this run (or restored from)."""
    paths = [p for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
             for p in (cb.last_model_path, cb.best_model_path, *cb.best_k_models) if p and Path(p).exists()]
    return max(paths, key=lambda p: Path(p).stat().st_mtime_ns) if paths else None


def lost_peer_message(err: BaseException) -> str | None:
    """One line for an error raised inside a torch.distributed collective (a peer died or hung, or the network
    failed), or None for any other error. This rank's traceback only shows where it was waiting; the cause is in the
    output of the rank that failed."""
    if not isinstance(err, RuntimeError):  # DistError and gloo's errors; a ValueError is a bad setting instead
        return None
    tb, inside = err.__traceback__, isinstance(err, dist.DistError)
    while tb is not None and not inside:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        inside = "/torch/distributed/" in name or name.endswith("/torch/nn/parallel/distributed.py")
        tb = tb.tb_next
    if not inside:
        return None
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (f"rank {rank_zero_only.rank} lost contact with the other processes during a collective ({detail}): a "
            "peer crashed, was killed, or hung longer than trainer.strategy.timeout_s. Its own output names the "
            "cause; rerun the same command to resume from the last checkpoint (auto_resume)")


class WriteError(OSError):
    """A file of the run (a checkpoint, a logger's files) could not be written: `what` it was and the `folder`, for
    the one line the fit stops with (training/resume/disk.py). Its errno and strerror are the OSError's."""

    def __init__(self, cause: OSError, what: str, folder: str | os.PathLike, needed: int | None = None) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.what, self.folder, self.needed = what, Path(folder), needed

    def __str__(self) -> str:
        return f"cannot write {self.what} in {self.folder}: {self.strerror}"


def error_in(err: BaseException | None, kind: type[BaseException] = OSError) -> BaseException | None:
    """The first error of type `kind` in `err`'s chain: itself, then what it was raised from or while handling. torch's
    zip writer reports a full disk as `RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`, raised
    while the OSError was handled, and TensorBoardLogger re-raises any error of its writer as a ValueError."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
