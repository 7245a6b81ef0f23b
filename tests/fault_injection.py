"""Test-only fault injection: callbacks that SIGKILL their process, break a file, overflow a step, lose a state, fill
the disk, or pause a fit (and one that records which rank holds the run folder)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import time
from pathlib import Path

from lightning.pytorch import Callback


class KillAt(Callback):
    """SIGKILL this process (no cleanup, like an OOM kill or a lost node), or send it `sig`, after training step `step`.

    `where` is `train` (at the end of that training step, after any checkpoint of that step was written),
    `train_start` (at the start of the next step, before its forward) or `val` (after the first validation batch that
    follows that step). `rank` limits the kill to one process. `stamp`, a file path, receives `time.time()` just before
    the signal, so that a test can time what the other processes do after it; with `train_start` and `rank`, each
    other rank writes `<stamp>.rank<N>` as it starts that next step, before the collectives that the lost rank never
    joins (DDP's buffer broadcast in the forward, the gradient all-reduce in the backward). `wait` seconds pass
    before the signal, for what the process's other threads write meanwhile (W&B's run file, each second). `group`
    sends it to the process group instead, the loader workers included, as a terminal's Ctrl-C does.
    """

    def __init__(self, step: int, where: str = "train", rank: int | None = None, sig: int = 9,
                 stamp: str | None = None, wait: float = 0.0, group: bool = False) -> None:
        self.step, self.where, self.rank, self.sig, self.stamp, self.wait = step, where, rank, sig, stamp, wait
        self.group, self.sent = group, False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.sig == signal.SIGINT:  # a terminal's foreground job takes Ctrl-C (a pytest-xdist worker ignores it,
            signal.signal(signal.SIGINT, signal.default_int_handler)  # and what it starts inherits that)

    def _maybe_kill(self, trainer) -> None:
        # Once: a signal the process survives (SIGTERM, Ctrl-C) is not sent again at the step's next validation batch.
        if trainer.global_step == self.step and (self.rank is None or trainer.global_rank == self.rank) \
                and not self.sent:
            self.sent = True
            time.sleep(self.wait)  # what the process's other threads do meanwhile (a logger's writes)
            if self.stamp:
                Path(self.stamp).write_text(repr(time.time()))
            if self.group:
                os.killpg(0, self.sig)
            else:
                os.kill(os.getpid(), self.sig)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.where == "train":
            self._maybe_kill(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "train_start":
            survivor = self.rank is not None and trainer.global_rank != self.rank
            if survivor and self.stamp and trainer.global_step == self.step:
                Path(f"{self.stamp}.rank{trainer.global_rank}").write_text(repr(time.time()))
            self._maybe_kill(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "val" and not trainer.sanity_checking:
            self._maybe_kill(trainer)


class SleepAt(Callback):
    """Sleep `seconds` at the end of training step `step`, after any checkpoint of that step was written: a window in
    which a test kills what runs this process (a sweep worker) while the fit is surely unfinished. A signal that
    comes meanwhile is handled as it arrives; the sleep goes on."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


class BreakFile(Callback):
    """Overwrite `path` with bytes that are no image in the callbacks' `setup`: after the DataModule's setup (the scan),
    before the train loader exists (its workers prefetch as soon as it is iterated, before `on_fit_start`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_bytes(b"this file broke after the scan")


class OverflowAt(Callback):
    """Make training step `step`'s fp16 gradients overflow, as a loss spike would: its loss, already scaled by
    16-mixed's GradScaler when `on_before_backward` sees it, is multiplied by `factor` in place before the backward,
    so the fp16 gradients reach inf, the scaler skips the step and halves its scale. The loss that is logged and
    checked for NaN is the unscaled one, untouched. Only for 16-mixed: without a scaler the step would be taken."""

    def __init__(self, step: int, factor: float = 2.0**24) -> None:
        self.step, self.factor = step, factor

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            loss.mul_(self.factor)


class ForgetScaler(Callback):
    """Drop the precision plugin's state (16-mixed's GradScaler) from the checkpoint a run resumes from, before
    Lightning restores it from there: the resume starts with a fresh scaler, as one that forgot to save it would."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint.pop(type(trainer.precision_plugin).__qualname__)


class FillDisk(Callback):
    """Fill the disk of `path` after training step `step` (after any checkpoint of that step was written), or, with
    `at_validation`, as the validation after that step starts (after the step's logged rows): `path` grows until the
    file system has no byte left, as other jobs on a shared disk would leave it."""

    def __init__(self, step: int, path: str, at_validation: bool = False) -> None:
        self.step, self.path, self.at_validation = step, path, at_validation

    def _fill(self, trainer) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero and not os.path.exists(self.path):
            fill(Path(self.path))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.at_validation:
            self._fill(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.at_validation and not trainer.sanity_checking:
            self._fill(trainer)


def fill(path: Path, leave: int = 0) -> None:
    """Write `path` until its file system has less than `leave` + 4 KiB free (tmpfs counts in pages)."""
    with open(path, "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 16, 1 << 12):
            with contextlib.suppress(OSError):  # full: the next, smaller chunk fills what is left
                while shutil.disk_usage(path.parent).free - chunk >= leave:
                    f.write(b"\0" * chunk)


class PauseAt(Callback):
    """After training step `step`, write `stamp` (this process's pid) and wait (up to `timeout` s) until the file
    `until` exists: a fit that holds its run folder, still, while a test tries a second one. The checkpoints of step
    `step` come after it (Lightning runs checkpoint callbacks last)."""

    def __init__(self, step: int, stamp: str, until: str, timeout: float = 300.0) -> None:
        self.step, self.stamp, self.until, self.timeout = step, stamp, until, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            Path(self.stamp).write_text(str(os.getpid()))
            deadline = time.monotonic() + self.timeout
            while not os.path.exists(self.until) and time.monotonic() < deadline:
                time.sleep(0.1)


class HoldProbe(Callback):
    """At the start of training, each rank writes `<out>/hold.rank<R>.json`: its pid, and, on a rank other than 0,
    the run folder's lease and whether its lock is held by another process (rank 0 must not open the lock file: a
    POSIX lock is released when its process closes any descriptor of the file)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        from training.resume.hold import LOCK_FILE

        record = {"rank": trainer.global_rank, "pid": os.getpid()}
        if trainer.global_rank != 0:
            fd = os.open(Path(trainer.default_root_dir) / LOCK_FILE, os.O_RDWR)
            try:
                record["lease"] = json.loads(os.pread(fd, 4096, 0).decode())
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    record["locked_by_another"] = False
                except OSError:
                    record["locked_by_another"] = True
            finally:
                os.close(fd)
        Path(self.out).mkdir(parents=True, exist_ok=True)
        (Path(self.out) / f"hold.rank{trainer.global_rank}.json").write_text(json.dumps(record))
