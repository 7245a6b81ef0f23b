"""Sweep retry: what a sweep worker's death costs, two `imgcls sweep` processes on one PostgreSQL database
(tests/postgres.py: a throwaway server of the installed Debian packages; skipped where there is none): the time from
the death to the start of its trial's retry on another worker, and the training steps the retry trains again.

    python -m benchmarks.run --only sweep_retry [--quick]

A one-point grid of the quickstart shrunk to seconds an epoch (TINY's network at 32 px on the demo digits, an epoch
of 3 steps and its last.ckpt), more epochs than the measurement lasts. One worker takes the point; its trial stops
itself (SIGSTOP) at the end of step 8, two steps past its last checkpoint; then a second worker starts, finds the
point taken and waits. Two kinds of death, in turn: the first worker alone is killed with SIGKILL (its trial process,
sent SIGTERM by that death and let go on, saves `preempted.ckpt` and exits, as on a worker's out-of-memory kill), or
the worker and its trial together (a machine lost: nothing more is saved). The other worker fails the trial once its
last heartbeat is `--grace` old and starts its retry, which continues the trial's fit from its newest intact
checkpoint; once the retry's fit has started, the workers are stopped. Measured: the kill to the trial's failure and
to the retry's start (the times Optuna records), and the steps the retry trains again (the dead trial's steps less
the one the retry started from), against those a retry from step 0 trained before this continuation. Full mode:
`imgcls sweep`'s default heartbeat and grace period, each kind twice; quick: 1 s and 5 s (a busy machine may delay a
heartbeat by seconds), each kind once.
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
from tests.helpers import TINY, TINY_ARCH, cli_env
from tests.postgres import Unavailable, throwaway_server
from training.sweeps.command import GRACE, HEARTBEAT

TITLE = "Sweep retry after a worker's death"
ROOT = Path(__file__).resolve().parents[1]
LR = "model.optimizer.lr"
STOP_AT = 8  # the dead trial's last step: an epoch is 3 steps, so its last checkpoint is step 6's last.ckpt
KINDS = {"worker": "the worker killed, its trial saves as it stops",
         "machine": "the worker and its trial killed together, nothing saved"}


def _sweep_file(folder: Path, digits: Path, name: str, *extra: str) -> Path:
    spec = {"name": "retry", "method": "grid", "metric": {"name": "val/acc", "goal": "maximize"},
            "parameters": {LR: {"values": [0.02]}, "trainer.max_epochs": {"value": 1000}},
            "command": ["${env}", "${interpreter}", "-m", "imgcls", "fit", "--config", "configs/quickstart.yaml",
                        *TINY, "--data.root", str(digits), "--trainer.limit_train_batches", "3",
                        "--trainer.limit_val_batches", "2", *extra, "${args}"]}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def sweep_files(folder: Path, digits: Path) -> dict[str, Path]:
    """The first worker's sweep file, whose trial stops itself (SIGSTOP) at the end of step STOP_AT, writing a stamp
    file first, and the second worker's, the same sweep without that."""
    stop = ["--trainer.callbacks+=tests.fault_injection.KillAt", "--trainer.callbacks.step", str(STOP_AT),
            "--trainer.callbacks.sig", str(int(signal.SIGSTOP)), "--trainer.callbacks.stamp",
            str(folder / "stopped")]
    return {"a": _sweep_file(folder, digits, "a", *stop), "b": _sweep_file(folder, digits, "b")}


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


