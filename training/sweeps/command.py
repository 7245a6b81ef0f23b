"""`imgcls sweep`: a hyperparameter sweep described in the W&B sweep schema, run locally by Optuna.

    imgcls sweep configs/sweeps/quickstart_lr.yaml [--workers 2] [--storage postgresql://...]
    imgcls sweep --config my_sweep_settings.yaml     # these settings in a file: `sweep_file: ...`, `workers: 2`, ...

Each trial is an ordinary `imgcls fit` run (a subprocess, so a crash or an out-of-memory kill costs one trial, not
the sweep) in `<out>/trial_NNNN/`. Trials live in an Optuna study: by default a SQLite file `<out>/sweep.db`; any
SQLAlchemy URL lets workers on several machines share the sweep. `--storage journal:///<path>` keeps the study in an
Optuna journal file instead, for many workers on one machine (`--workers N`, or several sweeps on one storage): they
append to it under a file lock, with no SQLite database lock to time out. It is not the default for `--workers > 1`
because the storage would then follow `--workers`, and a sweep resumed with another count would find no trials.

A grid's points are queued in the study once, by the worker that creates it, and each is taken by one worker.
`run_cap` (or `--trials`) counts the finished (complete or pruned) and running trials of every worker of the study:
a worker starts a new trial only while they are fewer. Rerunning the same command resumes: finished trials are kept,
failed or interrupted ones are retried (through the database's heartbeat when another worker may still run them:
every `--heartbeat` seconds while a trial runs, and a trial whose worker has sent none for `--grace` seconds is
failed and queued again, saying so in one line; a journal has none, so a trial left running by a dead worker is
retried by the next sweep that is alone on that journal). A worker with no trial left to start waits for the trials
other workers run, to retry any whose worker dies. Each trial it finishes prints a line (progress.py). At the end a
table sorted by the metric is printed and `<out>/best.yaml` is written: `imgcls fit --config <out>/best.yaml` reruns
the best trial.

The sweep file's schema is in training/sweeps/space.py, the queue and the loop that takes trials in
training/sweeps/loop.py, one trial's process in training/sweeps/trial.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import yaml

from core.command_line import parse_settings
from core.config_types import PositiveInt
from core.extras import require_extra
from training.records.secrets import redact_secrets
from training.sweeps.loop import grid_points, heartbeat_interval, new_trials, open_study, run_trials
from training.sweeps.progress import SweepProgress
from training.sweeps.space import Sweep, SweepFileError, check_keys, load_sweep
from training.sweeps.trial import STORAGE_ENV_VAR, open_storage, run_trial, storage_file

# A database storage's heartbeat, and the age of a trial's last one at which it counts as dead (seconds): the defaults
# of --heartbeat and --grace.
HEARTBEAT, GRACE = 30, 120

# ---- the study --------------------------------------------------------------------------------------------------

class RetryStale:
    """Optuna's retry of a trial whose worker stopped sending heartbeats (a WAITING copy with the same parameters and
    grid point), announced in one line."""

    def __init__(self, grace: int) -> None:
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        self.retry, self.grace = RetryHeartbeatStaleTrialCallback(max_retry=None), grace

    def __call__(self, study, trial) -> None:
        self.retry(study, trial)
        retry = next(t.number for t in reversed(study.get_trials(deepcopy=False))
                     if self.retry.retry_history(t)[-1:] == [trial.number])
        params = ", ".join(f"{k}={v}" for k, v in trial.params.items())
        print(f"trial {trial.number} ({params}) is retried as trial {retry}: its worker "
              f"({trial.user_attrs.get('worker', 'unknown')}) sent no heartbeat for {self.grace} s", flush=True)


def connect(url: str, heartbeat: int, grace: int):
    """The sweep's storage. A database's heartbeats let a worker on another machine notice a trial whose worker died,
    and retry it."""
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(5):
        try:
            return open_storage(url, heartbeat_interval=heartbeat, grace_period=grace,
                                heartbeat_stale_trial_callback=RetryStale(grace))
        except SQLAlchemyError:
            # Workers that start together on a fresh database race to create its tables (optuna issue 1092); the
            # loser's insert fails, and on a retry it finds the winner's schema in place.
            if attempt == 4:
                raise
            time.sleep(1 + attempt)


def requeue(study, *, sole_worker: bool) -> int:
    """Queue a retry of every failed trial not yet retried; with `sole_worker` (no other sweep uses this storage
    file) trials left RUNNING by a killed sweep count as failed."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    if sole_worker:
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}
    retry = RetryHeartbeatStaleTrialCallback(max_retry=None)
    todo = [t for t in trials if t.state == TrialState.FAIL and t.number not in retried]
    for t in todo:
        retry(study, t)  # enqueues a WAITING copy with the same parameters (and grid point)
    return len(todo)


