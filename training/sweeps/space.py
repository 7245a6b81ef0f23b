"""The sweep file: the W&B sweep schema checked key by key, and what each key means to Optuna (sampler, pruner,
suggestions).

    sweep = load_sweep("configs/sweeps/quickstart_lr.yaml")   # raises SweepFileError naming the key and the fix
    check_keys(sweep)                                          # one trial's command line parsed by `imgcls fit`
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

Method = Literal["grid", "random", "bayes"]
Goal = Literal["maximize", "minimize"]
Distribution = Literal["uniform", "log_uniform_values", "int_uniform", "q_uniform", "categorical"]
METHODS: tuple[str, ...] = get_args(Method)
GOALS: tuple[str, ...] = get_args(Goal)
DISTRIBUTIONS: tuple[str, ...] = get_args(Distribution)
TOP_KEYS = {"name", "description", "method", "metric", "parameters", "early_terminate", "run_cap", "program",
            "command", "project", "entity"}


class SweepFileError(ValueError):
    """A sweep file that does not follow the schema; the message names the file and the key."""


@dataclass
class Sweep:
    """A validated sweep file."""

    path: Path
    name: str
    method: Method
    metric: str
    goal: Goal
    parameters: dict[str, dict[str, Any]]
    fixed_args: list[str]  # the `command:` arguments after `fit` (base configs, fixed options), macros removed
    run_cap: int | None = None
    hyperband: dict[str, Any] | None = None
    grid: dict[str, list[Any]] = field(default_factory=dict)


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
        raise fail("command", "is missing; e.g. [${env}, ${interpreter}, -m, imgcls, fit, --config, "
                              "configs/quickstart.yaml, ${args}]")
    if not isinstance(command, list) or "fit" not in command or "${args}" not in command:
        raise fail("command", "must be a list that runs `fit` and ends with ${args}")
    return [str(a) for a in command[command.index("fit") + 1:] if not str(a).startswith("${")]


def trial_args(params: dict[str, Any]) -> list[str]:
    """`--key=value` exactly as W&B's ${args} writes them, so both controllers run the same command lines."""
    return [f"--{key}={value}" for key, value in params.items()]


def check_keys(sweep: Sweep) -> None:
    """Parse one trial's command line without running it, so a misspelt parameter fails before any trial.

    `imgcls fit --print_config` in this process, which has imported the CLI already (`imgcls sweep` is one of its
    commands): a second interpreter would import torch and Lightning again for a parse."""
    from training.cli.app import cli_main

    sample = {k: p["value"] if "value" in p else (p["values"][0] if "values" in p else p.get("min"))
              for k, p in sweep.parameters.items()}
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors), warnings.catch_warnings():
            # sys.argv holds `imgcls sweep ...`, not this parse's arguments: Lightning's warning about both is moot.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            cli_main(["fit", *sweep.fixed_args, *trial_args(sample), "--print_config"])
    except SystemExit as parsed:  # --print_config exits 0 once the config parsed; a rejected one, with its error
        if parsed.code not in (0, None):
            lines = [line for line in errors.getvalue().strip().splitlines() if line.strip()]
            raise SweepFileError(f"{sweep.path}: `parameters` or `command` is rejected by imgcls fit: "
                                 f"{lines[-1] if lines else parsed.code}") from None


# ---- what the file means to Optuna ------------------------------------------------------------------------------

def make_sampler(sweep: Sweep, seed: int | None):
    import optuna

    if sweep.method == "grid":  # every point is queued in the study (loop.open_study): the sampler draws none
        return optuna.samplers.RandomSampler(seed=seed)
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
