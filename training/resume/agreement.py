"""A fit's start on every rank, before anything is read or written: rank 0 holds the run folder (one writer per run,
training/resume/hold.py), the ranks load rank 0's checkpoint, then rank 0 tidies the folders; and the one line a fit
stops with when a file of its run cannot be written (training/resume/disk.py)."""

from __future__ import annotations

import contextlib

import lightning as L
from jsonargparse.typing import PositiveFloat
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from training.resume.checkpoints import ResumePlan, agree_on_resume, tidy_checkpoint_folders
from training.resume.disk import write_failure
from training.resume.hold import LEASE_TIMEOUT_S, RunFolderHeld, RunHold


class AgreedResume(L.Trainer):
    """`lightning.Trainer` whose fit holds its run folder on rank 0 (`RunHold`: a second fit into it refuses) and
    resumes every rank from rank 0's checkpoint (`agree_on_resume`); rank 0 then moves the unusable checkpoints of
    `resume_plan` aside and removes the leftovers of killed checkpoint writes. A write that fails stops the fit with
    `write_failure`'s line."""

    resume_plan: ResumePlan | None = None  # set by the CLI: what --ckpt_path last / auto_resume found

    def __init__(self, *args, lease_timeout_s: PositiveFloat = LEASE_TIMEOUT_S, **kwargs) -> None:
        """
        Args:
            lease_timeout_s: seconds after its holder's last renewal at which a fit's hold on its run folder lapses,
                where the file system's locks cannot be trusted (docs/FAULT_TOLERANCE.md, "One writer per run")
        """
        super().__init__(*args, **kwargs)
        self.lease_timeout_s = float(lease_timeout_s)
        # Lightning's default, the working directory, is no run's folder (a notebook's or a test's fit): nothing held.
        self.run_folder_given = kwargs.get("default_root_dir") is not None

    def _run(self, model, ckpt_path=None, weights_only=None):
        # The one point after the processes exist and before any checkpoint is read; Lightning has no hook there.
        if self.state.fn != TrainerFn.FITTING:
            return super()._run(model, ckpt_path=ckpt_path, weights_only=weights_only)
        if isinstance(self.strategy, ParallelStrategy):
            self.strategy.setup_environment()  # the process group a step early; _run finds it up and goes on
        with self._hold_run_folder():
            ckpt_path = agree_on_resume(ckpt_path)
            if self.is_global_zero:
                plan = self.resume_plan or ResumePlan(ckpt_path)
                tidy_checkpoint_folders([c.dirpath for c in self.checkpoint_callbacks if getattr(c, "dirpath", None)],
                                        [p for p in plan.unusable if str(p) != ckpt_path])
            try:
                return super()._run(model, ckpt_path=ckpt_path, weights_only=weights_only)
            except BaseException as err:
                stop = write_failure(self, err)
                if stop is None:
                    raise
                raise stop from err

    @contextlib.contextmanager
    def _hold_run_folder(self):
        """Rank 0 holds the run folder for the fit; every rank stops when another fit holds it."""
        hold, refusal = RunHold(self.default_root_dir, self.lease_timeout_s), None
        if self.is_global_zero and self.run_folder_given:
            try:
                hold.acquire()
            except RunFolderHeld as err:
                refusal = str(err)
        refusal = self.strategy.broadcast(refusal)
        if refusal is not None:
            raise RunFolderHeld(refusal)
        try:
            yield
        finally:
            hold.release()
