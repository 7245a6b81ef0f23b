"""Config-file sweeps: the W&B schema checked key by key, and a real Optuna grid sweep that is killed and resumed."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imgcls.commands import main as imgcls
from tests.helpers import (
    CONFIGS,
    ROOT,
    TINY,
    last_weights,
    resume_config,
    run_cli,
    start_cli,
    wait_until,
    wandb_offline_env,
    wandb_run_record,
)
from training.callbacks import ModelCheckpoint
from training.cli.app import cli_main
from training.sweeps import command
from training.sweeps.command import main as sweep
from training.sweeps.command import print_table, remaining, requeue, write_best
from training.sweeps.loop import open_study, run_trials, take
from training.sweeps.progress import SweepProgress, seconds
from training.sweeps.space import SweepFileError, load_sweep, make_pruner, make_sampler, suggest, trial_args
from training.sweeps.trial import (
    EPOCH_KEY,
    PRUNED_KEY,
    STORAGE_ENV_VAR,
    TRIAL_ENV_VAR,
    continued_run,
    open_storage,
    open_trial,
    trial_callback,
)

# Optuna's heartbeat and retry API is experimental: `imgcls sweep` ignores the warnings it raises (run_sweep), so do
# the tests that call its parts.
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

SHIPPED = CONFIGS / "sweeps" / "quickstart_lr.yaml"
LR, WD = "model.optimizer.lr", "model.optimizer.weight_decay"  # the swept keys: init_args of the optimizer
FAKE_TRIAL = ("-m", "tests.sweep_fake_trial")  # the launcher of a trial that trains nothing (tests/sweep_fake_trial.py)


def sweep_main(argv: list[str]) -> None:
    """`imgcls sweep ARGV` in this process: the command on top hands the sweep its trial launcher."""
    imgcls(["sweep", *argv])


def sweep_command(digits_root: Path, *overlays: Path) -> list[str]:
    """A trial command of the quickstart shrunk to seconds, with config overlays (loggers) after it."""
    return ["${env}", "${interpreter}", "-m", "imgcls", "fit", "--config", str(CONFIGS / "quickstart.yaml"),
            *(arg for overlay in overlays for arg in ("--config", str(overlay))), *TINY,
            "--data.root", str(digits_root),
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "${args}"]


def write_sweep(path: Path, digits_root: Path, **overrides) -> Path:
    spec = {
        "name": "grid2x2",
        "method": "grid",
        "metric": {"name": "val/acc", "goal": "maximize"},
        "parameters": {
            LR: {"values": [0.02, 0.2]},
            WD: {"values": [0.0, 0.05]},
            "trainer.max_epochs": {"value": 1},
        },
        "command": sweep_command(digits_root),
    }
    spec.update(overrides)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_shipped_sweep_file_is_valid():
    sweep = load_sweep(SHIPPED)
    assert sweep.method == "bayes" and sweep.metric == "val/acc" and sweep.hyperband["type"] == "hyperband"
    assert sweep.fixed_args == ["--config", "configs/quickstart.yaml", "--config", "configs/loggers/wandb.yaml",
                                "--trainer.default_root_dir=runs/sweeps/quickstart_lr"]


def test_shipped_sweep_command_is_a_fit_that_logs_to_wandb(monkeypatch, capsys):
    """What `wandb agent` runs from the repository root, ${args} expanded: it parses, W&B logger included (the
    controller reads val/acc from W&B), with the trial's values in place."""
    sweep = load_sweep(SHIPPED)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["imgcls"])
    params = {LR: 0.003, WD: 0.01, "trainer.max_epochs": 4}
    with pytest.raises(SystemExit) as exit_:
        cli_main(["fit", *sweep.fixed_args, *trial_args(params), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    loggers = [logger["class_path"] for logger in printed["trainer"]["logger"]]
    assert loggers == ["lightning.pytorch.loggers.TensorBoardLogger", "lightning.pytorch.loggers.WandbLogger"]
    optimizer = printed["model"]["optimizer"]["init_args"]
    assert (optimizer["lr"], optimizer["weight_decay"], printed["trainer"]["max_epochs"]) == (0.003, 0.01, 4)
    assert printed["trainer"]["default_root_dir"] == "runs/sweeps/quickstart_lr"


@pytest.mark.parametrize(("method", "sampler"), [("random", optuna.samplers.RandomSampler),
                                                 ("bayes", optuna.samplers.TPESampler)])
def test_each_method_gets_its_optuna_sampler(tmp_path, method, sampler):
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path, method=method))
    assert type(make_sampler(sweep, seed=0)) is sampler


def test_hyperband_maps_to_optunas_pruner(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path,
                                   early_terminate={"type": "hyperband", "min_iter": 2, "max_iter": 8, "eta": 2}))
    pruner = make_pruner(sweep.hyperband)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (2, 8, 2)
    assert isinstance(make_pruner(None), optuna.pruners.NopPruner)


