"""The preloaded `imgcls` server of the tests (tests/preloaded.py): a command it forks is the process a fresh
`python -m imgcls` would be, and trains to the same weights."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import preloaded
from tests.helpers import CONFIGS, ROOT, TINY, cli_env, free_port, make_image_folder, max_diff, run_cli


def facts() -> None:
    """A command's entry point (`entry` of a request): prints what the process looks like, as JSON."""
    import __main__

    print(json.dumps({
        "pid": os.getpid(), "session": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv,
        "main": __main__.__spec__.name, "marker": os.environ.get("IMGCLS_MARKER"),
        "random": [random.random(), float(np.random.random())],
        "threads": torch.get_num_threads(), "frozen": gc.get_freeze_count(), "collector": gc.isenabled(),
        "stdin": os.read(0, 10).decode(),
    }))
    print("to stderr", file=sys.stderr)


def _run(entry: str, *args: str, cwd: Path, **env: str) -> tuple[int, dict, str]:
    command = preloaded.command(list(args), cwd, cli_env(**env), ROOT, cli_env(), entry=entry)
    assert command is not None
    assert command.server_threads in (1, None)  # the server forked with no other thread (None: no /proc to count)
    out, err = command.communicate(timeout=60)
    return command.returncode, json.loads(out) if out else {}, err


def test_a_forked_command_is_its_own_process_as_python_m_would_start_it(tmp_path):
    code, first, err = _run("tests.test_preloaded:facts", "fit", "--x", cwd=tmp_path, IMGCLS_MARKER="one")
    assert code == 0 and err == "to stderr\n"
    _, second, _ = _run("tests.test_preloaded:facts", cwd=ROOT, IMGCLS_MARKER="two")
    assert first["pid"] != os.getpid() and first["session"] == first["pid"]  # its own session: killpg reaches its ranks
    assert first["cwd"] == str(tmp_path) and second["cwd"] == str(ROOT)
    assert first["argv"][1:] == ["fit", "--x"]
    assert first["argv"][0].endswith(str(Path("imgcls", "__main__.py")))
    # runpy's __main__ of `-m imgcls`: Lightning's launcher starts the other ranks with its name, and a spawned
    # process (a server's workers) does not run it again
    assert first["main"] == "imgcls.__main__"
    assert (first["marker"], second["marker"]) == ("one", "two")
    # Python's and NumPy's generators reseeded, as a fresh interpreter's are, not left in the server's state
    assert all(a != b for a, b in zip(first["random"], second["random"], strict=True))
    assert first["threads"] == 1 and first["frozen"] > 100_000 and first["collector"]
    assert first["stdin"] == ""


def test_a_forked_command_reports_its_exit_code_and_its_signal(tmp_path):
    script = "tests.test_preloaded:"
    assert _run(script + "exit_3", cwd=tmp_path)[0] == 3
    code, _, err = _run(script + "raise_error", cwd=tmp_path)
    assert code == 1 and "ValueError: broken" in err  # the interpreter's own traceback and exit status
    assert _run(script + "killed", cwd=tmp_path)[0] == -signal.SIGKILL


def exit_3() -> None:
    sys.exit(3)


def raise_error() -> None:
    raise ValueError("broken")


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_another_thread_count_or_the_switch_gets_a_fresh_interpreter(tmp_path, monkeypatch):
    assert preloaded.command(["fit"], tmp_path, cli_env(OMP_NUM_THREADS="2"), ROOT, cli_env()) is None
    assert preloaded.command(["fit"], tmp_path, cli_env(IMGCLS_TEST_FRESH_INTERPRETERS="1"), ROOT, cli_env()) is None
    monkeypatch.setenv("IMGCLS_TEST_FRESH_INTERPRETERS", "1")
    assert preloaded.command(["fit"], tmp_path, cli_env(), ROOT, cli_env()) is None


def test_the_process_model_never_depends_on_timing(tmp_path):
    """A second command while one runs, and a server that died, fail loudly: no silent fall-back to a fresh
    interpreter, so a test runs the same way in every run."""
    first = preloaded.command(["tests.test_preloaded:facts"], tmp_path, cli_env(), ROOT, cli_env(),
                              entry="tests.test_preloaded:sleeper")
    assert first is not None
    with pytest.raises(RuntimeError, match="a second imgcls command while one runs"):
        preloaded.command(["fit"], tmp_path, cli_env(), ROOT, cli_env())
    first.communicate(timeout=60)
    server = preloaded._SERVER
    server.proc.kill()
    server.proc.wait()
    try:
        with pytest.raises(RuntimeError, match="the preloaded imgcls server of this test process exited"):
            preloaded.command(["fit"], tmp_path, cli_env(), ROOT, cli_env())
    finally:
        preloaded._SERVER = None  # the next test of this worker starts a new one


