"""Preemption: SIGTERM / SIGUSR1 (and a first Ctrl-C) save a checkpoint at a step end, then exit."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from training.resume.faults import PREEMPT_SIGNALS, PREEMPTED, checkpoint_dir


class Preemption(Callback):
    """SIGTERM / SIGUSR1 (SLURM preemption, `scancel`, Kubernetes eviction): checkpoint at a step end, then exit.

    Lightning's own handler only raises at an epoch boundary on one device (and exits 0, without a checkpoint), and
    its SLURM handler saves from inside the signal handler, mid-step. Here the handler only sets a flag; the save
    happens at the end of a training step, where state is consistent, into the run's checkpoint folder as
    `preempted.ckpt` (the newest checkpoint, so `--ckpt_path last` and `auto_resume` pick it up). The process then
    exits with 128 + signal number, so a scheduler sees a failure and requeues.

    All ranks agree, so they save and exit together even when only one of them got the signal: each step starts an
    asynchronous all-reduce (MAX) of the flag on a CPU (gloo) process group, and the next step reads its result. The
    GPU never waits for it (no device tensor, no `.item()` on one), and the network round trip overlaps a whole step;
    the save comes one step later than the signal.

    Ctrl-C (SIGINT) is taken the same way, once: the fit stops at the end of the step with `preempted.ckpt` and exits
    130, where Lightning's KeyboardInterrupt would drop every step since the last checkpoint. The first Ctrl-C puts
    the previous handler back, so a second one interrupts at once (Lightning's shutdown, exit 1, no save).
    """

    def __init__(self) -> None:
        self._received: int = 0
        self._previous: dict[int, object] = {}
        self._group = None  # the CPU process group of the flag; None on one process
        self._flag: torch.Tensor | None = None
        self._work = None  # the all-reduce in flight

    def _handler(self, signum, frame) -> None:
        self._received = signum
        if signum == signal.SIGINT:
            signal.signal(signum, self._previous.pop(signum))  # the next Ctrl-C interrupts, as it did before fit
            rank_zero_info("\nCtrl-C: stopping at the end of this training step, with a checkpoint (Ctrl-C again "
                           "to stop at once, without one)")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Installed after Lightning's signal connector, which it replaces for the duration of fit.
        self._received = 0  # a signal of an earlier fit of this Trainer (a notebook's) stopped that one only
        for sig in (*PREEMPT_SIGNALS, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # started with SIGINT ignored (a script's `imgcls fit ... &`): it stays so
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank creates it here

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._work is not None:
            self._work.wait()  # every rank started it; none leaves it dangling
            self._work = None
        if self._group is not None:
            # Freed now with its worker threads, not at interpreter shutdown
            # (training.distributed.strategy.destroy_process_groups); the next fit makes a new one.
            if dist.is_initialized():  # else destroyed with all the others already
                dist.destroy_process_group(self._group)
            self._group = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        received = self._received
        if self._group is not None:
            received = 0
            if self._work is not None:
                self._work.wait()  # started a step ago: long done
                received = int(self._flag.item())  # a CPU tensor: no device synchronisation
            if not received:
                self._flag = torch.tensor([self._received], dtype=torch.int64)
                self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
                return
            self._work = None
        if not received:
            return
        path = checkpoint_dir(trainer) / PREEMPTED
        # The full state (unset, Lightning logs that it defaults to it); collective: every rank calls it, rank 0 writes.
        trainer.save_checkpoint(path, weights_only=False)
        name = signal.Signals(received).name
        rank_zero_info(f"{name} received: saved {path} at step {trainer.global_step}; exiting with code "
                       f"{128 + received}. Resume with the same command plus --ckpt_path last (or auto_resume).")
        raise SystemExit(128 + received)