@pytest.mark.parametrize(("goal", "order"), [("maximize", ["1", "3", "0", "2"]), ("minimize", ["0", "3", "1", "2"])])
def test_result_table_is_sorted_by_the_metric(tmp_path, capsys, goal, order):
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path, metric={"name": "val/acc", "goal": goal}))
    study = optuna.create_study(direction=goal)
    space = {LR: CategoricalDistribution([0.02, 0.2]), WD: CategoricalDistribution([0.0])}
    for number, value in enumerate([0.5, 0.9, None, 0.7]):  # trial 2 failed: no value, listed last
        study.add_trial(create_trial(params={LR: 0.02, WD: 0.0}, distributions=space,
                                     value=value, state=TrialState.FAIL if value is None else TrialState.COMPLETE,
                                     user_attrs={"run_dir": f"trial_{number:04d}"}))
    print_table(study, sweep)
    out = capsys.readouterr().out
    assert f"val/acc ({goal})" in out
    assert [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")] == order


def test_best_yaml_comes_from_the_study_not_the_trials_folder(tmp_path):
    """Any worker writes best.yaml from the config its best trial left in the study: that trial may have run on
    another machine, whose folder this one cannot read (none of these folders exists)."""
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path))
    study = optuna.create_study(direction="maximize")
    space = {LR: CategoricalDistribution([0.02, 0.2]), WD: CategoricalDistribution([0.0])}
    for number, lr in enumerate([0.02, 0.2]):
        run_dir = tmp_path / "other_machine" / f"trial_{number:04d}"
        config = {"model": {"optimizer": {"init_args": {"lr": lr}}},
                  "trainer": {"default_root_dir": str(run_dir), "callbacks": [{"dirpath": str(run_dir / "ckpt")}]}}
        study.add_trial(create_trial(params={LR: lr, WD: 0.0}, distributions=space, value=lr,
                                     user_attrs={"run_dir": str(run_dir), "config": yaml.safe_dump(config)}))
    out = tmp_path / "sweep"
    out.mkdir()
    path = write_best(study, sweep, out)
    assert path.read_text().startswith(f"# Best trial of sweep {sweep.name}: trial 1, val/acc = 0.2\n")
    best = yaml.safe_load(path.read_text())
    assert best["model"]["optimizer"]["init_args"]["lr"] == 0.2
    moved = {"default_root_dir": str(out / "best"), "callbacks": [{"dirpath": str(out / "best" / "ckpt")}]}
    assert best["trainer"] == moved


def test_grid_expands_ranges_and_args_match_wandb_format(tmp_path):
    path = write_sweep(tmp_path / "s.yaml", tmp_path, parameters={
        "trainer.max_epochs": {"distribution": "int_uniform", "min": 1, "max": 3},
        "model.net.dropout": {"distribution": "q_uniform", "min": 0.0, "max": 0.5, "q": 0.25},
    })
    sweep = load_sweep(path)
    assert sweep.grid == {"trainer.max_epochs": [1, 2, 3], "model.net.dropout": [0.0, 0.25, 0.5]}
    assert trial_args({LR: 0.1, "model.optimizer.nesterov": True}) == ["--model.optimizer.lr=0.1",
                                                                        "--model.optimizer.nesterov=True"]


def _in_memory(study, storage, objective) -> list[int]:
    """Run the study's trials as a sweep worker does (training/sweeps/loop.py), `objective` in this process; the
    numbers of the trials it ran. (A database server's URL: the take needs no lock file.)"""
    ran = []
    run_trials(study, storage, "postgresql://in-memory", objective, workers=1, fresh=lambda: False,
               finished=lambda number, failure: ran.append(number))
    return ran


def test_grid_of_two_parameters_queues_each_combination_once(tmp_path):
    """The 2x2 grid queued by the worker that creates its study, its suggestions and its count of points left; a
    second worker finds the same queue, and one whose sweep file has another grid is refused (the sweep test below
    runs a grid of trial processes, killed and resumed)."""
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path))
    storage = optuna.storages.InMemoryStorage()
    study, created = open_study(sweep, storage, seed=0, wait=1)
    assert created and remaining(study, sweep, None) == 4
    again, created = open_study(sweep, storage, seed=1, wait=1)
    assert not created and len(again.trials) == 4  # the creator's queue, not another
    assert sorted(_in_memory(study, storage, lambda trial: suggest(trial, sweep)[LR])) == [0, 1, 2, 3]
    points = [(t.params[LR], t.params[WD]) for t in study.trials]
    assert sorted(points) == [(0.02, 0.0), (0.02, 0.05), (0.2, 0.0), (0.2, 0.05)]
    assert remaining(study, sweep, None) == 0 and _in_memory(study, storage, lambda trial: 0.0) == []
    other = load_sweep(write_sweep(tmp_path / "other.yaml", tmp_path, parameters={LR: {"values": [0.1]}}))
    with pytest.raises(SystemExit, match=r"study grid2x2 runs the grid .*give the sweep another `name`"):
        open_study(other, storage, seed=0, wait=1)