def sleeper() -> None:
    time.sleep(2)


@pytest.mark.slow
def test_a_fit_forked_by_the_server_equals_one_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """The same 2-process DDP fit both ways (rank 1 forked by the server as well, or both fresh interpreters): the same
    weights, the same lines printed (Lightning's hint quotes the command it was started with; its rank_zero_only
    lines come from rank 0 alone)."""
    data = make_image_folder(tmp_path / "data", {"a": 8, "b": 8}, size=32)
    outputs, weights = [], []
    for name in ("preloaded", "fresh"):
        run = tmp_path / name
        args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(data),
                "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run)]
        env = cli_env(MASTER_PORT=str(free_port()))
        if name == "preloaded":
            command = preloaded.command(args, ROOT, env, ROOT, cli_env())
            out, err = command.communicate(timeout=300)
            assert command.returncode == 0, err[-3000:]
            assert command.ranks == 1  # rank 1 forked by the server too, not started as a fresh interpreter
        else:
            monkeypatch.setenv("IMGCLS_TEST_FRESH_INTERPRETERS", "1")
            proc = run_cli(*args, env=env, timeout=300)
            out, err = proc.stdout, proc.stderr
        # The ranks' lines interleave as they come; the second run finds the first one's scan cache.
        outputs.append(sorted(line.replace(str(run), "RUN") for line in (out + err).splitlines()
                              if not line.startswith("data: start scan")))
        weights.append(torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])
    assert max_diff(*weights) == 0
    assert outputs[0] == outputs[1]
    assert "resolved config RUN/config.yaml" in outputs[0] and "[rank: 1] Seed set to 42" in outputs[0]


def rank_of_its_own() -> None:
    """A command's entry point: starts DDP rank 1 as Lightning's launcher does (`sys.executable -m imgcls ARGS`,
    the rank's environment), which waits for a rank 0 that never comes, and waits for it."""
    env = dict(os.environ, LOCAL_RANK="1", NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    subprocess.Popen([sys.executable, "-m", "imgcls", *sys.argv[1:]], env=env).wait()


def trial_of_its_own() -> None:
    """A command's entry point: starts a sweep trial as `imgcls sweep` does (`sys.executable` and the launcher that
    imgcls hands the sweep, `fit ...`), here without the sweep's $IMGCLS_SWEEP_TRIAL, and exits with its status."""
    from imgcls.commands import TRIAL_LAUNCHER

    env = {k: v for k, v in os.environ.items() if k != "IMGCLS_SWEEP_TRIAL"}
    sys.exit(subprocess.call([sys.executable, *TRIAL_LAUNCHER, "fit", "--print_config"], env=env))


def test_a_sweep_trial_is_forked_by_the_server_and_runs_its_modules_main(tmp_path):
    command = preloaded.command(["sweep"], tmp_path, cli_env(), ROOT, cli_env(),
                                entry="tests.test_preloaded:trial_of_its_own")
    _, err = command.communicate(timeout=60)
    assert command.ranks == 1  # forked by the server, not started as a fresh interpreter
    # training.sweeps.trial's main ran (imgcls.trial's command): it reads the sweep's spec before anything else
    assert command.returncode == 1 and "KeyError: 'IMGCLS_SWEEP_TRIAL'" in err, err[-2000:]


def _children_of(parent: int) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes' parents in /proc")
def test_a_rank_the_server_forks_dies_with_the_job_that_started_it(tmp_path):
    """Killing the command's session (what a timeout does, and a test of a killed job) kills the ranks its launcher
    had the server fork, though they live outside that session: each one dies with its launcher."""
    data = make_image_folder(tmp_path / "data", {"a": 2, "b": 2}, size=32)
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(data),
            "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path / "run")]
    command = preloaded.command(args, tmp_path, cli_env(MASTER_PORT=str(free_port())), ROOT,
                                cli_env(), entry="tests.test_preloaded:rank_of_its_own")
    server = preloaded._SERVER.proc.pid
    deadline = time.monotonic() + 60
    while not (ranks := [pid for pid in _children_of(server) if pid != command.pid]):
        assert time.monotonic() < deadline, "no rank forked by the server"
        time.sleep(0.1)
    os.killpg(command.pid, signal.SIGKILL)
    command.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), f"rank {ranks} outlived its job"
