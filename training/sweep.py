"""`imgcls sweep`: a hyperparameter sweep described in the W&B sweep schema, run locally by Optuna.

    imgcls sweep --config configs/sweeps/quickstart_lr.yaml [--workers 2] [--storage postgresql://...]

Each trial is an ordinary `imgcls fit` run (a subprocess, so a crash or an out-of-memory kill costs one trial, not
the sweep) in `<out>/trial_NNNN/`. Trials live in an Optuna study: by default a SQLite file `<out>/sweep.db`; any
SQLAlchemy URL lets workers on several machines share the sweep. Rerunning the same command resumes: finished trials
are kept, failed or interrupted ones are retried. At the end a table sorted by the metric is printed and
`<out>/best.yaml` is written: `imgcls fit --config <out>/best.yaml` reruns the best trial.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

METHODS = ("grid", "random", "bayes")
GOALS = ("maximize", "minimize")
DISTRIBUTIONS = ("uniform", "log_uniform_values", "int_uniform", "q_uniform", "categorical")
TOP_KEYS = {"name", "description", "method", "metric", "parameters", "early_terminate", "run_cap", "program",
            "command", "project", "entity"}
TRIAL_ENV_VAR = "IMGCLS_SWEEP_TRIAL"  # JSON handed to a trial process: storage URL, study, trial id, metric, pruner


class SweepFileError(ValueError):
    """A sweep file that does not follow the schema; the message names the file and the key."""


@dataclass
class Sweep:
    """A validated sweep file."""

    path: Path
    name: str
    method: str
    metric: str
    goal: str
    parameters: dict[str, dict[str, Any]]
    fixed_args: list[str]  # the `command:` arguments after `fit` (base configs, fixed options), macros removed
    run_cap: int | None = None
    hyperband: dict[str, Any] | None = None
    grid: dict[str, list[Any]] = field(default_factory=dict)


# ---- the sweep file ---------------------------------------------------------------------------------------------

def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep file; every error names the offending key."""
    path = Path(path)
    if not path.is_file():
        raise SweepFileError(f"sweep file {path} does not exist")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SweepFileError(f"{path} is not valid YAML: {err}".replace("\n", " ")) from None

    def fail(key: str, message: str) -> SweepFileError:
        return SweepFileError(f"{path}: `{key}` {message}")

    if not isinstance(spec, dict):
        raise fail("<top level>", "must be a mapping")
    for key in spec:
        if key not in TOP_KEYS:
            raise fail(key, f"is not a sweep key; expected one of {', '.join(sorted(TOP_KEYS))}")
    method = spec.get("method")
    if method not in METHODS:
        raise fail("method", f"is {method!r}; choose one of {', '.join(METHODS)}")
    metric = spec.get("metric")
    if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
        raise fail("metric.name", "is missing; e.g. metric: {name: val/acc, goal: maximize}")
    goal = metric.get("goal", "minimize")  # W&B's default
    if goal not in GOALS:
        raise fail("metric.goal", f"is {goal!r}; choose maximize or minimize")
    params = spec.get("parameters")
    if not isinstance(params, dict) or not params:
        raise fail("parameters", "is missing or empty; key each parameter by its dotted config path")
    for key, p in params.items():
        _check_parameter(f"parameters.{key}", p, method, fail)
    run_cap = spec.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or run_cap < 1):
        raise fail("run_cap", f"is {run_cap!r}; it must be a positive integer")
    hyperband = spec.get("early_terminate")
    if hyperband is not None:
        if not isinstance(hyperband, dict) or hyperband.get("type") != "hyperband":
            raise fail("early_terminate.type", "must be hyperband (the only early-termination method supported)")
        for key in ("min_iter", "max_iter", "eta"):
            if key in hyperband and (not isinstance(hyperband[key], int) or hyperband[key] < 1):
                raise fail(f"early_terminate.{key}", f"is {hyperband[key]!r}; it must be a positive integer")
    sweep = Sweep(path=path, name=str(spec.get("name") or path.stem), method=method, metric=metric["name"],
                  goal=goal, parameters=params, fixed_args=_fixed_args(spec.get("command"), fail),
                  run_cap=run_cap, hyperband=hyperband)
    if method == "grid":
        sweep.grid = {k: _grid_values(p) for k, p in params.items() if "value" not in p}
    return sweep