def test_a_grid_point_killed_between_its_suggestions_is_retried_whole(tmp_path):
    """A sweep killed between a trial's two suggestions leaves that trial failed with one parameter of two; its retry
    (a new number) runs the whole point, and every other point once."""
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path))
    storage = optuna.storages.InMemoryStorage()
    study, _ = open_study(sweep, storage, seed=0, wait=1)

    def killed_after_one(trial):
        trial.suggest_categorical(LR, sweep.grid[LR])
        raise KeyboardInterrupt  # the sweep's death, in the middle of suggest()

    with pytest.raises(KeyboardInterrupt):
        _in_memory(study, storage, killed_after_one)
    assert study.trials[0].state == TrialState.FAIL and list(study.trials[0].params) == [LR]
    assert requeue(study, sole_worker=True) == 1
    ran = _in_memory(study, storage, lambda trial: suggest(trial, sweep)[LR])
    assert sorted(ran) == [1, 2, 3, 4]
    done = [(t.params[LR], t.params[WD]) for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(done) == [(0.02, 0.0), (0.02, 0.05), (0.2, 0.0), (0.2, 0.05)]
    assert study.trials[4].params == {LR: study.trials[0].params[LR], WD: study.trials[4].params[WD]}


@pytest.mark.parametrize("change, key", [
    ({"method": "hillclimb"}, "`method`"),
    ({"metric": {"goal": "maximize"}}, "`metric.name`"),
    ({"parameters": {LR: {"distribution": "lognormal", "min": 0.1, "max": 1.0}}},
     "`parameters.model.optimizer.lr.distribution`"),
    ({"parameters": {LR: {"min": 0.1, "max": 1.0}}}, "`parameters.model.optimizer.lr`"),  # continuous, in a grid
    ({"early_terminate": {"type": "median"}}, "`early_terminate.type`"),
    ({"command": ["imgcls", "validate"]}, "`command`"),
    ({"paramters": {}}, "`paramters`"),
])
def test_invalid_sweep_file_names_the_key(tmp_path, change, key):
    path = write_sweep(tmp_path / "bad.yaml", tmp_path, **change)
    with pytest.raises(SweepFileError, match=key.replace(".", r"\.")):
        load_sweep(path)


def test_misspelt_parameter_path_fails_before_any_trial(tmp_path, digits_root, monkeypatch):
    path = write_sweep(tmp_path / "bad.yaml", digits_root,
                       parameters={"model.lrr": {"values": [0.1, 0.2]}})
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match=r"model\.lrr"):
        sweep_main([str(path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing started


def _trials(db: Path, name: str) -> list:
    if not db.is_file():
        return []
    try:
        return optuna.load_study(study_name=name, storage=f"sqlite:///{db}").get_trials()
    except KeyError:  # the study is not created yet
        return []


def last_scalar(run_dir: Path, tag: str) -> float:
    values = []
    for events in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [(e.wall_time, e.value) for e in acc.Scalars(tag)]
    return max(values)[1]


@pytest.mark.slow
def test_grid_sweep_killed_and_resumed_runs_each_point_once_and_best_yaml_reproduces(tmp_path, digits_root):
    # Three points: one finished before the kill, one cut short by it, one not started yet. (A grid's combinations of
    # two parameters: test_grid_of_two_parameters_runs_each_combination_once.)
    path = write_sweep(tmp_path / "grid.yaml", digits_root, name="grid3", parameters={
        LR: {"values": [0.02, 0.05, 0.2]},
        WD: {"values": [0.05]},
        "trainer.max_epochs": {"value": 1},
    })
    out = tmp_path / "sweep"
    db = out / "sweep.db"
    log = tmp_path / "first_run.log"
    args = ["sweep", str(path), "--out", str(out)]

    # 1. Start the grid sweep and kill it (the whole process group, as Ctrl-C or a job scheduler would) once
    #    the first trial has finished and the second one is running.
    proc = start_cli(*args, log=log)
    try:
        deadline, study = time.monotonic() + 400, None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the sweep ended before it could be interrupted:\n{log.read_text()[-3000:]}"
            # Open the study only once the sweep has created it (two processes creating one fresh SQLite schema at
            # once collide: optuna issue 1092), and only once: an opening costs the sweep's two cores ~80 ms.
            if study is None and "trial(s) to run" in log.read_text():
                study = optuna.load_study(study_name="grid3", storage=f"sqlite:///{db}")
            states = [t.state for t in study.get_trials(deepcopy=False)] if study else []
            if TrialState.COMPLETE in states and TrialState.RUNNING in states:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no trial finished in time:\n{log.read_text()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone when the sweep itself failed
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    first = [t for t in _trials(db, "grid3") if t.state == TrialState.COMPLETE]
    assert len(first) == 1

    # 2. The same command again: the interrupted trial is retried, the finished one is kept.
    resumed = run_cli(*args)
    trials = _trials(db, "grid3")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    points = {(t.params[LR], t.params[WD]) for t in done}
    assert points == {(0.02, 0.05), (0.05, 0.05), (0.2, 0.05)}
    assert len(done) == 3, "a finished grid point was run twice"
    kept = next(t for t in done if t.number == first[0].number)
    assert kept.datetime_complete == first[0].datetime_complete and kept.value == first[0].value
    assert [t.state for t in trials].count(TrialState.FAIL) == 1  # the killed trial, retried under a new number
    for t in done:
        assert set(t.intermediate_values) == {0}  # each epoch's val/acc, reported by the trial process
        run_dir = Path(t.user_attrs["run_dir"])
        assert (run_dir / "config.yaml").is_file() and list((run_dir / "checkpoints").glob("*.ckpt"))
        # The trial process parses its command line as `imgcls fit` does (no warning of Lightning's that it got both
        # a command line and `args`).
        assert "args parameter" not in (run_dir / "fit.log").read_text()
    assert "val/acc (maximize)" in resumed.stdout

    # 3. best.yaml reruns the best trial and gets its metric back.
    best = optuna.load_study(study_name="grid3", storage=f"sqlite:///{db}").best_trial
    assert f"trial {best.number}," in (out / "best.yaml").read_text().splitlines()[0]
    run_cli("fit", "--config", str(out / "best.yaml"))
    assert last_scalar(out / "best", "val/acc") == pytest.approx(best.value, abs=1e-6)


@pytest.mark.slow
def test_two_workers_run_two_trials_at_once_in_one_wandb_group(tmp_path, digits_root):
    path = write_sweep(tmp_path / "random.yaml", digits_root, name="random2", method="random", run_cap=2,
                       parameters={LR: {"distribution": "log_uniform_values", "min": 0.005, "max": 0.05},
                                   "trainer.max_epochs": {"value": 1}},
                       early_terminate={"type": "hyperband", "min_iter": 1, "eta": 3},
                       command=sweep_command(digits_root, CONFIGS / "loggers" / "wandb.yaml"))
    out = tmp_path / "sweep"
    env = wandb_offline_env()
    proc = run_cli("sweep", str(path), "--out", str(out), "--workers", "2", "--seed", "0", env=env)
    trials = _trials(out / "sweep.db", "random2")
    assert len(trials) == 2 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = trials
    assert max(first.datetime_start, second.datetime_start) < min(first.datetime_complete, second.datetime_complete)
    for t in trials:  # each trial's offline W&B run, in the sweep's group
        assert wandb_run_record(Path(t.user_attrs["run_dir"]))["run_group"] == "random2"


def _fake_trials(monkeypatch, prune: str = "") -> None:
    """Trials run by tests/sweep_fake_trial.py (no training: the sweep is handed FAKE_TRIAL) and a sweep file taken
    as parsed."""
    # `imgcls fit --print_config` takes seconds
    monkeypatch.setattr("training.sweeps.command.check_keys", lambda sweep: None)
    monkeypatch.setenv("FAKE_TRIAL_PRUNE", prune)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_run_cap_holds_across_two_sweeps_sharing_one_storage(tmp_path, monkeypatch, kind):
    """Two sweeps on one study (two folders, as on two machines) stop at run_cap trials between them, not at run_cap
    each: before each new trial a sweep counts the study's finished and running ones, under the storage file's lock
    with its ask, so neither goes over."""
    path = write_sweep(tmp_path / "random.yaml", tmp_path, name="capped", method="random", run_cap=3,
                       parameters={LR: {"min": 0.01, "max": 0.1}})
    both_started = threading.Barrier(2, timeout=120)

    def trial_in_memory(trial, sweep, out, url, launcher):
        if trial.number < 2:
            both_started.wait()  # each sweep has counted the trials it has to run before either finishes one
        return suggest(trial, sweep)[LR]

    monkeypatch.setattr("training.sweeps.command.check_keys", lambda sweep: None)
    monkeypatch.setattr("training.sweeps.command.run_trial", trial_in_memory)
    monkeypatch.setattr("training.sweeps.command.write_best", lambda study, sweep, out: None)  # no run folders here
    url = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else f"journal:///{tmp_path / 'shared.journal'}"
    with ThreadPoolExecutor(2) as pool:
        sweeps = [pool.submit(sweep_main, [str(path), "--out", str(tmp_path / f"sweep{i}"),
                                           "--storage", url, "--seed", str(i)]) for i in range(2)]
        for sweep in sweeps:
            sweep.result()
    trials = optuna.load_study(study_name="capped", storage=open_storage(url)).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3


def test_grid_worker_waits_for_a_dead_workers_trial_and_retries_it_once(tmp_path, monkeypatch, capsys):
    """A trial whose worker stopped sending heartbeats holds one grid point: the sweep runs the other points, waits
    instead of repeating that one, fails it once its heartbeat is --grace old, and runs its retry; one line says so.
    SQLite in one process here (tests/test_sweep_postgres.py: two worker processes on PostgreSQL, one killed)."""
    path = write_sweep(tmp_path / "grid.yaml", tmp_path, name="dead")
    sweep, url, out = load_sweep(path), f"sqlite:///{tmp_path / 'shared.db'}", tmp_path / "sweep"

    def trial_in_memory(trial, sweep, out, url, launcher):
        params = suggest(trial, sweep)
        trial.set_user_attr("run_dir", str(out / f"trial_{trial.number:04d}"))
        trial.set_user_attr("config", yaml.safe_dump(params))
        return params[LR] + params[WD]

    monkeypatch.setattr("training.sweeps.command.check_keys", lambda sweep: None)
    monkeypatch.setattr("training.sweeps.command.run_trial", trial_in_memory)
    # The dead worker: it created the study, took trial 0's point and sent one heartbeat. It shares the file, as a
    # live sweep holds its lock shared: this sweep is not alone there, so only the heartbeat tells that trial 0 is dead.
    storage = open_storage(url, heartbeat_interval=1, grace_period=2)
    study, _ = open_study(sweep, storage, seed=0, wait=1)
    dead, dead_id = take(study, storage, url, fresh=lambda: False)
    suggest(dead, sweep)
    dead.set_user_attr("worker", "host-a pid 99")
    storage.record_heartbeat(dead_id)
    with open(tmp_path / ".shared.db.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        sweep_main([str(path), "--out", str(out), "--storage", url, "--heartbeat", "1", "--grace", "2"])
    trials = optuna.load_study(study_name="dead", storage=url).trials
    assert [t.state for t in trials] == [TrialState.FAIL] + [TrialState.COMPLETE] * 4
    done = sorted((t.params[LR], t.params[WD]) for t in trials[1:])
    assert done == [(0.02, 0.0), (0.02, 0.05), (0.2, 0.0), (0.2, 0.05)]  # each point once, trial 0's by its retry
    assert trials[4].params == dead.params and trials[4].system_attrs["failed_trial"] == 0
    printed = capsys.readouterr().out
    assert f"trial 0 ({LR}={dead.params[LR]}, {WD}={dead.params[WD]}) is retried as trial 4: its worker (host-a " \
           "pid 99) sent no heartbeat for 2 s\n" in printed


def test_journal_storage_serves_two_trial_processes_at_once(tmp_path, monkeypatch):
    """--workers 2 on a journal file: two trial processes report into it at the same time, one of them is pruned,
    and the sweep reads each outcome back; run_cap ends it."""
    path = write_sweep(tmp_path / "random.yaml", tmp_path, name="journal2", method="random", run_cap=3,
                       parameters={LR: {"distribution": "log_uniform_values", "min": 0.005, "max": 0.05}},
                       early_terminate={"type": "hyperband", "min_iter": 1, "eta": 3})
    _fake_trials(monkeypatch, prune="1")
    monkeypatch.setenv("FAKE_TRIAL_MEET", "2")  # the first two overlap however slowly the processes start
    url, out = f"journal:///{tmp_path / 'sweep.journal'}", tmp_path / "sweep"
    sweep([str(path), "--out", str(out), "--workers", "2", "--seed", "0", "--storage", url],
          launcher=FAKE_TRIAL)
    trials = optuna.load_study(study_name="journal2", storage=open_storage(url)).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.COMPLETE]
    first, second = trials[:2]
    assert max(first.datetime_start, second.datetime_start) < min(first.datetime_complete, second.datetime_complete)
    for t in trials:  # val/acc = lr * epoch in the fake trial; a pruned trial's value is its last report
        lr, epochs = t.params[LR], 1 if t.state == TrialState.PRUNED else 2
        assert t.intermediate_values == pytest.approx({e: lr * (e + 1) for e in range(epochs)})
        assert t.value == pytest.approx(lr * epochs)
    assert not (out / "sweep.db").exists()
    # Optuna's best trial is the best finished one; a pruned trial's last report does not compete (which trial draws
    # which lr depends on how the two workers' asks interleave).
    best = max((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert f"trial {best.number}," in (out / "best.yaml").read_text().splitlines()[0]


def test_sweep_settings_printed_to_a_file_run_the_same_sweep(tmp_path, monkeypatch, capsys):
    """`imgcls sweep FILE OPTIONS --print_config` writes a YAML from which `imgcls sweep --config` alone runs the
    sweep those options run: the same trials (the seeded sampler's parameters, their outcomes)."""
    path = write_sweep(tmp_path / "random.yaml", tmp_path, name="settings", method="random", run_cap=5,
                       parameters={LR: {"min": 0.01, "max": 0.1}})
    _fake_trials(monkeypatch)
    monkeypatch.delenv(STORAGE_ENV_VAR, raising=False)
    options = ["--trials", "2", "--seed", "3", "--heartbeat", "5", "--grace", "60"]
    with pytest.raises(SystemExit) as exit_info:
        sweep([str(path), "--out", str(tmp_path / "from_file"), *options, "--print_config"], launcher=FAKE_TRIAL)
    assert exit_info.value.code == 0 and not (tmp_path / "from_file").exists()
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed) == {"sweep_file": str(path), "out": str(tmp_path / "from_file"), "storage": None,
                                       "workers": 1, "trials": 2, "seed": 3, "heartbeat": 5, "grace": 60}
    (tmp_path / "sweep.yaml").write_text(printed)
    sweep(["--config", str(tmp_path / "sweep.yaml")], launcher=FAKE_TRIAL)
    sweep([str(path), "--out", str(tmp_path / "from_options"), *options], launcher=FAKE_TRIAL)
    ran = [[(t.params, t.state, t.value) for t in _trials(tmp_path / name / "sweep.db", "settings")]
           for name in ("from_file", "from_options")]
    assert len(ran[0]) == 2 and ran[0] == ran[1], ran


def test_trial_callback_leaves_what_the_sweep_reads(tmp_path, monkeypatch):
    """The callback inside a trial process, on a journal file and driven by a stand-in Trainer: each epoch's metric,
    the pruning flag (cleared first: a retry inherits its predecessor's), and the final metrics (the newest
    validation's, the best checkpoint's validation's at the fit's end, a closing validation's), and the step the fit
    started from; what tests/sweep_fake_trial.py stands in for."""
    url = f"journal:///{tmp_path / 'sweep.journal'}"
    study = optuna.create_study(study_name="one", storage=open_storage(url), direction="maximize")
    trial = study.ask()
    spec = {"storage": url, "study": "one", "trial_number": trial.number, "metric": "val/acc", "hyperband": None}
    trial.storage.set_trial_system_attr(open_trial(spec)[1], PRUNED_KEY, True)  # as copied from a pruned predecessor
    monkeypatch.setenv(TRIAL_ENV_VAR, json.dumps(spec))
    asked = []  # the pruner stops the trial at its second epoch
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: asked.append(self.number) or len(asked) == 2)
    callback = trial_callback()
    trainer = SimpleNamespace(is_global_zero=True, sanity_checking=False, should_stop=False, callback_metrics={},
                              state=SimpleNamespace(fn="fit"), strategy=SimpleNamespace(broadcast=lambda x: x))
    callback.on_fit_start(trainer, None)
    assert study.trials[0].system_attrs[PRUNED_KEY] is False
    trainer.global_step = 12  # restored from a checkpoint before the training starts: what a retry continued from
    callback.on_train_start(trainer, None)
    assert study.trials[0].user_attrs["start_step"] == 12
    for epoch in range(3):
        trainer.callback_metrics = {"val/acc": torch.tensor(0.25 * (epoch + 1)), "val/loss": torch.tensor(1.0)}
        callback.on_validation_end(trainer, SimpleNamespace(current_epoch=epoch))
        if trainer.should_stop:
            break
    assert study.trials[0].user_attrs["final_metrics"] == {"val/acc": 0.5, "val/loss": 1.0}  # the newest
    # The fit's end: the best checkpoint's weights were validated at epoch 0, whose metrics its callback kept.
    trainer.checkpoint_callback = ModelCheckpoint(monitor="val/acc", mode="max")
    trainer.checkpoint_callback.best_model_path = "epoch0.ckpt"
    trainer.checkpoint_callback.validated = {"epoch0.ckpt": {"step": 4, "metrics": {"val/acc": 0.25, "val/loss": 2.0}}}
    callback.on_fit_end(trainer, None)
    assert study.trials[0].user_attrs["final_metrics"] == {"val/acc": 0.25, "val/loss": 2.0}
    trainer.state.fn = "validate"  # a closing validation of the best file, where its validation was not known
    trainer.callback_metrics = {"val/acc": torch.tensor(0.75)}
    callback.on_validation_end(trainer, None)
    left = study.trials[0]
    assert left.intermediate_values == {0: 0.25, 1: 0.5} and trainer.should_stop
    assert (left.system_attrs[PRUNED_KEY], left.system_attrs[EPOCH_KEY]) == (True, 1)
    assert left.user_attrs["final_metrics"] == {"val/acc": 0.75}


# A sweep worker's part, in a process of its own: run_trial with argv[3] as the interpreter it starts.
WORKER = """
import sys
from pathlib import Path
import optuna
from training.sweeps.space import load_sweep
from training.sweeps.trial import run_trial
sys.executable = sys.argv[3]
run_trial(optuna.create_study().ask(), load_sweep(sys.argv[1]), Path(sys.argv[2]), "sqlite:///unused.db",
          ("-m", "imgcls.trial"))
"""


def test_a_trial_process_dies_with_its_sweep_worker(tmp_path):
    """A worker killed by SIGKILL takes its trial's process along (PR_SET_PDEATHSIG), instead of leaving it to train
    on for nobody: the trial's "interpreter" here writes its pid and sleeps a minute."""
    pid_file = tmp_path / "trial.pid"
    sleeper = tmp_path / "python"
    sleeper.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    sleeper.chmod(0o755)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(write_sweep(tmp_path / "s.yaml", tmp_path)),
                               str(tmp_path / "out"), str(sleeper)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text().strip()):
            assert worker.poll() is None and time.monotonic() < deadline, "the trial process did not start"
            time.sleep(0.05)
        trial = int(pid_file.read_text())
        worker.kill()
        worker.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{trial}").exists() and "State:\tZ" not in _status(trial):
            assert time.monotonic() < deadline, "the trial process outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait(10)


def _status(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/status").read_text()
    return "State:\tZ"  # gone between the two looks


def workers_started_together(tmp_path: Path, monkeypatch, url: str, *, workers: int, points: list[float]) -> list:
    """`workers` sweeps of one grid on the storage `url` (threads of this process, each with its own storage
    connections and folder, as on as many machines), released at the same instant once each has parsed its sweep
    file; their trials run in memory for a second. The study's trials once they have all ended."""
    path = write_sweep(tmp_path / "grid.yaml", tmp_path, name="together",
                       parameters={LR: {"values": points}, "trainer.max_epochs": {"value": 1}})
    together = threading.Barrier(workers, timeout=120)
    connect = command.connect

    def connect_together(*args, **kwargs):
        together.wait()
        return connect(*args, **kwargs)

    def trial_in_memory(trial, sweep, out, url, launcher):
        params = suggest(trial, sweep)
        trial.set_user_attr("run_dir", str(out / f"trial_{trial.number:04d}"))
        trial.set_user_attr("config", yaml.safe_dump(params))
        time.sleep(1)  # the others ask while it runs
        return params[LR]

    monkeypatch.setattr("training.sweeps.command.check_keys", lambda sweep: None)
    monkeypatch.setattr("training.sweeps.command.connect", connect_together)
    monkeypatch.setattr("training.sweeps.command.run_trial", trial_in_memory)
    with ThreadPoolExecutor(workers) as pool:
        sweeps = [pool.submit(sweep_main, [str(path), "--out", str(tmp_path / f"worker{i}"), "--storage",
                                           url, "--heartbeat", "1", "--grace", "30"]) for i in range(workers)]
        for done in sweeps:
            done.result()
    return optuna.load_study(study_name="together", storage=open_storage(url)).trials


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
@pytest.mark.parametrize("points", [[0.02], [0.02, 0.2]])
def test_workers_started_together_run_each_grid_point_once(tmp_path, monkeypatch, kind, points):
    """Workers that ask at the same instant each take a different point of the grid's queue, or none: no point runs
    twice, and no trial is asked beyond the grid (tests/test_sweep_postgres.py: the same on PostgreSQL)."""
    url = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else f"journal:///{tmp_path / 'shared.journal'}"
    trials = workers_started_together(tmp_path, monkeypatch, url, workers=4, points=points)
    assert sorted(t.params[LR] for t in trials) == points, [(t.number, t.state, t.params) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_a_sweep_prints_a_line_per_finished_trial(tmp_path, monkeypatch, capsys):
    """Each finished trial's line: its outcome and value, the best so far, the trials done and left, its time and the
    mean time per trial, as the study recorded them; on stdout that is no terminal, no progress bar."""
    path = write_sweep(tmp_path / "grid.yaml", tmp_path, name="progress",
                       parameters={LR: {"values": [0.01, 0.02, 0.04]}, "trainer.max_epochs": {"value": 1}})
    _fake_trials(monkeypatch, prune="1")
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    sweep([str(path), "--out", str(tmp_path / "sweep"), "--storage", url], launcher=FAKE_TRIAL)
    trials = optuna.load_study(study_name="progress", storage=url).trials
    took = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trial ")]
    mean = [seconds(sum(took[:n + 1]) / (n + 1)) for n in range(3)]
    assert lines == [
        f"trial 0 complete: val/acc 0.0200 | best 0.0200 (trial 0) | 1 of 3 done, 2 left | {seconds(took[0])}, "
        f"{mean[0]} per trial",
        f"trial 1 pruned: val/acc 0.0200 (its last report) | best 0.0200 (trial 0) | 2 of 3 done, 1 left | "
        f"{seconds(took[1])}, {mean[1]} per trial",
        f"trial 2 complete: val/acc 0.0800 | best 0.0800 (trial 2) | 3 of 3 done, 0 left | {seconds(took[2])}, "
        f"{mean[2]} per trial",
    ]


def test_a_failed_trials_line_says_why_and_a_terminal_shows_a_bar(tmp_path):
    """A failed trial's line names its failure and leaves the count done; on a terminal the same line stands above
    rich's bar of the trials done."""
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", tmp_path, method="random", run_cap=4, metric={
        "name": "val/loss", "goal": "minimize"}, parameters={LR: {"min": 0.01, "max": 0.1}}))
    study = optuna.create_study(direction="minimize")
    space = {LR: optuna.distributions.FloatDistribution(0.01, 0.1)}
    for value in (0.5, 0.25):
        study.add_trial(create_trial(params={LR: 0.05}, distributions=space, value=value))
    study.add_trial(create_trial(params={LR: 0.05}, distributions=space, state=TrialState.FAIL))
    screen = io.StringIO()
    with SweepProgress(study, sweep, total=4, console=Console(file=screen, force_terminal=True, width=80)) as bar:
        bar.finished(2, "trial 2 exited with 1; see trial_0002/fit.log")
    shown = screen.getvalue()
    assert ("trial 2 failed (trial 2 exited with 1; see trial_0002/fit.log) | best 0.2500 (trial 1) | 2 of 4 done, "
            "2 left | 0 s, 0 s per trial") in shown
    assert "sweep grid2x2" in shown and "2/4" in shown and "━" in shown  # rich's bar and its count



@pytest.mark.slow
def test_a_dead_workers_trial_is_continued_by_its_retry_to_the_same_weights(tmp_path, digits_root):
    """Worker a is killed (SIGKILL) in the middle of a trial; its trial's process, sent SIGTERM by that death, saves
    preempted.ckpt and exits. Worker b, on the same SQLite study, fails the trial once its heartbeat is --grace old
    and retries it in a's trial folder from that checkpoint (one line says so): past step 0, to the same final
    weights, bitwise, and the same curve as an uninterrupted trial of the same point."""
    # fp32, deterministic kernels, a step checkpoint every 2 steps; no auto_resume of its own: the retry asks for it
    config = tmp_path / "exact.yaml"
    config.write_text(yaml.safe_dump({**resume_config(every_n_train_steps=2), "auto_resume": False}))
    command = ["${env}", "${interpreter}", "-m", "imgcls", "fit", "--config", str(config), "--data.root",
               str(digits_root), "--data.batch_size", "16", "--trainer.limit_train_batches", "5",
               "--trainer.limit_val_batches", "2", "${args}"]
    # a's trial sleeps at the end of step 7, after step 6's checkpoint: its worker is killed while it surely runs
    pause = ["--trainer.callbacks+=tests.fault_injection.SleepAt", "--trainer.callbacks.step", "7",
             "--trainer.callbacks.seconds", "5"]
    files = {name: write_sweep(tmp_path / f"{name}.yaml", digits_root, name=study,
                               parameters={LR: {"values": [0.02]}, "trainer.max_epochs": {"value": 3}},
                               command=command[:-1] + pause + command[-1:] if name == "a" else command)
             for name, study in (("a", "continued"), ("b", "continued"), ("reference", "reference"))}
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    logs = {name: tmp_path / f"worker_{name}.log" for name in "ab"}

    def start(name: str):
        return start_cli("sweep", str(files[name]), "--out", str(tmp_path / name), "--storage", url,
                         "--heartbeat", "1", "--grace", "5", log=logs[name])

    def show() -> str:
        return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs.values() if log.is_file())

    first = tmp_path / "a" / "trial_0000"
    workers = {"a": start("a")}
    try:
        wait_until("a's trial at step 6", (first / "checkpoints" / "step0000006.ckpt").is_file, 300, show)
        os.kill(workers["a"].pid, signal.SIGKILL)
        workers["a"].wait(timeout=30)
        # The trial's process ends as a preempted one does, its worker gone (b starts after it: one writer)
        preempted = first / "checkpoints" / "preempted.ckpt"
        wait_until("the trial's preempted.ckpt", lambda: f"SIGTERM received: saved {preempted} at step" in (
            first / "fit.log").read_text(), 60, lambda: show() + (first / "fit.log").read_text()[-3000:])
        workers["b"] = start("b")
        assert workers["b"].wait(timeout=300) == 0, show()
    finally:
        for worker in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    saved_at = torch.load(preempted, weights_only=True, map_location="cpu", mmap=True)["global_step"]
    dead, retry = optuna.load_study(study_name="continued", storage=url).trials
    assert (dead.state, retry.state, retry.system_attrs["failed_trial"]) == (TrialState.FAIL, TrialState.COMPLETE, 0)
    assert retry.user_attrs["run_dir"] == dead.user_attrs["run_dir"] == str(first)
    assert retry.user_attrs["start_step"] == saved_at >= 7, (saved_at, retry.user_attrs)  # step 7 paused
    said = f"trial 1 retries trial 0: it continues that fit in {first} from step {saved_at} (preempted.ckpt)"
    assert said in logs["b"].read_text().splitlines() and said in (first / "fit.log").read_text()
    assert f"resuming from {preempted} (auto_resume)" in (first / "fit.log").read_text()

    run_cli("sweep", str(files["reference"]), "--out", str(tmp_path / "reference"))
    (reference,) = optuna.load_study(study_name="reference",
                                     storage=f"sqlite:///{tmp_path / 'reference' / 'sweep.db'}").trials
    assert retry.intermediate_values == reference.intermediate_values and set(retry.intermediate_values) == {0, 1, 2}
    assert retry.value == reference.value
    continued, uninterrupted = last_weights(first), last_weights(Path(reference.user_attrs["run_dir"]))
    assert continued.keys() == uninterrupted.keys()
    assert all(torch.equal(continued[k], uninterrupted[k]) for k in continued), "the continued trial's weights differ"


def test_a_retry_continues_its_trials_folder_only_where_it_can(tmp_path):
    """What a retry's fit continues: the retried trial's folder when this machine sees it and it holds an intact
    checkpoint of an unfinished fit (auto_resume then picks that checkpoint); else a fresh folder from step 0, one
    line saying why."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize")
    space = {LR: CategoricalDistribution([0.02])}

    def folder(name: str, *, step: int | None = None, max_epochs: int = 3) -> Path:
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": max_epochs, "max_steps": -1}}))
        if step is not None:  # what a checkpoint says of its run, read without its weights
            torch.save({"global_step": step, "state_dict": {"w": torch.zeros(1)},
                        "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": step // 5}}}}},
                       run / "checkpoints" / f"step{step:07d}.ckpt")
        return run

    runs = {"gone": tmp_path / "other_machine" / "trial_0000", "empty": folder("empty"),
            "running": folder("running", step=8), "finished": folder("finished", step=15, max_epochs=3)}
    for run in runs.values():
        study.add_trial(create_trial(params={LR: 0.02}, distributions=space, state=TrialState.FAIL,
                                     user_attrs={"run_dir": str(run)}))
    study.add_trial(create_trial(state=TrialState.WAITING))  # a grid point never run: no retry
    assert requeue(study, sole_worker=False) == 4
    said = {}
    while (taken := take(study, storage, "postgresql://in-memory", fresh=lambda: False)) is not None:
        said[taken[0].number] = continued_run(taken[0])
    host = socket.gethostname()
    assert said == {
        4: (None, ""),
        5: (None, f"trial 5 retries trial 0 from step 0: its run folder {runs['gone']} is not on this machine "
                  f"({host}), which sees no shared file system there"),
        6: (None, f"trial 6 retries trial 1 from step 0: {runs['empty']} holds no intact checkpoint"),
        7: (runs["running"], f"trial 7 retries trial 2: it continues that fit in {runs['running']} from step 8 "
                             "(step0000008.ckpt)"),
        8: (None, f"trial 8 retries trial 3 from step 0: its fit in {runs['finished']} had finished (max_epochs=3 "
                  "reached)"),
    }
