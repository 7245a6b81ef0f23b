"""SLURM in the suite: a one-node cluster (munged, slurmctld, slurmd) on this machine runs docs/examples/slurm.sbatch;
`scancel -s USR1` preempts it, the script requeues it, and the requeued job ends with an uninterrupted run's weights.

Needs root: to run the daemons, and to install Debian's packages with apt-get where they are missing (their .deb files
stay in apt's cache for the next install); elsewhere the test skips, naming what is missing (under CI=true it fails).
The daemons it starts read no file in /etc: their config, key, state and logs are in the test's folders, on ports of
their own, and they are stopped when the test ends, passed or failed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers import (
    CONFIGS,
    ROOT,
    TINY,
    apt_install,
    cli_env,
    concurrent_python,
    free_port,
    make_image_folder,
    max_diff,
    run_cli,
    service_unavailable,
    wait_until,
)

SCRIPT = ROOT / "docs" / "examples" / "slurm.sbatch"
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")  # Debian's; bookworm ships SLURM 22.05
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}

TASKS = 2  # one node of 2 CPUs, one srun task (DDP rank) per CPU
HOLD_STEP = 1  # the step after which the ranks wait for scancel's SIGUSR1
STEPS = 8  # 32 training images / (2 ranks x batch 4) = 4 steps per epoch, 2 epochs
# The users' command line on a CPU node: the GPU request dropped, one CPU per task.
SBATCH = ["--nodes=1", f"--ntasks-per-node={TASKS}", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
# The production config (imagenet_ddp8.yaml) shrunk: TINY_ARCH at 32 px on the CPU, random initial weights (no
# download), fp32, two short epochs; the same for the SLURM job and the uninterrupted reference. Its random crops
# and flips (preset imagenet) stay on: each draw is seeded by its position (SeededDraws), so a resume replays them.
FIT = [*TINY, "--model.net.weights", "null", "--data.batch_size", "4", "--trainer.precision", "32-true",
       "--trainer.max_epochs", "2", "--data.fast_decode", "false"]


class HoldForSignal(Callback):
    """Test-only: after training step `step` each rank writes `folder/rank<R>` and waits, at most `timeout_s`, for a
    SIGUSR1, which it hands on to the handler in place (imgcls' Preemption). So scancel's signal lands mid-training
    however fast the steps run; a rank that gets none stops the run."""

    def __init__(self, step: int, folder: str, timeout_s: float = 120.0) -> None:
        self.step, self.folder, self.timeout_s = step, folder, timeout_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        received = []
        previous = signal.getsignal(signal.SIGUSR1)

        def chained(signum, frame):
            received.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR1, chained)
        try:
            Path(self.folder, f"rank{trainer.global_rank}").touch()
            deadline = time.monotonic() + self.timeout_s
            while not received and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        if not received:
            raise RuntimeError(f"rank {trainer.global_rank}: no SIGUSR1 within {self.timeout_s}s of step {self.step}")



def _tail(path: Path, chars: int = 4000) -> str:
    return f"--- {path}:\n{path.read_text(errors='replace')[-chars:]}" if path.is_file() else f"--- {path}: none"


def _install_slurm() -> None:
    """apt-get the missing daemons and clients; skip (fail under CI) where that cannot be."""
    missing = [b for b in BINARIES if shutil.which(b, path=SBIN_PATH) is None]
    if missing:
        apt_install(PACKAGES, f"SLURM is not installed ({', '.join(missing)} not found)")


class Cluster:
    """A running one-node SLURM: `env` is what its commands and jobs need (SLURM_CONF, PATH, PYTHONPATH)."""

    def __init__(self, folder: Path, munge_dir: Path) -> None:
        self.folder, self.munge_dir = folder, munge_dir
        self.conf = folder / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        # No SLURM variables of a job this test may itself run in: sbatch and srun would take them as theirs.
        outer = {k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env = {k: v for k, v in cli_env().items() if k not in outer}
        bin_ = [str(Path(sys.executable).parent), SBIN_PATH]
        if (python := concurrent_python()) != sys.executable:
            # The job's `imgcls` (slurm.sbatch's `srun imgcls fit`) has the preloaded server fork each task, as it
            # forks a DDP rank (tests/preloaded.py); the task's signals and exit code go through its launcher.
            (folder / "bin").mkdir()
            (folder / "bin" / "imgcls").write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -m imgcls "$@"\n')
            (folder / "bin" / "imgcls").chmod(0o755)
            bin_.insert(0, str(folder / "bin"))
        self.env.update(SLURM_CONF=str(self.conf), PATH=os.pathsep.join(bin_))

    def run(self, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM command (sbatch, scancel, scontrol) against this cluster; on failure show the daemons' logs."""
        proc = subprocess.run(args, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}: {proc.stderr}{self.logs()}"
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def logs(self) -> str:
        return "\n" + "\n".join(_tail(self.folder / f"{d}.log", 2000) for d in ("slurmctld", "slurmd"))

    def start(self) -> None:
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = self.munge_dir / "munge.socket"
        self._daemon("munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                     f"--pid-file={self.munge_dir / 'munged.pid'}", f"--seed-file={self.munge_dir / 'munged.seed'}",
                     f"--log-file={self.folder / 'munged.log'}")
        wait_until("munged's socket", socket_path.exists, 20, lambda: _tail(self.folder / "munged.log"))
        host = socket.gethostname().split(".")[0]  # what slurmd calls its node (`hostname -s`)
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir()
        self.conf.write_text(f"""\
ClusterName=imgcls
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job back (cred_expire + 1 s; the default 120 s); 5 is SLURM's least
AuthInfo=socket={socket_path},cred_expire=5
StateSaveLocation={self.folder / 'state'}
SlurmdSpoolDir={self.folder / 'spool'}
SlurmctldPidFile={self.folder / 'slurmctld.pid'}
SlurmdPidFile={self.folder / 'slurmd.pid'}
SlurmctldLogFile={self.folder / 'slurmctld.log'}
SlurmdLogFile={self.folder / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=5
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={TASKS} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("slurmctld", "-D")
        self._daemon("slurmd", "-D")
        wait_until("the node to come up idle",
                   lambda: "State=IDLE" in self.run("scontrol", "show", "node", "-o").stdout, 30, self.logs)

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.folder / f"{name}.out", "ab")
        self.daemons.append(subprocess.Popen([shutil.which(name, path=SBIN_PATH), *args], env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (last started, first stopped); return what was left running."""
        if len(self.daemons) == 3:
            subprocess.run(["scancel", "--partition=debug"], env=self.env, capture_output=True, timeout=60)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=60).stdout.strip():
                time.sleep(0.5)
        for proc in reversed(self.daemons):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = []
        for pid, cmdline in _processes_with(f"SLURM_CONF={self.conf}"):  # the job's tasks, slurmstepd
            left.append(f"{pid} {cmdline}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def _processes_with(variable: str) -> list[tuple[int, str]]:
    """(pid, command line) of each process other than this one whose environment holds `variable` (NAME=value)."""
    found, needle = [], variable.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture
def slurm(tmp_path):
    """A one-node SLURM cluster of TASKS CPUs, up for one test; stopped afterwards, also when the test fails."""
    if os.geteuid() != 0:
        service_unavailable(f"SLURM's daemons (munged, slurmctld, slurmd) need root and apt-get to install them; "
                            f"running as uid {os.geteuid()}")
    _install_slurm()
    folder = tmp_path / "slurm"
    folder.mkdir()
    # munged wants every folder above its socket searchable by all; pytest's tmp_path is private to its user.
    munge_dir = Path(tempfile.mkdtemp(prefix="imgcls-munge-"))
    munge_dir.chmod(0o755)
    cluster = Cluster(folder, munge_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(munge_dir, ignore_errors=True)
        assert not left, f"processes left running after the cluster stopped (now killed): {left}"


@pytest.mark.slow
def test_sbatch_script_preempted_by_scancel_requeues_and_resumes_to_the_uninterrupted_weights(tmp_path, slurm):
    data = make_image_folder(tmp_path / "images", {"a": 16, "b": 16}, splits=("train",), size=32)
    make_image_folder(data, {"a": 4, "b": 4}, splits=("val",), size=32, seed=1)
    work, hold = tmp_path / "work", tmp_path / "hold"  # work: where the user submits from (runs/, logs/)
    (work / "logs").mkdir(parents=True)
    hold.mkdir()
    config = CONFIGS / "imagenet_ddp8.yaml"
    start = time.monotonic()
    job = slurm.run(
        "sbatch", "--parsable", *SBATCH, str(SCRIPT), str(data), *FIT,
        f"--trainer.callbacks+={__name__}.HoldForSignal", f"--trainer.callbacks.step={HOLD_STEP}",
        f"--trainer.callbacks.folder={hold}", cwd=work,
        # MASTER_PORT: Lightning's SLURM default (10000 + the job id's last digits) is the same in every fresh cluster
        env={**slurm.env, "CONFIG": str(config), "MASTER_PORT": str(free_port())},
    ).stdout.strip().split(";")[0]
    log = work / "logs" / f"imgcls-{job}.out"
    run = work / "runs" / f"imgcls_{job}"

    def show() -> str:
        return f"{_tail(log)}\n{slurm.job(job)}{slurm.logs()}"

    # Both ranks wait after step HOLD_STEP. scancel without --batch or --full signals the tasks of the job's steps
    # (srun's), not the batch shell: with either option bash dies of SIGUSR1, and the job fails without a requeue.
    wait_until("both ranks at the hold", lambda: len(list(hold.iterdir())) == TASKS, 150, show)
    slurm.run("scancel", "--signal=USR1", job)
    done = wait_until("the requeued job to finish", lambda: (info := slurm.job(job))["JobState"] in TERMINAL and info,
                 240, show)
    elapsed = time.monotonic() - start
    out = log.read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0" and done["Restarts"] == "1", show()

    # The first run: two ranks started by srun (SLURMEnvironment), preempted at a step end, exit 138, requeued.
    assert out.count("MEMBER: 1/2") == out.count("MEMBER: 2/2") == 2, out[-4000:]  # once per run
    saved = re.search(r"SIGUSR1 received: saved (\S+) at step (\d+); exiting with code 138", out)
    assert saved, out[-4000:]
    preempted, step = (work / saved[1]).resolve(), int(saved[2])
    assert preempted == (run / "checkpoints" / "preempted.ckpt").resolve()
    assert HOLD_STEP < step < STEPS  # one step after the signal (the ranks agree first), before the end
    assert "Exited with exit code 138" in out  # srun's report of its tasks
    # The requeued run (Restarts=1 above): the same run folder, resumed from the preemption checkpoint, to the end.
    resumed = re.search(r"resuming from (\S+) \(auto_resume\)", out)
    assert resumed and (work / resumed[1]).resolve() == preempted, out[-4000:]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == STEPS

    # The uninterrupted reference: the same config and options, `imgcls fit` on 2 local processes.
    reference = tmp_path / "reference"
    run_cli("fit", "--config", str(config), "--data.root", str(data), "--trainer.num_nodes", "1",
            "--trainer.devices", str(TASKS), "--trainer.default_root_dir", str(reference), *FIT,
            env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    ref = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ref["global_step"] == STEPS
    diff = max_diff(last["state_dict"], ref["state_dict"])
    print(f"SLURM job {job}: preempted at step {step}, requeued, finished in {elapsed:.0f}s; "
          f"max |w - w_ref| = {diff}")
    assert diff <= 1e-6
