"""One writer per run: a fit holds its run folder while it runs, and a second fit into it refuses in one line.

The hold is an OS lock on `<run>/.imgcls-fit.lock` (`fcntl.lockf`, a POSIX record lock), which the kernel releases
when the process ends, a kill -9 included: a crashed run's folder is free at once. A POSIX lock belongs to the process,
so the loader workers it forks never keep it alive after it. The file also holds a lease, {host, pid, started,
renewed}, which a thread of the holder renews every third of `lease_timeout_s`: where locks cannot be trusted (a
network file system mounted without them), a fit still refuses while the lease is fresh, and takes over a lease that
lapsed, one whose process is gone on this host, or one of an earlier run of the same SLURM job (a requeue).

Only global rank 0 of a job holds the folder (the ranks of one job are one writer); validate, test and predict never
take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

LOCK_FILE = ".imgcls-fit.lock"
LEASE_TIMEOUT_S = 60.0  # trainer.lease_timeout_s's default
RECORD_BYTES = 512  # the lease is rewritten in place, one write of this many bytes: never half a record


class RunFolderHeld(RuntimeError):
    """Another fit holds the run folder (exit 75: retry once it has ended, or start a separate run)."""


@dataclass(frozen=True)
class Lease:
    """Who holds a run folder, and when it last said it is alive (seconds since the epoch)."""

    host: str
    pid: int
    started: float
    renewed: float
    process_start: str | None = None  # /proc/PID/stat's start time: a reused pid is not the holder
    slurm_job: str | None = None
    slurm_restart: str | None = None  # SLURM_RESTART_COUNT: a requeued job's count is higher


def this_process(now: float) -> Lease:
    return Lease(socket.gethostname(), os.getpid(), now, now, _process_start(os.getpid()),
                 os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0"))


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else fields[19]  # a zombie has ended; field 22 of the line is the start time


def _alive_here(lease: Lease) -> bool:
    """Whether the lease's process still runs on this host (a pid now used by another process does not count)."""
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    started = _process_start(lease.pid)
    return not (Path("/proc").is_dir() and started is None) and (lease.process_start in (None, started))


def verdict(lease: Lease | None, me: Lease, timeout_s: float) -> str | None:
    """Why `me` may take a folder whose lease is `lease` (None: it may not), "" where it was free."""
    if lease is None:
        return ""
    if lease.host == me.host and lease.pid == me.pid:
        return ""
    if lease.host == me.host and not _alive_here(lease):
        return f"its process {lease.pid} is gone"
    if lease.slurm_job and lease.slurm_job == me.slurm_job and lease.slurm_restart != me.slurm_restart:
        return f"it was an earlier run of SLURM job {lease.slurm_job}, requeued"
    age = me.renewed - lease.renewed
    if age > timeout_s:
        return f"its lease lapsed (renewed {age:.0f} s ago, trainer.lease_timeout_s={timeout_s:g})"
    return None


def held_message(folder: Path, lease: Lease | None, lock_held: bool, timeout_s: float, now: float) -> str:
    """The refusal: who holds `folder` and since when (`lock_held`: the OS lock says it runs), and what to do."""
    if lease is None:
        who = "another process (its lease is unreadable)"
    else:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.started))
        who = f"pid {lease.pid} on host {lease.host}, since {since}"
        if not lock_held:  # only the lease says so: on a file system without locks, that process may be gone
            who += (f" (its lease, renewed {now - lease.renewed:.0f} s ago, lapses {timeout_s:g} s after its last "
                    "renewal: rerun then if that fit is gone)")
    return (f"run folder {folder} is held by another fit: {who}; wait for it to end, or start a separate run with a "
            "new --trainer.default_root_dir")


class RunHold:
    """The hold of one run folder by this process: `acquire` (RunFolderHeld if another fit has it), `release`."""

    _held_here: set[Path] = set()  # folders this process holds: a second lock of its own would pass, then drop both

    def __init__(self, folder: str | os.PathLike, timeout_s: float = LEASE_TIMEOUT_S) -> None:
        self.folder, self.timeout_s = Path(folder), timeout_s
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._lease: Lease | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        key = self.folder.resolve()
        now = time.time()
        if key in RunHold._held_here:
            raise RunFolderHeld(held_message(self.folder, this_process(now), True, self.timeout_s, now))
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = self._lock(fd)
            lease, me = read_lease(fd), this_process(now)
            why = verdict(lease, me, self.timeout_s) if locked is not False else None
            if why is None:
                raise RunFolderHeld(held_message(self.folder, lease, locked is False, self.timeout_s, now))
        except BaseException:
            os.close(fd)  # and with it this process's lock
            raise
        if why:
            rank_zero_info(f"took over run folder {self.folder} from pid {lease.pid} on host {lease.host}: {why}")
        self._fd, self._lease = fd, me
        write_lease(fd, me)
        RunHold._held_here.add(key)
        self._renewer = threading.Thread(target=self._renew, name="imgcls-run-lease", daemon=True)
        self._renewer.start()

    @staticmethod
    def _lock(fd: int) -> bool | None:
        """True: locked; False: another process holds the lock; None: this file system cannot lock (a network one
        mounted without locks), and the lease alone decides."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            return False
        except OSError:
            return None
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.timeout_s / 3):
            self._lease = Lease(**{**asdict(self._lease), "renewed": time.time()})
            with contextlib.suppress(OSError):  # a full disk cannot take a rewrite in place; the lock still holds
                write_lease(self._fd, self._lease)

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        self._renewer.join()
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, b"{}".ljust(RECORD_BYTES), 0)  # free: the next fit takes it without a word
        os.close(self._fd)
        RunHold._held_here.discard(self.folder.resolve())
        self._fd = None

    def __enter__(self) -> RunHold:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_lease(fd: int) -> Lease | None:
    """The lease in the lock file, None where there is none (a new or released folder) or it cannot be read."""
    try:
        record = json.loads(os.pread(fd, RECORD_BYTES, 0).decode() or "{}")
        return Lease(**record) if record else None
    except (OSError, ValueError, TypeError):
        return None


def write_lease(fd: int, lease: Lease) -> None:
    record = json.dumps(asdict(lease)).encode()
    os.pwrite(fd, record.ljust(RECORD_BYTES), 0)
    os.fsync(fd)
