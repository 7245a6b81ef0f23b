"""Sweeps across machines on a real PostgreSQL server (tests/postgres.py: Debian's packages, installed with apt-get
where missing): two `imgcls sweep` workers share a grid, one is killed with SIGKILL in the middle of a trial, and the
other retries that trial once its heartbeat is stale; the sweep's dashboard lists a study's trials.

Skipped, naming why, where no server can be installed (no root and none installed, no apt-get, no network nor
cached packages); under CI=true that fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.helpers import (
    CONFIGS,
    ROOT,
    concurrent_python,
    free_port,
    run_cli,
    service_unavailable,
    start_cli,
    wait_until,
    wandb_offline_env,
)
from tests.postgres import Unavailable, ensure_installed, throwaway_server
from tests.test_sweep import LR, WD, last_scalar, sweep_command, workers_started_together, write_sweep

HEARTBEAT, GRACE = 1, 5  # seconds: `imgcls sweep --heartbeat --grace`, shortened from the defaults in command.py


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A PostgreSQL server for this file's tests; each test creates its own database on it."""
    ensure_installed()
    try:
        with throwaway_server(tmp_path_factory.mktemp("postgres")) as server:
            yield server
    except Unavailable as err:
        service_unavailable(str(err))


def _start_worker(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as sink:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)



def _files_holding(secret: str, *paths: Path) -> list[Path]:
    """Those of the files, and of the files in the folders, that hold `secret`."""
    files = [f for path in paths for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file()]
    assert files, "no file to search"
    return [f for f in files if secret.encode() in f.read_bytes()]


@pytest.mark.slow
def test_two_workers_share_a_grid_and_a_killed_workers_trial_is_retried_once(tmp_path, digits_root, postgres):
    url = postgres.database("grid")
    path = write_sweep(tmp_path / "grid.yaml", digits_root, name="shared",
                       command=sweep_command(digits_root, CONFIGS / "loggers" / "wandb.yaml"))
    roots = {name: tmp_path / f"machine_{name}" for name in "ab"}  # one run root per machine
    # The URL, password included, reaches the workers as the docs say: through the environment, not the command line.
    env = wandb_offline_env(IMGCLS_SWEEP_STORAGE=url)
    logs = {name: tmp_path / f"worker_{name}.log" for name in roots}

    def args(name: str) -> list[str]:
        return ["sweep", str(path), "--out", str(roots[name]), "--heartbeat", str(HEARTBEAT),
                "--grace", str(GRACE)]

    # Both workers and their trials are forked by the preloaded server. Worker a is a command of its own: its pid, in
    # a session of its own, is the one the retry names, and its trials' processes (the launchers that stand in for
    # them, whose forked trial dies with them) are its children, which die with it alone (PR_SET_PDEATHSIG; a trial
    # here is too short to tell that from its end: tests/test_sweep.py checks it with one that would sleep a minute).
    # Worker b joins once a has finished a trial, and takes the grid's next points while a runs its second.
    workers = {"a": start_cli(*args("a"), log=logs["a"], env=env)}
    study = None

    def show() -> str:
        return "\n".join(f"--- worker {n}:\n{logs[n].read_text()[-3000:]}" for n in workers)

    def trials_of(name: str, *states: TrialState) -> list:
        return [t for t in study.get_trials(deepcopy=False, states=states)
                if t.user_attrs.get("run_dir", "").startswith(str(roots[name]))]

    try:
        study = wait_until("the study", lambda: _load(url), 120, show)
        wait_until("worker a's first trial", lambda: trials_of("a", TrialState.COMPLETE), 240, show)
        workers["b"] = _start_worker([concurrent_python(), "-m", "imgcls", *args("b")], env, logs["b"])
        # Worker a has finished a trial, and the fit of its next one runs (it has written its config.yaml)
        # when it is killed; that trial process dies with it.
        running = wait_until("worker a in its second trial",
                            lambda: trials_of("a", TrialState.COMPLETE) and [
                                t for t in trials_of("a", TrialState.RUNNING) if _started(t)], 240, show)[0]
        assert workers["a"].poll() is None, show()
        os.kill(workers["a"].pid, signal.SIGKILL)
        workers["a"].wait(timeout=30)
        wait_until("worker a's trial process to die with it", lambda: not _live_processes(workers["a"].pid), 30, show)
        # Machine a is gone: its disk is out of b's reach at once (b retries a's trial once its heartbeat is --grace
        # old), and what it wrote is searched for the password.
        gone = roots["a"].rename(tmp_path / "machine_a_gone")
        assert list(gone.rglob("*.wandb")), "no W&B run to search"
        leaked = _files_holding(postgres.password, gone, logs["a"])
        assert not leaked
        shutil.rmtree(gone)
        assert workers["b"].wait(timeout=300) == 0, show()
    finally:
        for worker in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    out = logs["b"].read_text()
    trials = study.get_trials(deepcopy=False)

    # Every point complete once; the killed trial failed by b, and retried by b under a new number.
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    points = [(t.params[LR], t.params[WD]) for t in done]
    assert sorted(points) == [(0.02, 0.0), (0.02, 0.05), (0.2, 0.0), (0.2, 0.05)], show()
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert [t.number for t in failed] == [running.number] and len(trials) == 5, [(t.number, t.state) for t in trials]
    retry = next(t for t in done if t.system_attrs.get("failed_trial") == running.number)
    assert retry.params == running.params and retry.user_attrs["run_dir"].startswith(str(roots["b"]))
    assert trials_of("a", TrialState.COMPLETE) and trials_of("b", TrialState.COMPLETE)  # the trials were split
    announced = [line for line in out.splitlines() if line.startswith(f"trial {running.number} ")]
    assert len(announced) == 1 and re.fullmatch(
        rf"trial {running.number} \(.*\) is retried as trial {retry.number}: its worker \(\S+ pid "
        rf"{workers['a'].pid}\) sent no heartbeat for {GRACE} s", announced[0]), out[-3000:]
    # The retry cannot continue a's trial folder, on a's disk: it starts over in b's, and says why.
    assert (f"trial {retry.number} retries trial {running.number} from step 0: its run folder "
            f"{running.user_attrs['run_dir']} is not on this machine") in out, out[-3000:]

    # b's best.yaml reruns the best trial, also one that ran on a (the study holds its config), and gets its metric.
    best = study.best_trial
    assert f"trial {best.number}," in (roots["b"] / "best.yaml").read_text().splitlines()[0]
    run_cli("fit", "--config", str(roots["b"] / "best.yaml"), env=wandb_offline_env())
    assert last_scalar(roots["b"] / "best", "val/acc") == pytest.approx(best.value, abs=1e-6)

    # Nor in b's files (logs, config.yaml, W&B runs), its printed lines, or the trials' records in the study.
    assert list(roots["b"].rglob("*.wandb")), "no W&B run to search"
    leaked = _files_holding(postgres.password, roots["b"], logs["b"])
    assert not leaked
    assert postgres.password not in json.dumps([t.user_attrs for t in trials])