def remaining(study, sweep: Sweep, budget: int | None) -> int:
    """Trials to run: a grid's queued points and retries; else the budget less the finished trials of every
    worker."""
    from optuna.trial import TrialState

    if sweep.method == "grid":
        return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return max(0, (budget or 0) - len(done))


# ---- results ----------------------------------------------------------------------------------------------------

def write_best(study, sweep: Sweep, out: Path) -> Path | None:
    """`<out>/best.yaml`: the best trial's resolved config (kept in the study: the trial may have run on another
    machine), writing into `<out>/best` instead of the trial's folder."""
    try:
        best = study.best_trial
    except ValueError:
        return None
    trial_dir = Path(best.user_attrs["run_dir"])
    config = yaml.safe_load(best.user_attrs["config"])

    def move(node):
        if isinstance(node, dict):
            return {k: move(v) for k, v in node.items()}
        if isinstance(node, list):
            return [move(v) for v in node]
        if isinstance(node, str) and node.startswith(str(trial_dir)):
            return str(out / "best") + node[len(str(trial_dir)):]
        return node

    path = out / "best.yaml"
    header = (f"# Best trial of sweep {sweep.name}: trial {best.number}, {sweep.metric} = {best.value:.6g}\n"
              f"#   imgcls fit --config {path}\n")
    path.write_text(header + yaml.safe_dump(move(config), sort_keys=False))
    return path


def print_table(study, sweep: Sweep) -> None:
    from optuna.trial import TrialState
    from rich.console import Console
    from rich.table import Table

    trials = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    sign = -1 if sweep.goal == "maximize" else 1
    trials.sort(key=lambda t: (t.value is None, sign * (t.value or 0.0), t.number))
    table = Table(title=f"sweep {sweep.name}: {sweep.metric} ({sweep.goal})")
    table.add_column("trial", justify="right")
    table.add_column("state")
    table.add_column(sweep.metric, justify="right")
    names = [k for k, p in sweep.parameters.items() if "value" not in p]
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("run directory")
    for t in trials:
        value = f"{t.value:.4f}" if t.value is not None else "-"
        table.add_row(str(t.number), t.state.name.lower(), value,
                      *(f"{t.params[n]:.4g}" if isinstance(t.params.get(n), float) else str(t.params.get(n, "-"))
                        for n in names),
                      t.user_attrs.get("run_dir", "-"))
    Console().print(table)


# ---- the command ------------------------------------------------------------------------------------------------

@dataclass
class SweepSettings:
    """The settings of `imgcls sweep` (its own `--config` holds these; the trials' configs are in the sweep file)."""

    sweep_file: str
    """sweep file in the W&B sweep schema, e.g. configs/sweeps/quickstart_lr.yaml"""
    _: KW_ONLY
    out: str | None = None
    """sweep folder (default runs/sweeps/<name>)"""
    storage: str | None = None
    """Optuna storage: an SQLAlchemy URL (default $IMGCLS_SWEEP_STORAGE, which keeps a password off the command line
    and out of configs, else sqlite:///<out>/sweep.db), or journal:///<path> for a journal file (many workers on one
    machine)"""
    workers: PositiveInt = 1
    """trials run at once on this machine"""
    trials: PositiveInt | None = None
    """trials of a random/bayes sweep (default: run_cap)"""
    seed: int | None = None
    """seed of the sampler"""
    heartbeat: PositiveInt = HEARTBEAT
    """seconds: a database storage's heartbeat, how often a worker says that its trials still run"""
    grace: PositiveInt = GRACE
    """seconds: a trial whose worker has sent no heartbeat for this long is failed and retried; give every worker of
    a sweep the same heartbeat and grace"""


def _sweep_file_as_settings(argv: list[str]) -> None:
    """Exits naming the fix when a `--config` of `argv` is a sweep file (`method` and `parameters`, the W&B schema):
    --config takes this command's settings, the sweep file comes first."""
    paths = [value for flag, value in itertools.pairwise([*argv, ""]) if flag == "--config"]
    paths += [flag.partition("=")[2] for flag in argv if flag.startswith("--config=")]
    for path in paths:
        try:
            text = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue  # the parser says what is wrong with it
        if isinstance(text, dict) and {"method", "parameters"} <= text.keys():
            print(f"imgcls sweep: error: {path} is a sweep file: run `imgcls sweep {path}`; --config takes the "
                  "settings of imgcls sweep itself (`imgcls sweep --print_config` shows them)", file=sys.stderr)
            raise SystemExit(2)


