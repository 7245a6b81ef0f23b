"""One writer per run: a fit holds its run folder (an OS lock, and a lease for file systems whose locks cannot be
trusted); a second fit refuses in one line (exit 75) and writes nothing, a crashed fit's folder is free at once, a
stale lease is taken over, validate works beside a running fit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    ROOT,
    cli_env,
    concurrent_python,
    fit_run,
    free_port,
    kill_args,
    make_image_folder,
    resume_config,
    run_cli,
)
from training.resume.hold import LOCK_FILE, Lease, RunFolderHeld, RunHold, this_process, verdict, write_lease

HELD = 75  # training/cli/errors.py's EXIT_CODES
HOST = socket.gethostname()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"), {"a": 16, "b": 16}, size=32)


def _config(folder: Path, data: Path, workers: int = 0) -> Path:
    cfg = resume_config()  # 2 epochs of 4 steps, a step checkpoint every 2
    cfg["data"].update(root=str(data), batch_size=8, num_workers=workers, image_size=32)
    path = folder / f"config{workers}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plant(folder: Path, **fields) -> Lease:
    """A lease of another process written into `folder`'s lock file, as that process would have left it."""
    now = time.time()
    lease = Lease(**{"host": "elsewhere", "pid": 4242, "started": now - 3600, "renewed": now, **fields})
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        write_lease(fd, lease)
    finally:
        os.close(fd)
    return lease


def _lease_seen_from_another_process(folder: Path) -> dict:
    # Never opened here while this process holds it: a POSIX lock goes when its process closes any descriptor of it.
    return json.loads(subprocess.run(["cat", str(folder / LOCK_FILE)], capture_output=True, text=True).stdout)


