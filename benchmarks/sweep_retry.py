"""Sweep retry: the time from a sweep worker's death to the start of its trial's retry on another worker, two
`imgcls sweep` processes on one PostgreSQL database (tests/postgres.py: a throwaway server of the installed
Debian packages; skipped where there is none).

    python -m benchmarks.run --only sweep_retry [--quick]

A one-point grid of the quickstart shrunk to seconds an epoch (resnet18 at 32 px on the demo digits), more epochs
than the measurement lasts. One worker takes the point; once its trial runs, a second starts, finds the point taken
and waits.
Once the trial's process runs, its worker is killed with SIGKILL (the trial process dies with it); the other fails
the trial once its last heartbeat is `--grace` old, and starts its retry; then it is stopped. Measured from the kill
to the trial's failure and to the retry's start (the times Optuna records). Full mode: `imgcls sweep`'s default
heartbeat and grace period, 3 times; quick: 1 s and 5 s (a busy machine may delay a heartbeat by seconds), once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import table
from datamodules.demo import build_demo_data
from tests.helpers import TINY, cli_env
from tests.postgres import Unavailable, throwaway_server
from training.sweeps.command import GRACE, HEARTBEAT

TITLE = "Sweep retry after a worker's death"
ROOT = Path(__file__).resolve().parents[1]
LR = "model.optimizer.lr"


def _sweep_file(folder: Path, digits: Path) -> Path:
    spec = {"name": "retry", "method": "grid", "metric": {"name": "val/acc", "goal": "maximize"},
            "parameters": {LR: {"values": [0.02]}, "trainer.max_epochs": {"value": 1000}},
            "command": ["${env}", "${interpreter}", "-m", "imgcls", "fit", "--config", "configs/quickstart.yaml",
                        *TINY, "--data.root", str(digits), "--trainer.limit_train_batches", "3",
                        "--trainer.limit_val_batches", "2", "${args}"]}
    path = folder / "retry.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _until(what: str, ready, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)
    return found


def last_lines(folder: Path, n: int = 15) -> str:
    """The last `n` lines of each worker's log and each trial's fit.log in `folder`, each under its path."""
    logs = [*sorted(folder.glob("worker_*.log")), *sorted(folder.glob("*/trial_*/fit.log"))]
    return "\n".join(f"--- {log.relative_to(folder)}:\n" + "\n".join(log.read_text().splitlines()[-n:])
                     for log in logs)


def one_death(url: str, folder: Path, sweep: Path, heartbeat: int, grace: int) -> dict:
    """One worker takes the point, a second starts once its trial runs and waits; the first is killed. The seconds
    from the kill to the trial's failure and to its retry's start."""
    import optuna
    from optuna.trial import TrialState

    env = cli_env(IMGCLS_SWEEP_STORAGE=url)
    logs = {name: folder / f"worker_{name}.log" for name in "ab"}
    workers = {}

    def start(name: str) -> None:
        with open(logs[name], "w") as sink:
            workers[name] = subprocess.Popen(
                [sys.executable, "-m", "imgcls", "sweep", "--config", str(sweep), "--out", str(folder / name),
                 "--heartbeat", str(heartbeat), "--grace", str(grace)],
                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    try:
        # One after the other: two workers that ask at the same instant may both draw the grid's one point.
        start("a")
        _until("worker a's trial past its parse", (folder / "a" / "trial_0000" / "config.yaml").is_file, 300)
        start("b")
        _until("worker b waiting", lambda: "waiting for 1 trial(s)" in logs["b"].read_text(), 300)
        os.kill(workers["a"].pid, signal.SIGKILL)
        killed = time.time()
        workers["a"].wait(timeout=30)
        study = optuna.load_study(study_name="retry", storage=url)
        failed, retry = _until("the retry to start", lambda: len(trials := study.get_trials(deepcopy=False)) == 2
                               and trials[1].state == TrialState.RUNNING and trials, grace + 10 * heartbeat + 60)
    except TimeoutError as err:  # what each worker and trial said, so that a stall can be read after the fact
        raise TimeoutError(f"{err}\n{last_lines(folder)}") from None
    finally:
        for worker in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    assert failed.state == TrialState.FAIL and retry.system_attrs["failed_trial"] == failed.number
    return {"to_failed_s": failed.datetime_complete.timestamp() - killed,
            "to_retry_s": retry.datetime_start.timestamp() - killed}


def main(quick: bool = False) -> dict:
    heartbeat, grace = (1, 5) if quick else (HEARTBEAT, GRACE)
    deaths = []
    with tempfile.TemporaryDirectory() as tmp:
        digits = build_demo_data(Path(tmp) / "digits", size=32)
        sweep = _sweep_file(Path(tmp), digits)
        try:
            with throwaway_server(Path(tmp)) as server:
                for rep in range(1 if quick else 3):
                    folder = Path(tmp) / f"rep{rep}"
                    folder.mkdir()
                    deaths.append(one_death(server.database(f"rep{rep}"), folder, sweep, heartbeat, grace))
                    print(f"sweep_retry: death {rep + 1}: {deaths[-1]}", flush=True)
        except Unavailable as err:
            return {"skipped": str(err), "needs": "postgresql"}
    return {"heartbeat_s": heartbeat, "grace_s": grace, "deaths": deaths}


def _median(r: dict, key: str) -> float:
    return statistics.median(d[key] for d in r["deaths"])


def render(r: dict) -> tuple[str, str]:
    rows = [[i + 1, d["to_failed_s"], d["to_retry_s"]] for i, d in enumerate(r["deaths"])]
    body = table(["death", "kill -> trial failed, s", "kill -> retry started, s"], rows)
    heartbeat, grace = r["heartbeat_s"], r["grace_s"]
    body += (
        f"\n\nA worker that dies costs its trial's work so far, and the point is retried {_median(r, 'to_retry_s'):.0f}"
        f" s after the death (median) by a worker with nothing else to run. A trial is failed once its last heartbeat "
        f"is {grace} s old; its worker sent one every {heartbeat} s, so that is {grace - heartbeat} to {grace} s after "
        f"the death, and a waiting worker looks every {heartbeat} s. A busy worker looks when its own trial ends, and "
        "then runs the retry before any new point."
    )
    settings = (f"`imgcls sweep --heartbeat {heartbeat} --grace {grace}`, {len(r['deaths'])} death(s); a one-point "
                "grid, resnet18 at 32 px on the demo digits, two workers on one machine, PostgreSQL on 127.0.0.1")
    return body, settings


def figures(r: dict) -> dict[str, str]:
    return {"death_to_retry": f"{_median(r, 'to_retry_s'):.0f} s",
            "settings": f"{r['heartbeat_s']} s heartbeat, {r['grace_s']} s grace period"}