def _load(args: SweepSettings) -> tuple[Sweep, int | None]:
    """The checked sweep file and its budget of finished trials (None for a grid); exits naming the key at fault."""
    try:
        sweep = load_sweep(args.sweep_file)
        budget = args.trials or sweep.run_cap
        if sweep.method != "grid" and budget is None:
            raise SweepFileError(f"{sweep.path}: `run_cap` is missing; a {sweep.method} sweep needs a number of "
                                 "trials (or pass --trials N)")
        check_keys(sweep)
    except SweepFileError as err:
        raise SystemExit(f"error: {err}") from None
    if not args.heartbeat < args.grace:
        raise SystemExit(f"error: --heartbeat ({args.heartbeat}) must be below --grace ({args.grace}), "
                         "or every trial would look dead between two heartbeats")
    return sweep, budget


def _try_lock(handle, kind: int) -> bool:
    """Take a flock of `kind` (LOCK_EX or LOCK_SH) on the open file `handle`; False when another process's lock
    stands in the way."""
    try:
        fcntl.flock(handle, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _retry_failed(held: contextlib.ExitStack, url: str, study) -> int:
    """requeue(), and a shared lock on the storage file held until `held` closes. Every sweep on the file holds it
    shared while it runs trials, so one that gets it exclusive is alone there: a trial still RUNNING was left by a
    killed sweep. A database server has heartbeats for that instead."""
    file = storage_file(url)
    if file is None:
        return requeue(study, sole_worker=False)
    lock = held.enter_context(open(file.with_name(f".{file.name}.lock"), "a"))
    alone = _try_lock(lock, fcntl.LOCK_EX)
    if not alone:
        fcntl.flock(lock, fcntl.LOCK_SH)  # waits while a sweep that is alone fails what killed ones left running
    retried = requeue(study, sole_worker=alone)
    fcntl.flock(lock, fcntl.LOCK_SH)  # others may join now: the exclusive lock becomes a shared one
    return retried


def run_sweep(sweep: Sweep, out: Path, url: str, *, budget: int | None, workers: int, seed: int | None,
              heartbeat: int, grace: int, held: contextlib.ExitStack, launcher: Sequence[str]) -> None:
    """Retry what failed, run the trials left (each `[sys.executable, *launcher, "fit", ...]`), print the table and
    write best.yaml."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # The sweep's own loop (training/sweeps/loop.py) asks new trials and records their heartbeats.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    storage = connect(url, heartbeat, grace)
    study, _ = open_study(sweep, storage, seed, wait=grace)
    retried = _retry_failed(held, url, study)
    todo = remaining(study, sweep, budget)
    print(f"sweep {sweep.name}: {todo} trial(s) to run ({retried} retried), {workers} at once; "
          f"storage {redact_secrets(url)}; trials in {out}", flush=True)
    total = len(grid_points(sweep)) if sweep.method == "grid" else budget
    fresh = new_trials(study, None if sweep.method == "grid" else budget, todo)
    waiting = False
    with SweepProgress(study, sweep, total) as progress:
        while True:
            run_trials(study, storage, url, lambda trial: run_trial(trial, sweep, out, url, launcher),
                       workers=workers, fresh=fresh, finished=progress.finished)
            # A database's heartbeats tell a dead worker's trial from a running one: wait to retry any such.
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if heartbeat_interval(
                storage) else []
            if not running:
                break
            if not waiting:
                print(f"sweep {sweep.name}: no trial left to start; waiting for {len(running)} trial(s) of other "
                      f"workers, to retry any whose worker sends no heartbeat for {grace} s", flush=True)
                waiting = True
            time.sleep(heartbeat)
    print_table(study, sweep)
    best = write_best(study, sweep, out)
    print(f"best config: {best}  (rerun: imgcls fit --config {best})" if best else "no trial finished")


def main(argv: list[str] | None = None, *, launcher: Sequence[str]) -> None:
    """`imgcls sweep ARGV`; `launcher`, what starts a trial's `imgcls fit` process after `sys.executable` (handed
    down by the command on top: `-m imgcls.trial`)."""
    require_extra("sweep", "imgcls sweep")
    argv = sys.argv[1:] if argv is None else list(argv)
    _sweep_file_as_settings(argv)
    args = parse_settings(SweepSettings, argv, prog="imgcls sweep", description=__doc__)
    sweep, budget = _load(args)
    out = Path(args.out or Path("runs/sweeps") / sweep.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    url = args.storage or os.environ.get(STORAGE_ENV_VAR) or f"sqlite:///{out / 'sweep.db'}"
    with contextlib.ExitStack() as held:
        if not _try_lock(held.enter_context(open(out / ".sweep.lock", "w")), fcntl.LOCK_EX):
            raise SystemExit(f"error: another `imgcls sweep` runs in {out}; use --workers N to run trials in "
                             "parallel, or a shared --storage URL for workers on other machines")
        run_sweep(sweep, out, url, budget=budget, workers=args.workers, seed=args.seed,
                  heartbeat=args.heartbeat, grace=args.grace, held=held, launcher=launcher)