def _hold_in_another_process(folder: Path) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys, time
        from training.resume.hold import RunHold
        RunHold({str(folder)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_who_may_take_a_folder_from_its_lease():
    me = this_process(time.time())
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = Lease("elsewhere", 4242, me.renewed - 3600, me.renewed - 5)
    assert verdict(None, me, 60) == ""
    assert verdict(other, me, 60) is None  # fresh, from a host whose processes this one cannot see
    assert verdict(Lease(**{**other.__dict__, "renewed": me.renewed - 61}), me, 60).startswith("its lease lapsed")
    assert verdict(Lease(HOST, gone.pid, me.started, me.renewed), me, 60) == f"its process {gone.pid} is gone"
    assert verdict(Lease(HOST, os.getppid(), me.started, me.renewed), me, 60) is None  # alive here
    # A pid that now names another process (started at another time) is not the holder.
    assert verdict(Lease(HOST, os.getppid(), me.started, me.renewed, process_start="1"), me, 60) is not None
    # SLURM: an earlier run of the same job, requeued (its restart count is lower), is gone wherever it ran; the same
    # run of the job (a second step in one allocation) is another writer.
    slurm = Lease(**{**me.__dict__, "slurm_job": "77", "slurm_restart": "1"})
    assert "requeued" in verdict(Lease(**{**other.__dict__, "slurm_job": "77", "slurm_restart": "0"}), slurm, 60)
    assert verdict(Lease(**{**other.__dict__, "slurm_job": "77", "slurm_restart": "1"}), slurm, 60) is None


def test_a_held_folder_refuses_another_process_and_is_free_at_once_when_it_is_killed(tmp_path, caplog):
    holder = _hold_in_another_process(tmp_path)
    try:
        with pytest.raises(RunFolderHeld) as refused:
            RunHold(tmp_path).acquire()
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(_lease_seen_from_another_process(tmp_path)["started"]))
        assert str(refused.value).startswith(f"run folder {tmp_path} is held by another fit: pid {holder.pid} on host "
                                             f"{HOST}, since {since}")
        assert str(refused.value).endswith("; wait for it to end, or start a separate run with a new "
                                           "--trainer.default_root_dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    hold = RunHold(tmp_path)
    hold.acquire()  # at once: the kernel dropped the lock, and the lease's process is gone
    hold.release()
    assert f"took over run folder {tmp_path} from pid {holder.pid} on host {HOST}: its process {holder.pid} is gone" \
        in caplog.text


def test_a_lease_is_renewed_while_held_and_freed_on_release(tmp_path, caplog):
    hold = RunHold(tmp_path, timeout_s=0.3)
    hold.acquire()
    try:
        first = _lease_seen_from_another_process(tmp_path)
        assert (first["pid"], first["host"]) == (os.getpid(), HOST)
        time.sleep(0.5)
        assert _lease_seen_from_another_process(tmp_path)["renewed"] > first["renewed"]
        with pytest.raises(RunFolderHeld):  # this process's own second hold of it
            RunHold(tmp_path).acquire()
    finally:
        hold.release()
    assert _lease_seen_from_another_process(tmp_path) == {}
    with RunHold(tmp_path):  # a released folder is taken without a word
        pass
    assert "took over" not in caplog.text


def test_a_lease_from_a_file_system_without_locks_refuses_while_fresh_and_is_taken_over_once_stale(tmp_path, caplog):
    """The lock is free (no process holds it, as on a network file system mounted without locks): the lease
    decides."""
    _plant(tmp_path)
    with pytest.raises(RunFolderHeld, match=r"pid 4242 on host elsewhere, since .* \(its lease, renewed 0 s ago, "
                                            r"lapses 2 s after its last renewal: rerun then if that fit is gone\)"):
        RunHold(tmp_path, timeout_s=2).acquire()
    _plant(tmp_path, renewed=time.time() - 3)
    hold = RunHold(tmp_path, timeout_s=2)
    hold.acquire()
    hold.release()
    assert (f"took over run folder {tmp_path} from pid 4242 on host elsewhere: its lease lapsed (renewed 3 s ago, "
            "trainer.lease_timeout_s=2)") in caplog.text


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_second_fit_into_a_running_one_refuses_in_one_line_and_writes_nothing_while_validate_works(tmp_path, data):
    """The first fit pauses after step 3 (step 2's checkpoint written); a second fit into its folder exits 75 with
    one line and leaves every file of the run as it was; validate of the held run writes its own files; then the
    first fit ends as if alone."""
    config, run = _config(tmp_path, data), tmp_path / "run"
    stamp, go = tmp_path / "paused", tmp_path / "go"
    pause = ["--trainer.callbacks+=tests.fault_injection.PauseAt", "--trainer.callbacks.step", "3",
             "--trainer.callbacks.stamp", str(stamp), "--trainer.callbacks.until", str(go)]
    # A lease renewed every 200 s: nothing of the first fit changes while it pauses.
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(run), "--trainer.lease_timeout_s", "600"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([concurrent_python(), "-m", "imgcls", *args, *pause], cwd=ROOT,
                                 env=cli_env(MASTER_PORT=str(free_port())), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not stamp.exists():
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        before, holder = _snapshot(run), int(stamp.read_text())
        assert "checkpoints/step0000002.ckpt" in before

        second = run_cli(*args, check=False)
        assert second.returncode == HELD, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("imgcls: error:")]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert re.fullmatch(rf"imgcls: error: run folder {run} is held by another fit: pid {holder} on host "
                            rf"{HOST}, since [-\d]+ [:\d]+; wait for it to end, or start a separate run with a new "
                            r"--trainer.default_root_dir", errors[0]), errors[0]
        assert _snapshot(run) == before  # no checkpoint, no curve, no config change

        validated = run_cli("validate", "--config", str(config), "--trainer.default_root_dir", str(run),
                            "--ckpt_path", "last")
        assert "val/acc" in validated.stdout
        assert {k: v for k, v in _snapshot(run).items() if k in before} == before
    finally:
        go.touch()
    assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()[-3000:]


def test_a_fit_killed_with_sigkill_leaves_its_folder_free_at_once(tmp_path, data):
    """kill -9 mid-epoch, with loader workers (forked with the lock file open): the same command right after takes
    the folder over and resumes."""
    config, run = _config(tmp_path, data, workers=2), tmp_path / "run"
    killed = fit_run(config, run, *kill_args(3, "train"), check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    pid = _lease_seen_from_another_process(run)["pid"]
    resumed = fit_run(config, run)
    output = resumed.stdout + resumed.stderr
    assert f"took over run folder {run} from pid {pid} on host {HOST}: its process {pid} is gone" in output
    assert f"resuming from {run / 'checkpoints' / 'step0000002.ckpt'} (auto_resume)" in output


def test_a_fit_refuses_a_fresh_lease_of_another_host_and_takes_a_stale_one_over(tmp_path, data):
    """`trainer.lease_timeout_s` is how long a lease outlives its holder's last renewal."""
    config, run = _config(tmp_path, data), tmp_path / "run"
    _plant(run)
    refused = fit_run(config, run, "--trainer.lease_timeout_s", "30", check=False)
    assert refused.returncode == HELD, refused.stderr[-3000:]
    assert "pid 4242 on host elsewhere" in refused.stderr and "lapses 30 s after its last renewal" in refused.stderr
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]

    _plant(run, renewed=time.time() - 40)
    taken = fit_run(config, run, "--trainer.lease_timeout_s", "30")
    assert re.search(rf"took over run folder {run} from pid 4242 on host elsewhere: its lease lapsed \(renewed \d+ s "
                     r"ago, trainer.lease_timeout_s=30\)", taken.stdout + taken.stderr)
    assert (run / "checkpoints" / "last.ckpt").exists()
