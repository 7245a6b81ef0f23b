"""One sweep trial: `run_trial` runs it as an `imgcls fit` process, and the callback in that process reports to the
study.

    <sys.executable> <launcher> fit <the trial's arguments>    # what run_trial starts, $IMGCLS_SWEEP_TRIAL set

The launcher is handed down by the command on top: a process that runs `main` below through the start-up. The sweep
names no room above its own.

Both ends open the study from the same storage URL (`open_storage`): an SQLAlchemy URL, or `journal:///<path>` for an
Optuna journal file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from training.sweeps.space import Sweep, make_pruner, suggest, trial_args

STORAGE_ENV_VAR = "IMGCLS_SWEEP_STORAGE"  # the storage URL for `imgcls sweep` and its dashboard, password kept off argv
TRIAL_ENV_VAR = "IMGCLS_SWEEP_TRIAL"  # JSON handed to a trial process: storage URL, study, trial number, metric, pruner
# optuna-integration's private protocol for a trainer in another process: where it leaves each epoch's metric and its
# pruning decision (tests/test_internals.py holds these to the integration's own names).
INTERMEDIATE_KEY, PRUNED_KEY, EPOCH_KEY = "ddp_pl:intermediate_value", "ddp_pl:pruned", "ddp_pl:epoch"
JOURNAL = "journal:///"


def storage_file(url: str) -> Path | None:
    """The file behind a `sqlite:///` or `journal:///` URL; None for a database server."""
    for scheme in ("sqlite:///", JOURNAL):
        if url.startswith(scheme):
            return Path(url.removeprefix(scheme))
    return None


def open_storage(url: str, **rdb_options):
    """The Optuna storage at `url`: `journal:///<path>` a JournalStorage, any other URL an RDBStorage(`rdb_options`)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if url.startswith(JOURNAL):
        return JournalStorage(JournalFileBackend(str(storage_file(url))))
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, **rdb_options)
        except Exception as err:
            # Workers that meet an empty database at one instant each create Optuna's tables, and PostgreSQL refuses
            # all but one (sqlalchemy's IntegrityError: a duplicate pg_type row); the others find them made.
            if type(err).__name__ != "IntegrityError" or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def _die_with_parent() -> None:
    """Runs in the trial process before exec: if the sweep process dies (even by SIGKILL), its trials stop too."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TrialFailed(RuntimeError):
    """The trial's `imgcls fit` exited with an error (its log is in the trial folder)."""


def continued_run(trial) -> tuple[Path | None, str]:
    """For a retry (a trial queued again because the one before failed or lost its worker): that trial's run folder,
    where the retry's fit goes on from the newest intact checkpoint (auto_resume, an exact resume), or None to start
    from step 0; and the line that says which, and why not."""
    history = trial.study.get_trials(deepcopy=False)[trial.number].system_attrs.get("retry_history", [])
    if not history:
        return None, ""
    start = f"trial {trial.number} retries trial {history[-1]}"
    folder = trial.user_attrs.get("run_dir")  # the retried trial's, copied into its retry
    if folder is None:
        return None, f"{start} from step 0: it had no run folder yet"
    folder = Path(folder)
    if not folder.is_dir():
        return None, (f"{start} from step 0: its run folder {folder} is not on this machine ({socket.gethostname()}), "
                      "which sees no shared file system there")
    import yaml

    from training.records.saved_run import SavedRun
    from training.resume.checkpoints import UnsafeCheckpointError, newest_intact_checkpoint
    from training.resume.same_run import finished

    newest, _ = newest_intact_checkpoint(folder / "checkpoints")
    if newest is None:
        return None, f"{start} from step 0: {folder} holds no intact checkpoint"
    try:
        saved = SavedRun.read(newest)
    except (UnsafeCheckpointError, ValueError) as err:
        return None, f"{start} from step 0: {newest} cannot be read ({err})"
    config = folder / "config.yaml"
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {} if config.is_file() else {}
    why = finished(saved, trainer.get("max_epochs"), trainer.get("max_steps", -1))
    if why:  # its worker died after the fit's end: a resume would train nothing
        return None, f"{start} from step 0: its fit in {folder} had finished ({why})"
    return folder, f"{start}: it continues that fit in {folder} from step {saved.global_step} ({newest.name})"