def one_death(url: str, folder: Path, sweeps: dict[str, Path], heartbeat: int, grace: int, kind: str) -> dict:
    """One worker takes the point, and its trial stops at step STOP_AT; a second starts and waits; the first dies as
    `kind` says. The seconds from the kill to the trial's failure and to its retry's start, and the steps the dead
    trial trained and the one its retry started from."""
    import optuna
    from optuna.trial import TrialState

    env = cli_env(IMGCLS_SWEEP_STORAGE=url)
    logs = {name: folder / f"worker_{name}.log" for name in "ab"}
    workers = {}

    def start(name: str) -> None:
        with open(logs[name], "w") as sink:
            workers[name] = subprocess.Popen(
                [sys.executable, "-m", "imgcls", "sweep", str(sweeps[name]), "--out", str(folder / name),
                 "--heartbeat", str(heartbeat), "--grace", str(grace)],
                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    stamp = sweeps["a"].parent / "stopped"
    stamp.unlink(missing_ok=True)
    try:
        start("a")
        _until("worker a's trial stopped at its step", stamp.is_file, 300)
        start("b")
        _until("worker b waiting", lambda: "waiting for 1 trial(s)" in logs["b"].read_text(), 300)
        # The trial is a's child, in a's process group: a machine's loss takes both, a worker's death leaves the
        # trial the SIGTERM that it sends (PR_SET_PDEATHSIG), handled once it goes on.
        if kind == "machine":
            os.killpg(workers["a"].pid, signal.SIGKILL)
        else:
            os.kill(workers["a"].pid, signal.SIGKILL)
        killed = time.time()
        workers["a"].wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(workers["a"].pid, signal.SIGCONT)
        study = optuna.load_study(study_name="retry", storage=url)

        def started(trials) -> bool:  # by b, which cleared the start step the retry copied from the dead trial
            # b names itself by its host and pid, which need not be its Popen's (a launcher may stand in for it):
            # any worker but the dead trial's is b
            attrs, dead = trials[1].user_attrs, trials[0].user_attrs
            return attrs.get("worker") != dead.get("worker") and isinstance(attrs.get("start_step"), int)

        failed, retry = _until("the retry's fit to start", lambda: len(trials := study.get_trials(deepcopy=False))
                               == 2 and started(trials) and trials, grace + 10 * heartbeat + 300)
    except TimeoutError as err:  # what each worker and trial said, so that a stall can be read after the fact
        seen = [(t.number, t.state.name, t.user_attrs.get("worker"), t.user_attrs.get("start_step"))
                for t in optuna.load_study(study_name="retry", storage=url).get_trials(deepcopy=False)]
        raise TimeoutError(f"{err}\ntrials (number, state, worker, start_step): {seen}\n{last_lines(folder)}") from None
    finally:
        for worker in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    assert failed.state == TrialState.FAIL and retry.system_attrs["failed_trial"] == failed.number
    resumed = retry.user_attrs["start_step"]
    return {"kind": kind, "to_failed_s": failed.datetime_complete.timestamp() - killed,
            "to_retry_s": retry.datetime_start.timestamp() - killed,
            "steps_trained": max(STOP_AT, resumed), "resumed_step": resumed}


def main(quick: bool = False) -> dict:
    heartbeat, grace = (1, 5) if quick else (HEARTBEAT, GRACE)
    deaths = []
    with tempfile.TemporaryDirectory() as tmp:
        digits = build_demo_data(Path(tmp) / "digits", size=32)
        sweeps = sweep_files(Path(tmp), digits)
        try:
            with throwaway_server(Path(tmp)) as server:
                for rep, kind in enumerate(list(KINDS) * (1 if quick else 2)):
                    folder = Path(tmp) / f"rep{rep}"
                    folder.mkdir()
                    deaths.append(one_death(server.database(f"rep{rep}"), folder, sweeps, heartbeat, grace, kind))
                    print(f"sweep_retry: death {rep + 1}: {deaths[-1]}", flush=True)
        except Unavailable as err:
            return {"skipped": str(err), "needs": "postgresql"}
    return {"heartbeat_s": heartbeat, "grace_s": grace, "arch": TINY_ARCH, "deaths": deaths}


def _median(r: dict, key: str) -> float:
    return statistics.median(d[key] for d in r["deaths"])


def render(r: dict) -> tuple[str, str]:
    heartbeat, grace, deaths = r["heartbeat_s"], r["grace_s"], r["deaths"]
    continued = all("resumed_step" in d for d in deaths)  # older records timed the retry only
    if continued:
        rows = [[i + 1, KINDS[d["kind"]], d["to_failed_s"], d["to_retry_s"], d["resumed_step"], d["steps_trained"],
                 d["steps_trained"] - d["resumed_step"]] for i, d in enumerate(deaths)]
        body = table(["death", "kind", "kill -> trial failed, s", "kill -> retry started, s",
                      "the retry started at step", "steps trained again: before (a retry from step 0)",
                      "steps trained again: now"], rows)
        cost = ("costs the steps since its trial's newest checkpoint: the retry continues the trial's fit from it "
                "(a retry from step 0, before, trained all of the trial's steps again)")
    else:
        rows = [[i + 1, d["to_failed_s"], d["to_retry_s"]] for i, d in enumerate(deaths)]
        body = table(["death", "kill -> trial failed, s", "kill -> retry started, s"], rows)
        cost = "costs its trial's work so far"
    body += (
        f"\n\nA worker that dies {cost}, and the point is retried {_median(r, 'to_retry_s'):.0f} s after the death "
        f"(median) by a worker with nothing else to run. A trial is failed once its last heartbeat is {grace} s old; "
        f"its worker sent one every {heartbeat} s, so that is {grace - heartbeat} to {grace} s after the death, and a "
        f"waiting worker looks every {heartbeat} s. A busy worker looks when its own trial ends, and then runs the "
        "retry before any new point."
    )
    settings = (f"`imgcls sweep --heartbeat {heartbeat} --grace {grace}`, {len(deaths)} death(s); a one-point grid, "
                f"{r.get('arch', 'resnet18')} at 32 px on the demo digits, two workers on one machine, PostgreSQL on "
                "127.0.0.1" + (f"; the trial's worker killed at the end of its step {STOP_AT}, an epoch (and its "
                               "last.ckpt) being 3 steps" if continued else ""))
    return body, settings


def figures(r: dict) -> dict[str, str]:
    shown = {"death_to_retry": f"{_median(r, 'to_retry_s'):.0f} s",
             "settings": f"{r['heartbeat_s']} s heartbeat, {r['grace_s']} s grace period"}
    if all("resumed_step" in d for d in r["deaths"]):
        again = {kind: max(d["steps_trained"] - d["resumed_step"] for d in r["deaths"] if d["kind"] == kind)
                 for kind in KINDS}
        shown["retrained"] = (f"{again['worker']} steps when its worker alone died, {again['machine']} when its "
                              f"machine was lost (of {r['deaths'][0]['steps_trained']} the trial had trained)")
    return shown