def _check_parameter(key: str, p: Any, method: str, fail) -> None:
    if not isinstance(p, dict):
        raise fail(key, "must be a mapping with values, value, or min/max")
    if "value" in p:
        return
    if "values" in p:
        if not isinstance(p["values"], list) or not p["values"]:
            raise fail(f"{key}.values", "must be a non-empty list")
        return
    dist = p.get("distribution")
    if dist is not None and dist not in DISTRIBUTIONS:
        raise fail(f"{key}.distribution", f"is {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if "min" not in p or "max" not in p:
        raise fail(key, "needs `values`, `value`, or `min` and `max`")
    if not p["min"] < p["max"]:
        raise fail(f"{key}.min", f"({p['min']}) must be below max ({p['max']})")
    if dist == "log_uniform_values" and p["min"] <= 0:
        raise fail(f"{key}.min", "must be positive for log_uniform_values")
    if method == "grid" and _distribution(p) not in ("int_uniform", "q_uniform"):
        raise fail(key, "is continuous; a grid sweep needs `values` (or an int_uniform / q_uniform range)")


def _distribution(p: dict) -> str:
    if "values" in p:
        return "categorical"
    if p.get("distribution"):
        return p["distribution"]
    return "int_uniform" if isinstance(p["min"], int) and isinstance(p["max"], int) else "uniform"  # W&B's rule


def _grid_values(p: dict) -> list[Any]:
    if "values" in p:
        return list(p["values"])
    if _distribution(p) == "int_uniform":
        return list(range(p["min"], p["max"] + 1))
    q = p.get("q", 1)
    n = int(round((p["max"] - p["min"]) / q))
    return [p["min"] + i * q for i in range(n + 1)]


def _fixed_args(command: Any, fail) -> list[str]:
    """The arguments after `fit` in `command:`, without W&B's ${...} macros: base configs and fixed options."""
    if command is None:
        raise fail("command", "is missing; e.g. [${env}, ${interpreter}, -m, training.cli, fit, --config, "
                              "configs/quickstart.yaml, ${args}]")
    if not isinstance(command, list) or "fit" not in command or "${args}" not in command:
        raise fail("command", "must be a list that runs `fit` and ends with ${args}")
    return [str(a) for a in command[command.index("fit") + 1:] if not str(a).startswith("${")]


def trial_args(params: dict[str, Any]) -> list[str]:
    """`--key=value` exactly as W&B's ${args} writes them, so both controllers run the same command lines."""
    return [f"--{key}={value}" for key, value in params.items()]


# ---- Optuna -----------------------------------------------------------------------------------------------------

def make_sampler(sweep: Sweep, seed: int | None):
    import optuna

    if sweep.method == "grid":
        return optuna.samplers.GridSampler(sweep.grid, seed=seed)
    if sweep.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(hyperband: dict | None):
    import optuna

    if hyperband is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.HyperbandPruner(min_resource=hyperband.get("min_iter", 1),
                                          max_resource=hyperband.get("max_iter", "auto"),
                                          reduction_factor=hyperband.get("eta", 3))


def suggest(trial, sweep: Sweep) -> dict[str, Any]:
    """The trial's values for every parameter (fixed `value`s included), keyed by dotted config path."""
    values = {}
    for key, p in sweep.parameters.items():
        if "value" in p:
            values[key] = p["value"]
        elif sweep.method == "grid" or "values" in p:
            choices = sweep.grid.get(key) or p["values"]
            values[key] = trial.suggest_categorical(key, choices)
        else:
            dist = _distribution(p)
            if dist == "int_uniform":
                values[key] = trial.suggest_int(key, p["min"], p["max"])
            elif dist == "q_uniform":
                values[key] = trial.suggest_float(key, p["min"], p["max"], step=p.get("q", 1))
            else:
                values[key] = trial.suggest_float(key, p["min"], p["max"], log=dist == "log_uniform_values")
    return values


def _sqlite_path(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def open_study(sweep: Sweep, url: str, seed: int | None):
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(5):
        try:
            # Heartbeats let a worker on another machine notice a trial whose worker died, and retry it.
            storage = RDBStorage(url, heartbeat_interval=30, grace_period=120,
                                 heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=None))
            break
        except SQLAlchemyError:
            # Workers that start together on a fresh database race to create its tables (optuna issue 1092); the
            # loser's insert fails, and on a retry it finds the winner's schema in place.
            if attempt == 4:
                raise
            time.sleep(1 + attempt)
    direction = "maximize" if sweep.goal == "maximize" else "minimize"
    return optuna.create_study(study_name=sweep.name, storage=storage, direction=direction, load_if_exists=True,
                               sampler=make_sampler(sweep, seed), pruner=make_pruner(sweep.hyperband))


def requeue(study, *, sole_worker: bool) -> int:
    """Queue a retry of every failed trial not yet retried; with `sole_worker` (we hold the sweep folder's lock, so
    no other process runs this SQLite study) trials left RUNNING by a killed sweep count as failed."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    storage = study._storage
    trials = study.get_trials(deepcopy=False)
    if sole_worker:
        for t in trials:
            if t.state == TrialState.RUNNING:
                storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}
    retry = RetryHeartbeatStaleTrialCallback(max_retry=None)
    todo = [t for t in trials if t.state == TrialState.FAIL and t.number not in retried]
    for t in todo:
        retry(study, t)  # enqueues a WAITING copy with the same parameters (and grid point)
    return len(todo)


def remaining(study, sweep: Sweep, budget: int | None) -> int:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    waiting = sum(t.state == TrialState.WAITING for t in trials)
    if sweep.method == "grid":
        size = 1
        for values in sweep.grid.values():
            size *= len(values)
        covered = {tuple(t.params.get(k) for k in sweep.grid) for t in done}
        return max(size - len(covered), waiting)
    return max(0, (budget or 0) - len(done))


# ---- one trial --------------------------------------------------------------------------------------------------

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


def _trial_callback():
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


# ---- results ----------------------------------------------------------------------------------------------------

def write_best(study, sweep: Sweep, out: Path) -> Path | None:
    """`<out>/best.yaml`: the best trial's resolved config, writing into `<out>/best` instead of its own folder."""
    try:
        best = study.best_trial
    except ValueError:
        return None
    trial_dir = Path(best.user_attrs["run_dir"])
    config = yaml.safe_load((trial_dir / "config.yaml").read_text())

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

def check_keys(sweep: Sweep) -> None:
    """Parse one trial's command line without running it, so a misspelt parameter fails before any trial."""
    sample = {k: p["value"] if "value" in p else (p["values"][0] if "values" in p else p.get("min"))
              for k, p in sweep.parameters.items()}
    proc = subprocess.run([sys.executable, "-m", "training.cli", "fit", *sweep.fixed_args, *trial_args(sample),
                           "--print_config"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise SweepFileError(f"{sweep.path}: `parameters` or `command` is rejected by imgcls fit: "
                             f"{lines[-1] if lines else proc.returncode}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--trial"]:  # inside a trial process
        from training.cli import cli_main

        cli_main(argv[1:], trainer_defaults={"callbacks": [_trial_callback()]})
        return
    parser = argparse.ArgumentParser(prog="imgcls sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="sweep file in the W&B sweep schema")
    parser.add_argument("--out", help="sweep folder (default runs/sweeps/<name>)")
    parser.add_argument("--storage", default=os.environ.get("IMGCLS_SWEEP_STORAGE"),
                        help="SQLAlchemy URL of the Optuna storage (default sqlite:///<out>/sweep.db); "
                             "also read from $IMGCLS_SWEEP_STORAGE, which keeps a password off the command line")
    parser.add_argument("--workers", type=int, default=1, help="trials run at once on this machine")
    parser.add_argument("--trials", type=int, help="trials of a random/bayes sweep (default: run_cap)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.config)
        budget = args.trials or sweep.run_cap
        if sweep.method != "grid" and budget is None:
            raise SweepFileError(f"{sweep.path}: `run_cap` is missing; a {sweep.method} sweep needs a number of "
                                 "trials (or pass --trials N)")
        check_keys(sweep)
    except SweepFileError as err:
        raise SystemExit(f"error: {err}") from None
    if args.workers < 1:
        raise SystemExit("error: --workers must be at least 1")

    out = Path(args.out or Path("runs/sweeps") / sweep.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    url = args.storage or f"sqlite:///{out / 'sweep.db'}"
    lock = open(out / ".sweep.lock", "w")  # noqa: SIM115 (held for the life of the process)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: another `imgcls sweep` runs in {out}; use --workers N to run trials in "
                         "parallel, or a shared --storage URL for workers on other machines") from None

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # check_pruned() replays the epochs a trial process already reported; Optuna warns about each duplicate.
    warnings.filterwarnings("ignore", message="The reported value is ignored")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = open_study(sweep, url, args.seed)
    retried = requeue(study, sole_worker=_sqlite_path(url) is not None)
    todo = remaining(study, sweep, budget)
    safe_url = url if _sqlite_path(url) else url.split("://")[0] + "://..."  # never print a password
    print(f"sweep {sweep.name}: {todo} trial(s) to run ({retried} retried), {args.workers} at once; "
          f"storage {safe_url}; trials in {out}", flush=True)
    while todo > 0:
        study.optimize(lambda trial: run_trial(trial, sweep, out, url), n_trials=todo, n_jobs=args.workers,
                       catch=(TrialFailed,))
        before, todo = todo, remaining(study, sweep, budget)
        if todo >= before or sweep.method != "grid":
            break  # failures are retried by the next invocation, not in a loop here
    print_table(study, sweep)
    best = write_best(study, sweep, out)
    print(f"best config: {best}  (rerun: imgcls fit --config {best})" if best else "no trial finished")


if __name__ == "__main__":
    main()
