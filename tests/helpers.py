"""Shared test utilities: running the real `imgcls` command in a process of its own, free ports, tiny image folders."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch.multiprocessing as torch_mp
import yaml
from filelock import FileLock
from PIL import Image

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
_EXECUTABLE = sys.executable

# Shrinks any shipped config to seconds on a CPU: small network, small images, few batches, no rich widgets.
def shipped_config(name: str = "quickstart.yaml") -> dict:
    """A shipped config as a dict, its `trainer.callbacks: callbacks/<file>.yaml` read in (jsonargparse reads the path
    relative to the config's folder), so that a test can edit the list and write the config elsewhere."""
    path = CONFIGS / name
    cfg = yaml.safe_load(path.read_text())
    if isinstance(cfg.get("trainer", {}).get("callbacks"), str):
        cfg["trainer"]["callbacks"] = yaml.safe_load((path.parent / cfg["trainer"]["callbacks"]).read_text())
    return cfg


def resume_config(devices: int = 1, every_n_train_steps: int = 2) -> dict:
    """The quickstart config for exact-resume tests: fp32 and deterministic kernels, 2 epochs, TINY_ARCH with a small
    head, a step checkpoint every `every_n_train_steps`, no rich widgets; DDP on `devices` CPU processes."""
    cfg = shipped_config()
    cfg["trainer"].update(precision="32-true", deterministic=True, max_epochs=2, accelerator="cpu", devices=devices,
                          enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                          **({"strategy": "ddp"} if devices > 1 else {}))
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "Rich" not in c["class_path"]]
    cfg["checkpoint"] = {"every_n_train_steps": every_n_train_steps}
    cfg["model"]["net"]["init_args"].update(arch=TINY_ARCH, head_hidden=32)
    cfg["model"]["levers"]["channels_last"] = False
    return cfg


# The backbone of the shrunk runs: torchvision's smallest classifier with BatchNorm (0.37M parameters, resnet18 has
# 11M), under the default head with its dropout: BatchNorm statistics and dropout draws to resume, at a fraction of
# resnet18's step and checkpoint.
TINY_ARCH = "shufflenet_v2_x0_5"
TINY = [
    "--model.net.arch", TINY_ARCH, "--model.net.head_hidden", "32", "--data.image_size", "32",
    "--data.batch_size", "16", "--data.num_workers", "0", "--trainer.accelerator", "cpu",
    "--trainer.enable_model_summary", "false",
]


# The `checkpoint` key of a run that keeps no checkpoints of its own: a test's listed ModelCheckpoint is the only one.
NO_RUN_CHECKPOINTS = {"save_top_k": 0, "save_last": False, "every_n_train_steps": 0}


# `imgcls fit` arguments that freeze the network's backbone for epoch 0 (training.callbacks.FreezeBackbone).
FREEZE_FIRST_EPOCH = ["--freeze.epochs", "1"]


LAUNCHER_VARS = frozenset({"RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"})


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess that imports this checkout (not another installed copy)."""
    # A command started by hand carries no launcher variables; left over, they make Lightning wait for external ranks.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")  # two cores shared by every process of a test
    env.update(extra)
    return env


# W&B settings of the calling shell (a key, an agent's sweep and run ids) that would send a test's run online.
WANDB_VARS = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_SWEEP_ID", "WANDB_RUN_ID")


def wandb_offline_env(**extra: str) -> dict[str, str]:
    """cli_env without the caller's W&B settings: configs/loggers/wandb.yaml then logs offline, quietly."""
    return {k: v for k, v in cli_env(WANDB_SILENT="true", **extra).items() if k not in WANDB_VARS}