def run_trial(trial, sweep: Sweep, out: Path, url: str, launcher: Sequence[str]) -> float:
    """Run one trial as an `imgcls fit` process in `<out>/trial_NNNN` (a retry: in the folder of the trial it retries,
    where it can go on there), `[sys.executable, *launcher, "fit", ...]`; its result is the metric of the final
    validation of its best checkpoint. Raises TrialPruned if the pruner stopped it, TrialFailed if it failed."""
    params = suggest(trial, sweep)
    continued, said = continued_run(trial)
    if said:
        print(said, flush=True)
    run_dir = continued or out / f"trial_{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir))
    for key, value in (("final_metrics", {}), ("start_step", None)):  # a retry copies its predecessor's: start clean
        trial.set_user_attr(key, value)
    # Named if it dies mid-trial; set after the two above, so that once it names this worker they are this trial's.
    trial.set_user_attr("worker", f"{socket.gethostname()} pid {os.getpid()}")
    if continued:  # the epochs that fit validated before, so that the trial's curve is whole
        trials = trial.study.get_trials(deepcopy=False)
        for step, value in trials[trials[trial.number].system_attrs["retry_history"][-1]].intermediate_values.items():
            trial.report(value, step)
    args = [*sweep.fixed_args, *trial_args(params), f"--trainer.default_root_dir={run_dir}",
            *(["--auto_resume=true"] if continued else [])]
    env = dict(os.environ)
    # The storage URL may hold a password: it goes through the environment, never into a command line or config.
    env[TRIAL_ENV_VAR] = json.dumps({"storage": url, "study": sweep.name, "trial_number": trial.number,
                                     "metric": sweep.metric, "hyperband": sweep.hyperband})
    env.setdefault("WANDB_RUN_GROUP", sweep.name)  # wandb runs of one sweep share a group
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "fit.log", "a" if continued else "w") as log:  # a continued fit's log goes on too
        log.write(f"{said}\n" if continued else "")
        log.write(f"imgcls fit {' '.join(args)}\n")
        log.flush()
        # sys.executable read at each start, as Lightning's launcher reads it for each DDP rank
        code = subprocess.call([sys.executable, *launcher, "fit", *args], env=env, stdout=log,
                               stderr=subprocess.STDOUT,
                               preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if code != 0:
        raise TrialFailed(f"trial {trial.number} exited with {code}; see {run_dir / 'fit.log'}")
    # In the study, so that any worker writes best.yaml, also one whose machine cannot see this run folder.
    trial.set_user_attr("config", (run_dir / "config.yaml").read_text())
    return _outcome(trial, sweep)


def _outcome(trial, sweep: Sweep) -> float:
    """What the trial process left in the study: pruned (raises TrialPruned), or the final value of the metric."""
    import optuna

    left = trial.study.get_trials(deepcopy=False)[trial.number]  # read again from the storage
    # The pruning flag is read here, not by the callback's check_pruned(), which skips any storage but an RDB one.
    if left.system_attrs.get(PRUNED_KEY):
        raise optuna.TrialPruned(f"trial {trial.number} was pruned at epoch {left.system_attrs.get(EPOCH_KEY)}")
    final = left.user_attrs.get("final_metrics", {})
    if sweep.metric not in final:
        raise TrialFailed(f"trial {trial.number} did not log {sweep.metric!r} (logged: {sorted(final)}); "
                          f"check metric.name in {sweep.path}")
    return final[sweep.metric]


def open_trial(spec: dict):
    """(the running trial of `spec`, as an optuna Trial, its storage id): in the trial process, from the study's name
    and the trial's number through the storage's public lookup."""
    import optuna

    storage = open_storage(spec["storage"])
    study = optuna.load_study(study_name=spec["study"], storage=storage, pruner=make_pruner(spec["hyperband"]))
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(spec["study"]),
                                                               spec["trial_number"])
    return optuna.trial.Trial(study, trial_id), trial_id


def trial_callback():
    """The callback a trial process adds to its Trainer (built from the JSON in $IMGCLS_SWEEP_TRIAL)."""
    from optuna_integration.pytorch_lightning import PyTorchLightningPruningCallback

    class SweepTrial(PyTorchLightningPruningCallback):
        """Reports each validation epoch's metric to the study (pruning decided by the study's pruner), and the
        metrics of the best checkpoint as the trial's result: those of the fit's validation of its weights (kept by
        training.callbacks.ModelCheckpoint), else those of the closing validation of its file that the CLI then runs,
        else (no checkpoint) the newest validation's."""

        def __init__(self, spec: dict) -> None:
            self.trial, self.trial_id = open_trial(spec)
            super().__init__(self.trial, spec["metric"])

        def on_fit_start(self, trainer, pl_module) -> None:
            # The integration's DDP protocol, also for one process: the sweep process reads the outcome. Not its
            # on_fit_start, which refuses a storage other than an RDB one under DDP (a journal file serves too).
            self.is_ddp_backend = True
            if trainer.is_global_zero:  # a retry copies its predecessor's system attributes: start clean
                for key, value in ((INTERMEDIATE_KEY, {}), (PRUNED_KEY, False)):
                    self.trial.storage.set_trial_system_attr(self.trial_id, key, value)

        def on_train_start(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:  # after a resume's restore: the step this fit continues from (0 when fresh)
                self.trial.set_user_attr("start_step", trainer.global_step)

        def on_fit_end(self, trainer, pl_module) -> None:
            # training.callbacks.ModelCheckpoint's (not imported: sweeps sit beside callbacks, not above them)
            best_validation = getattr(trainer.checkpoint_callback, "best_validation", None)
            seen = best_validation() if best_validation is not None else None
            if trainer.is_global_zero and seen is not None:
                self.trial.set_user_attr("final_metrics", seen["metrics"])

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.state.fn == "fit":
                super().on_validation_end(trainer, pl_module)
            if trainer.is_global_zero and not trainer.sanity_checking:
                final = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
                self.trial.set_user_attr("final_metrics", final)

    return SweepTrial(json.loads(os.environ[TRIAL_ENV_VAR]))


def main(argv: list[str] | None = None) -> None:
    """Inside a trial process: `imgcls fit` with the callback that reports to the study."""
    from training.cli.app import cli_main

    cli_main(argv, trainer_defaults={"callbacks": [trial_callback()]})  # None: sys.argv, as `imgcls fit` reads it