def _live_processes(group: int) -> list[int]:
    """The processes of a process group that are not zombies (a dead worker's orphans wait to be reaped), read from
    /proc/PID/stat: its state is the field after the command's closing parenthesis, the group two after it."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
            if int(pgrp) == group and state != "Z":
                found.append(int(stat.parent.name))
    return found


def _started(trial) -> bool:
    """The trial's `imgcls fit` runs: it has parsed its command line and written the run's config.yaml (its printed
    lines may still sit in its stdout's buffer)."""
    return (Path(trial.user_attrs.get("run_dir", "/nonexistent")) / "config.yaml").is_file()


def _load(url: str):
    with contextlib.suppress(KeyError):  # not created yet
        return optuna.load_study(study_name="shared", storage=url)
    return None


@pytest.mark.parametrize("points", [[0.02], [0.02, 0.2]])
def test_workers_started_together_run_each_grid_point_once(tmp_path, monkeypatch, postgres, points):
    """Four workers on one PostgreSQL database, released at the same instant, each take a different point of the
    grid's queue or none (the row lock of the take): no point runs twice, and no trial is asked beyond the grid."""
    url = postgres.database(f"together{len(points)}")
    trials = workers_started_together(tmp_path, monkeypatch, url, workers=4, points=points)
    assert sorted(t.params[LR] for t in trials) == points, [(t.number, t.state, t.params) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_sweep_dashboard_lists_the_studys_trials(tmp_path, postgres):
    """`make sweep-dashboard STORAGE=<url>` serves optuna-dashboard on the sweep's database; its JSON API lists the
    study's trials, and the password appears in no line it prints."""
    url = postgres.database("dashboard")
    study = optuna.create_study(study_name="lr_sweep", storage=url, direction="maximize")

    def objective(trial):  # one trial of each state a sweep's table shows
        lr = trial.suggest_float(LR, 0.001, 0.1, log=True)
        if trial.number == 1:
            raise optuna.TrialPruned()
        if trial.number == 2:
            raise RuntimeError("the trial's fit failed")
        return lr

    study.optimize(objective, n_trials=3, catch=(RuntimeError,))
    port = free_port()
    log = tmp_path / "dashboard.log"
    # STAMP= : the venv of this interpreter is installed already.
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), "sweep-dashboard", f"STORAGE={url}", f"PORT={port}",
           "STAMP=", f"BIN={Path(sys.executable).parent}"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def studies():
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as response:
                    return json.load(response)["study_summaries"]
            assert proc.poll() is None, log.read_text()

        listed = wait_until("the dashboard", studies, 60, log.read_text)
        study_id = next(s["study_id"] for s in listed if s["study_name"] == "lr_sweep")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{study_id}", timeout=10) as response:
            shown = json.load(response)["trials"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert [(t["number"], t["state"]) for t in shown] == [(0, "Complete"), (1, "Pruned"), (2, "Fail")]
    assert [t["params"][0]["param_internal_value"] for t in shown] == [t.params[LR] for t in study.trials]
    assert "127.0.0.1" in log.read_text() and postgres.password not in log.read_text()