def wandb_inspect(run_dir: Path, *args: str) -> str:
    """`wandb leet inspect ARGS` of the run folder's one offline W&B run (wandb's own reader of what `wandb sync`
    uploads)."""
    wandb = Path(sys.executable).parent / "wandb"  # the CLI installed with the wandb package
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, f"expected one offline wandb run, found {offline}"
    proc = subprocess.run([str(wandb), "leet", "inspect", *args, str(offline[0])], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def wandb_offline_runs(run_dir: Path) -> list[tuple[dict, list[dict]]]:
    """Each offline W&B run in the folder (a resumed fit writes one more), in the order `wandb sync` uploads them:
    its `run` record (id, group, whether it resumes) and its history rows."""
    wandb = Path(sys.executable).parent / "wandb"
    runs = []
    for offline in sorted((run_dir / "wandb").glob("offline-run-*")):
        proc = subprocess.run([str(wandb), "leet", "inspect", "--json", str(offline)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        runs.append((next(r["run"] for r in records if r.get("type") == "run"),
                     [r["history"]["item"] for r in records if r.get("type") == "history"]))
    return runs


def wandb_run_record(run_dir: Path) -> dict:
    """The `run` record of the folder's one offline wandb run: its id, group, whether it resumes."""
    ((record, _),) = wandb_offline_runs(run_dir)
    return record


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `imgcls ARGS...` as a user would, in a process of its own (forked by tests/preloaded.py's server, which
    has done the imports); on failure the assertion shows the output."""
    cmd = [sys.executable, "-m", "imgcls", *args]
    env = env or cli_env()
    # Forked by a server that has done the imports (tests/preloaded.py), or, where it can't be, a fresh interpreter.
    # Either way in its own session: a timeout then kills the DDP ranks the launcher started too, not only it.
    proc = None
    if sys.executable == _EXECUTABLE:  # not a test's stand-in for the interpreter
        proc = preloaded.command(list(args), cwd or ROOT, env, ROOT, cli_env())
    proc = proc or subprocess.Popen(cmd, cwd=cwd or ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # our timeout, or pytest-timeout / Ctrl-C interrupting the wait
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            pytest.fail(f"imgcls {' '.join(args)} timed out after {timeout}s\n{out[-4000:]}\n{err[-6000:]}")
        raise
    if check:
        assert proc.returncode == 0, f"imgcls {' '.join(args)} exited {proc.returncode}\n{out[-4000:]}\n{err[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def concurrent_python() -> str:
    """The interpreter for `imgcls` processes a test runs several at once (`[it, "-m", "imgcls", ...]`): the
    preloaded server's launcher, which has each forked as run_cli's commands are, or the real one where it can't."""
    launcher = preloaded.launcher(ROOT, cli_env()) if sys.executable == _EXECUTABLE else None
    return str(launcher or sys.executable)


def torchrun(*options: str, module: str = "imgcls") -> list[str]:
    """`python -m torch.distributed.run OPTIONS -m MODULE`, to which the caller appends MODULE's arguments. Its workers
    are forked as DDP ranks are (torchrun's --no-python, with concurrent_python() as the program), or fresh
    interpreters where they can't be; torchrun itself (the agent) always runs in the real one."""
    agent, python = [sys.executable, "-m", "torch.distributed.run", *options], concurrent_python()
    return [*agent, "-m", module] if python == sys.executable else [*agent, "--no-python", python, "-m", module]


def start_cli(*args: str, log: Path, env: dict[str, str] | None = None) -> preloaded.Command | subprocess.Popen:
    """`imgcls ARGS...` started as run_cli starts it, in a session of its own, its stdout and stderr into `log`; the
    caller polls or waits for it, or kills its session (os.killpg(proc.pid, ...))."""
    env = env or cli_env()
    log.write_text("")  # there from the start, also where the forked process opens it a moment later
    proc = preloaded.command(list(args), ROOT, env, ROOT, cli_env(), log=log) if sys.executable == _EXECUTABLE else None
    if proc is None:
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "imgcls", *args], cwd=ROOT, env=env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    return proc


def fit_run(config: Path, run: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """`imgcls fit --config CONFIG` into the run directory `run`, with a fresh port for every run (only DDP uses it:
    a killed run's port can stay busy for a while)."""
    return run_cli("fit", "--config", str(config), "--trainer.default_root_dir", str(run), *extra, check=check,
                   env=cli_env(MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1"), timeout=300)


def printed_metrics(stdout: str) -> dict[str, float]:
    """The metric table Lightning prints after validate/test."""
    return {k: float(v) for k, v in re.findall(r"│\s*([a-z_]+/[a-z0-9_]+)\s*│\s*([-+0-9.e]+)\s*│", stdout)}


def last_weights(run: Path, key: str = "state_dict") -> dict:
    """The tensors of `<run>/checkpoints/last.ckpt` (its weights, or another `key` of it)."""
    import torch

    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")[key]


def killed_and_resumed(config: Path, folder: Path, *, kill_after: int, resumes_from: int,
                       reference: Path | None = None) -> float:
    """Fit `config` once uninterrupted (or take `reference`, a finished run of the same config), once SIGKILLed after
    training step `kill_after` and run again (auto_resume), which must resume from step `resumes_from`'s checkpoint;
    the largest weight difference between the two ends."""
    import signal

    if reference is None:
        reference = folder / "reference"
        assert "val/acc" in fit_run(config, reference).stdout  # trained and validated
    run = folder / "killed"
    killed = fit_run(config, run, *kill_args(kill_after, "train"), check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = fit_run(config, run)
    step = run / "checkpoints" / f"step{resumes_from:07d}.ckpt"
    assert f"resuming from {step} (auto_resume)" in resumed.stdout + resumed.stderr
    diff = max_diff(last_weights(reference), last_weights(run))
    print(f"killed after step {kill_after}, resumed from step {resumes_from}: max |w - w_ref| = {diff}")
    return diff


# What the forkserver of start_ranks (and of the other tests that fork from one) imports once per test process.
FORKSERVER_PRELOAD = ["imgcls.commands"]


def start_ranks(fn, args: tuple, nprocs: int):
    """torch.multiprocessing.start_processes(fn, args, nprocs, join=False), each process forked from a forkserver that
    imported torch, Lightning and the project once for this test process (spawned, each would import them again: ~5 s
    of CPU apiece). A forked rank has the forkserver's environment, not the test's: `fn` sets what it needs."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return torch_mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def join_ranks(ranks, timeout_s: float, what: str) -> None:
    """Wait for torch.multiprocessing's `ranks` (start_processes, join=False): a rank's exception is raised here with
    its traceback; past `timeout_s` the test fails naming `what`, and every rank left is killed."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ranks.join(timeout=2):
            assert time.monotonic() < deadline, f"{what} did not finish within {timeout_s:.0f} s"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()


def kill_args(step: int, where: str, rank: int | None = None) -> list[str]:
    """`imgcls fit` arguments that add tests.fault_injection.KillAt: the run SIGKILLs itself at (step, where)."""
    args = ["--trainer.callbacks+=tests.fault_injection.KillAt", "--trainer.callbacks.step", str(step),
            "--trainer.callbacks.where", where]
    return args + (["--trainer.callbacks.rank", str(rank)] if rank is not None else [])


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between the floating-point tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for one multi-process run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_unavailable(reason: str) -> NoReturn:
    """Skip a test whose service (a daemon from Debian's packages) cannot be had here, in one line; under CI=true,
    where .ci/run promises every test its services, fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def apt_install(packages: tuple[str, ...], missing: str) -> None:
    """apt-get install Debian's `packages` (their .deb files stay in apt's cache for the next install); `missing` says
    what is not installed. Where that cannot be (no root, no apt-get, no network nor cached .deb), service_unavailable.
    """
    what = f"{missing} and `apt-get install {' '.join(packages)}`"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        service_unavailable(f"{what} needs apt-get and root (uid {os.geteuid()})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # One install at a time across the pytest workers: two `apt-get update`s at once fail on apt's list lock.
    with FileLock(Path(tempfile.gettempdir()) / "imgcls-tests-apt.lock"):
        # A failed update (no network) may still leave lists that match the cached .deb files.
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=180)
        proc = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "-o",
                               "DPkg::Lock::Timeout=120", "-o", "APT::Keep-Downloaded-Packages=true", *packages],
                              env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        service_unavailable(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-500:]}")


def make_image_folder(root: Path, classes: dict[str, int], *, splits=("train", "val"), size: int = 40,
                      ext: str = ".png", seed: int = 0) -> Path:
    """Write `count` random RGB images for each class of each split: root/split/class/i.ext."""
    rng = np.random.default_rng(seed)
    for split in splits:
        for name, count in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}{ext}")
    return root


def wait_until(what: str, ready, timeout: float, show=lambda: "", every: float = 0.2):
    """Poll `ready()` every `every` seconds until it returns something true, and return that; fail the test after
    `timeout` seconds with `what` and what `show()` says (the logs of the processes waited on)."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{show()}")
        time.sleep(every)
    return found

