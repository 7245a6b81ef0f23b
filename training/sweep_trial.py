"""One sweep trial: `run_trial` runs it as an `imgcls fit` process, and the callback in that process reports to the
study.

    python -m training.sweep --trial fit <the trial's arguments>     # what run_trial starts, $IMGCLS_SWEEP_TRIAL set
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from training.sweep_file import Sweep, make_pruner, suggest, trial_args

TRIAL_ENV_VAR = "IMGCLS_SWEEP_TRIAL"  # JSON handed to a trial process: storage URL, study, trial id, metric, pruner


def _die_with_parent() -> None:
    """Runs in the trial process before exec: if the sweep process dies (even by SIGKILL), its trials stop too."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TrialFailed(RuntimeError):
    """The trial's `imgcls fit` exited with an error (its log is in the trial folder)."""


def run_trial(trial, sweep: Sweep, out: Path, url: str) -> float:
    # From its module, not the package: the package resolves names lazily, and two --workers threads doing that at
    # once make one of them fail with an ImportError.
    from optuna_integration.pytorch_lightning import PyTorchLightningPruningCallback

    params = suggest(trial, sweep)
    run_dir = out / f"trial_{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir))
    trial.set_user_attr("final_metrics", {})  # a retry copies its predecessor's attributes: start clean
    trial.storage.set_trial_system_attr(trial._trial_id, "ddp_pl:pruned", False)
    args = [*sweep.fixed_args, *trial_args(params), f"--trainer.default_root_dir={run_dir}"]
    env = dict(os.environ)
    # The storage URL may hold a password: it goes through the environment, never into a command line or config.
    env[TRIAL_ENV_VAR] = json.dumps({"storage": url, "study": sweep.name, "trial_id": trial._trial_id,
                                     "metric": sweep.metric, "hyperband": sweep.hyperband})
    env.setdefault("WANDB_RUN_GROUP", sweep.name)  # wandb runs of one sweep share a group
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "fit.log", "w") as log:
        log.write(f"imgcls fit {' '.join(args)}\n")
        log.flush()
        code = subprocess.call([sys.executable, "-m", "training.sweep", "--trial", "fit", *args], env=env,
                               stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if code != 0:
        raise TrialFailed(f"trial {trial.number} exited with {code}; see {run_dir / 'fit.log'}")
    # The child reported each epoch's metric into the storage; this replays it here and raises TrialPruned if the
    # pruner stopped it (optuna-integration's protocol for trainers in other processes).
    PyTorchLightningPruningCallback(trial, sweep.metric).check_pruned()
    final = trial.study._storage.get_trial_user_attrs(trial._trial_id).get("final_metrics", {})
    if sweep.metric not in final:
        raise TrialFailed(f"trial {trial.number} did not log {sweep.metric!r} (logged: {sorted(final)}); "
                          f"check metric.name in {sweep.path}")
    return final[sweep.metric]


def trial_callback():
    """The callback a trial process adds to its Trainer (built from the JSON in $IMGCLS_SWEEP_TRIAL)."""
    import optuna
    from optuna_integration.pytorch_lightning import PyTorchLightningPruningCallback

    class SweepTrial(PyTorchLightningPruningCallback):
        """Reports each validation epoch's metric to the study (pruning decided by the study's pruner), and the
        metrics of the final validation of the best checkpoint as the trial's result."""

        def __init__(self, spec: dict) -> None:
            study = optuna.load_study(study_name=spec["study"], storage=spec["storage"],
                                      pruner=make_pruner(spec["hyperband"]))
            super().__init__(optuna.trial.Trial(study, spec["trial_id"]), spec["metric"])

        def on_fit_start(self, trainer, pl_module) -> None:
            super().on_fit_start(trainer, pl_module)
            # The storage path of the DDP protocol, also for one process: the sweep process reads the results.
            self.is_ddp_backend = True
            if trainer.is_global_zero:
                self._trial.storage.set_trial_system_attr(self._trial._trial_id, "ddp_pl:intermediate_value", {})

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.state.fn == "fit":
                super().on_validation_end(trainer, pl_module)
            elif trainer.is_global_zero and not trainer.sanity_checking:  # after_fit's validation of the best
                final = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
                self._trial.storage.set_trial_user_attr(self._trial._trial_id, "final_metrics", final)

    return SweepTrial(json.loads(os.environ[TRIAL_ENV_VAR]))
