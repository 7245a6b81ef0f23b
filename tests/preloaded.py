"""`imgcls` processes for the tests without an interpreter start each: a server that has imported the CLI forks one
process per command (a "zygote", as Android and Chromium start their apps, or multiprocessing's forkserver).

Every `imgcls` process spends ~4.5 s of CPU importing torch, Lightning, torchmetrics and torchvision before it does
anything, and the suite starts about seventy of them from its own workers: on two cores that is minutes of a
suite that must stay within its time budget. `tests.helpers.run_cli` therefore asks this server (one per pytest
worker) for each command. The forked process is what `python -m imgcls ARGS` is once its imports are done:

- its own pid, in a new session (a timeout kills its DDP ranks with it), its own working directory, environment,
  stdout and stderr (files, read back by the test), and its exit status, a signal's as -N;
- `sys.argv` and `__main__` as under `python -m imgcls`, so that Lightning's launcher starts the other DDP
  ranks with the same command; the `sys.executable` of that command is LAUNCHER, which has the server fork each
  rank, and each trial of `imgcls sweep`, as well (with the launcher's stdin, stdout, stderr and environment), stands
  in for it (its exit status, the signals sent to it) and takes it along when it dies;
- the imports done with the collector off and then frozen, as imgcls/startup.py does them;
- the random generators reseeded from the OS, as a fresh interpreter's are (a fork would share the server's);
- it exits as the process it stands for exits (an `imgcls` command through imgcls.startup.run: exit functions
  run, streams flushed, its heap left to the OS), or dies of its signal.

What differs: the imports ran once, in an environment the test's may not match where the libraries read it at import
time. Two things are read that way here. The thread count, kernels and OpenMP's wait (IMPORTED below): a command or
rank whose environment asks for others than the server's gets a fresh interpreter, as every command does when
IMGCLS_TEST_FRESH_INTERPRETERS=1 (the real start, for a suspicious difference), and tests/test_preloaded.py checks
that both give the same run. And the rank of the process (Lightning's rank_zero_only), which a forked process sets
from its own environment.

Which of the two runs a command is decided by the test's own inputs alone (the switch, the command's environment,
a stand-in interpreter): never by timing. A server that died, or a second command while one runs (one per server),
fails the test loudly instead of falling back to the other model. A test that starts several `imgcls` processes at
once runs them with `launcher()` as their interpreter: each is forked as a DDP rank is.

    python -m tests.preloaded     # the server: JSON requests on stdin, a JSON reply per line on stdout; the ranks'
                                  # launchers on a Unix socket
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

# The thread count OpenMP took when the server imported torch; a command's environment must agree.
THREADS = "1"
# What torch (and its OpenMP) reads from the environment when it is imported: a process that asks for other values
# is not forked.
IMPORTED = ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Where lightning.fabric.utilities.rank_zero looks for the process's rank on import, in its order.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
# The `python -m MODULE` processes a command starts that the server forks too: DDP ranks, sweep trials (which
# start DDP ranks of their own with `-m imgcls.trial`), torchrun's workers (tests.helpers.torchrun), and
# `make gpu-check --dry-run` (whose imgcls fits are then forked too) and the benchmarks' helper processes; each
# module's entry once its imports are done.
ENTRIES = {"imgcls.__main__": "imgcls.commands:main", "imgcls.trial": "training.sweeps.trial:main",
           "tests.per_rank_run_dir": "tests.per_rank_run_dir:main", "benchmarks.gpu_check": "benchmarks.gpu_check:main",
           "benchmarks.plain_loop": "benchmarks.plain_loop:main", "benchmarks.serve": "benchmarks.serve:cli"}
# The ones whose `python -m` run ends through imgcls.startup.run, as an imgcls process's does.
STARTED = ("imgcls.__main__", "imgcls.trial")
MODULES = ("imgcls", *ENTRIES)  # `-m imgcls` (a user, a test), `-m imgcls.__main__` (Lightning)


def serve() -> None:
    """Import the CLI as `python -m imgcls` does, then answer requests until stdin closes: the test's commands on
    stdin, and on a socket the DDP ranks that Lightning's launcher starts from a command (RANKS)."""
    from imgcls.startup import begin, done

    begin()
    import imgcls.commands  # noqa: F401

    done()
    # The protocol moves off fds 0 and 1, which each forked command points at its own files.
    requests, replies = os.dup(0), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    folder = Path(tempfile.mkdtemp(prefix="imgcls-preloaded-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "ranks.sock"))
    listener.listen()
    launcher = _write_launcher(folder)
    replies.write(json.dumps({"launcher": str(launcher)}) + "\n")
    replies.flush()
    children: dict[int, socket.socket | None] = {}  # a forked process -> the launcher waiting for it (None: a command)
    ended: dict[int, int] = {}  # a command's exit status, until the test asks for it
    awaited: set[int] = set()
    ranks = 0  # forked for the command that runs (one at a time): told with its exit status
    buffered = b""
    killed: set[int] = set()  # forked processes whose launcher died, killed with their process group
    while True:
        launchers = {c: pid for pid, c in children.items() if c is not None and pid not in killed}
        ready, _, _ = select.select([requests, listener, *launchers], [], [], 0.05 if children else None)
        for pid in (launchers[c] for c in ready if c in launchers):
            # The launcher sends nothing after its request: its end closed, it was killed. Its process goes, and the
            # processes that one started (a server's workers), as a kill of the launcher's group takes a fresh one's.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            killed.add(pid)
        for pid, code in _reap(children):  # (a SIGCHLD would interrupt the select: polling keeps it simple)
            killed.discard(pid)
            launched = children.pop(pid)
            if launched is not None:
                _send(launched, {"returncode": code})
                launched.close()
            else:
                ended[pid] = code
        if listener in ready:
            launched, _ = listener.accept()
            others = [c.fileno() for c in children.values() if c is not None]
            pid = _fork_rank(launched, launcher, (requests, replies.fileno(), listener.fileno(), *others))
            if pid is not None:
                children[pid] = launched
                ranks += 1
        if requests in ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the test process ended: the socket and the launcher go with the server
                shutil.rmtree(folder, ignore_errors=True)
                return
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if request["op"] == "run":
                    pid = os.fork()
                    if pid == 0:
                        for launched in filter(None, children.values()):
                            launched.close()
                        os.close(requests)
                        replies.close()
                        listener.close()
                        _command(request, launcher)  # raises SystemExit, as the interpreter's exit
                    children[pid], ranks = None, 0
                    # A fork copies only the forking thread: a lock another thread held stays locked in the child.
                    # The imports start none; tests/test_preloaded.py checks it with this count.
                    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc") else None
                    replies.write(json.dumps({"pid": pid, "threads": threads}) + "\n")
                else:  # "wait": the exit status of a command this server forked
                    awaited.add(request["pid"])
        for pid in awaited & ended.keys():
            awaited.discard(pid)
            replies.write(json.dumps({"returncode": ended.pop(pid), "ranks": ranks}) + "\n")
        replies.flush()


def _reap(children: dict) -> list[tuple[int, int]]:
    done = []
    for pid in list(children):
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the launcher was killed: nobody waits for the answer
        pass


# What Lightning's launcher runs for each other DDP rank: `sys.executable -m imgcls.__main__ ARGS` with the rank's
# environment (and `imgcls sweep` for each trial: `sys.executable -m imgcls.trial ARGS`). In a forked command
# sys.executable is this small script, which asks the server to fork the process, as it forked the command, and stands
# in for it: its exit status (a signal's as the same signal) and the signals it gets go through it. Anything else it
# is asked to run (a compile worker, a spawned loader), and a process whose environment the server's imports do not
# match, gets the real interpreter by exec.
LAUNCHER = """#!{python} -S
import json, os, signal, socket, struct, sys
args = sys.argv[1:]
if (args[:1] != ["-m"] or args[1:2] not in {modules!r} or {{k: os.environ.get(k) for k in {imported!r}}} != {imported!r}
        or os.environ.get("IMGCLS_TEST_FRESH_INTERPRETERS") == "1"):
    os.execv({python!r}, [{python!r}, *args])
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.connect({socket!r})
body = json.dumps({{"module": args[1], "args": args[2:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
socket.send_fds(server, [struct.pack("!Q", len(body))], [0, 1, 2])
server.sendall(body)
answers = server.makefile("r")
pid = json.loads(answers.readline())["pid"]
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, forward)
code = json.loads(answers.readline())["returncode"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _write_launcher(folder: Path) -> Path:
    path = folder / "python"
    path.write_text(LAUNCHER.format(python=sys.executable, imported=_imported(os.environ),
                                    socket=str(folder / "ranks.sock"), modules=[[module] for module in MODULES]))
    path.chmod(0o755)
    return path


def _fork_rank(launched: socket.socket, launcher: Path, server_fds: tuple[int, ...]) -> int | None:
    """Fork the rank a launcher asks for, with the launcher's stdin, stdout and stderr; its pid, told the launcher
    too. The rank dies with its launcher (Lightning kills a rank's process, a test the job's session): the launcher's
    end of the socket closing sends the rank SIGIO, whose default action ends it."""
    header, fds, _, _ = socket.recv_fds(launched, 8, 3)
    if len(header) < 8:  # the launcher died before it asked
        launched.close()
        return None
    (length,) = struct.unpack("!Q", header)
    body = b""
    while len(body) < length:
        body += launched.recv(length - len(body))
    request = json.loads(body)
    pid = os.fork()
    if pid == 0:
        for fd in server_fds:
            os.close(fd)
        fcntl.fcntl(launched, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(launched, fcntl.F_SETFL, fcntl.fcntl(launched, fcntl.F_GETFL) | os.O_ASYNC)
        if select.select([launched], [], [], 0)[0]:  # the launcher died before the SIGIO was set up
            os._exit(1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _become(request, launcher)
    for fd in fds:
        os.close(fd)
    _send(launched, {"pid": pid})
    return pid


def _command(request: dict, launcher: Path) -> None:
    """In the forked child: become `python -m imgcls ARGS` in the request's session, folder and environment."""
    opened: dict[str, int] = {}  # one file open once, where stdout and stderr both go to it
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened[path], fd)
    for opened_fd in opened.values():
        os.close(opened_fd)
    _become(request, launcher)


def _become(request: dict, launcher: Path) -> None:
    import numpy as np
    from lightning_utilities.core.rank_zero import rank_zero_only

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    np.random.seed()  # (Python's `random` reseeds itself in a forked child; NumPy's global generator does not)
    # Lightning reads the process's rank from the environment on import, for rank_zero_only (documented: "set
    # rank_zero_only.rank before use"): a forked rank reads its own, from the variables Lightning's import reads.
    rank = next((os.environ[key] for key in RANK_VARIABLES if key in os.environ), "0")
    rank_zero_only.rank = int(rank)
    # __main__ as `python -m MODULE` leaves it (runpy): the spec of the module it ran, a package's __main__, which
    # Lightning's launcher reads for the ranks' command and a spawned process (a server's workers) for what to import.
    spec = importlib.util.find_spec(request.get("module", "imgcls"))
    if spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{spec.name}.__main__")
    main = types.ModuleType("__main__")
    main.__spec__, main.__file__, main.__loader__, main.__package__ = spec, spec.origin, spec.loader, spec.parent
    sys.argv = [spec.origin, *request["args"]]
    sys.modules["__main__"] = main
    sys.executable = str(launcher)  # ...and sys.executable: the other ranks (and trials) are forked by the server too
    # another entry: tests/test_preloaded.py
    module, _, function = request.get("entry", ENTRIES[spec.name]).partition(":")
    entry = getattr(importlib.import_module(module), function)
    if spec.name in STARTED:
        from imgcls.startup import run

        run(entry)  # its end as the process's: exit functions, streams flushed, no teardown of the heap
    else:
        entry()
    raise SystemExit(0)


class Server:
    """The client: one server process, started on first use, ended when this process exits (its stdin closes)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.preloaded"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lock = threading.Lock()
        self.launcher = Path(self.reply()["launcher"])  # told once its imports are done

    def ask(self, request: dict, timeout: float | None = None) -> dict | None:
        """Send one request; its reply, or None when none came within `timeout` (the reply is then still due)."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout)

    def reply(self, timeout: float | None = None) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded imgcls server exited ({self.proc.wait()}); see its output above")
        return json.loads(line)


class Command:
    """A command forked by the server, used as a subprocess.Popen is: pid, poll(), wait(timeout), communicate(timeout).
    Its stdout and stderr go to files of its own, or both to `log`, which the caller keeps."""

    def __init__(self, server: Server, args: list[str], cwd: Path, env: dict[str, str], entry: str,
                 log: Path | None = None) -> None:
        self.server = server
        self.folder = None if log else Path(tempfile.mkdtemp(prefix="imgcls-cmd-"))
        self.out, self.err = (log, log) if log else (self.folder / "stdout", self.folder / "stderr")
        self.returncode: int | None = None
        self.ranks: int | None = None  # the processes (DDP ranks, sweep trials) its launchers had the server fork
        try:
            reply = server.ask({"op": "run", "entry": entry, "args": args, "cwd": str(cwd), "env": env,
                                "stdout": str(self.out), "stderr": str(self.err)})
            self.pid, self.server_threads = reply["pid"], reply["threads"]
            self.server.proc.stdin.write(json.dumps({"op": "wait", "pid": self.pid}) + "\n")
            self.server.proc.stdin.flush()
        except BaseException:
            server.lock.release()
            raise

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self.server.reply(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(self.server.reply(timeout)):
            raise subprocess.TimeoutExpired(["imgcls"], timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self.folder is None:  # the caller's log holds both
            return self.out.read_text(errors="replace"), ""
        try:
            return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")
        finally:
            for path in (self.out, self.err):
                path.unlink(missing_ok=True)
            self.folder.rmdir()

    def _ended(self, reply: dict | None) -> bool:
        if reply is not None:
            self.returncode, self.ranks = reply["returncode"], reply["ranks"]
            self.server.lock.release()
        return reply is not None


_SERVER: Server | None = None


def _imported(env) -> dict[str, str | None]:
    return {key: env.get(key) for key in IMPORTED}


def _server(root: Path, server_env: dict[str, str]) -> Server:
    """This process's server, started on first use."""
    global _SERVER
    if _SERVER is None:
        _SERVER = Server(root, {**server_env, "OMP_NUM_THREADS": THREADS})
    elif _SERVER.proc.poll() is not None:
        raise RuntimeError(f"the preloaded imgcls server of this test process exited ({_SERVER.proc.returncode}); "
                           "its output is above (IMGCLS_TEST_FRESH_INTERPRETERS=1 runs every command without it)")
    return _SERVER


def launcher(root: Path, server_env: dict[str, str]) -> Path | None:
    """An interpreter for a test's own processes, several at once if need be: `LAUNCHER -m imgcls ARGS` is forked
    by this process's server (as a DDP rank is), anything else runs in the real interpreter; None where every process
    must start a fresh interpreter (IMGCLS_TEST_FRESH_INTERPRETERS=1)."""
    if os.environ.get("IMGCLS_TEST_FRESH_INTERPRETERS") == "1":
        return None
    return _server(root, server_env).launcher


def command(args: list[str], cwd: Path, env: dict[str, str], root: Path, server_env: dict[str, str],
            entry: str = "imgcls.commands:main", log: Path | None = None) -> Command | None:
    """`args` run by this process's server, started on first use; None where a fresh interpreter must run them."""
    if "1" in (os.environ.get("IMGCLS_TEST_FRESH_INTERPRETERS"), env.get("IMGCLS_TEST_FRESH_INTERPRETERS")) \
            or _imported(env) != _imported({**server_env, "OMP_NUM_THREADS": THREADS}):
        return None
    server = _server(root, server_env)
    # One command at a time per server, whose replies come in order.
    if not server.lock.acquire(blocking=False):
        raise RuntimeError("a second imgcls command while one runs: the preloaded server runs one at a time; run "
                           "concurrent ones with launcher() as their interpreter")
    return Command(server, args, cwd, env, entry, log)


if __name__ == "__main__":
    serve()
