"""`imgcls` processes for the tests without an interpreter start each: a server that has imported the CLI forks one
process per command (a "zygote", as Android and Chromium start their apps, or multiprocessing's forkserver).

Every `imgcls` process spends ~4.5 s of CPU importing torch, Lightning, torchmetrics and torchvision before it does
anything, and the suite starts about seventy of them from its own workers: on two cores that is minutes of a
suite that must stay within its time budget. `tests.helpers.run_cli` therefore asks this server (one per pytest
worker) for each command. The forked process is what `python -m training.cli ARGS` is once its imports are done:

- its own pid, in a new session (a timeout kills its DDP ranks with it), its own working directory, environment,
  stdout and stderr (files, read back by the test), and its exit status, a signal's as -N;
- `sys.argv` and `__main__` as under `python -m training.cli`, so that Lightning's launcher starts the other DDP
  ranks with the same command, as fresh interpreters;
- the imports done with the collector off and then frozen, as training/cli/startup.py does them;
- the random generators reseeded from the OS, as a fresh interpreter's are (a fork would share the server's);
- it exits through the interpreter's normal shutdown (atexit handlers, flushed streams), or dies of its signal.

What differs: the imports ran once, in an environment the test's may not match where the libraries read it at
import time. Only the thread count is read that way here (OpenMP's, OMP_NUM_THREADS), and a command whose
environment asks for another one gets a fresh interpreter. So does every command when IMGCLS_TEST_FRESH_INTERPRETERS=1
(the real start, for a suspicious difference), and tests/test_preloaded.py checks that both give the same run.

Which of the two runs a command is decided by the test's own inputs alone (the switch, the command's thread count,
a stand-in interpreter): never by timing. A server that died, or a second command while one runs (one per server),
fails the test loudly instead of falling back to the other model.

    python -m tests.preloaded     # the server: JSON requests on stdin, a JSON reply per line on stdout
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The thread count OpenMP took when the server imported torch; a command's environment must agree.
THREADS = "1"


def serve() -> None:
    """Import the CLI as `python -m training.cli` does, then answer requests until stdin closes."""
    from training.cli.startup import begin, done

    begin()
    import training.cli.app  # noqa: F401

    done()
    # The protocol moves off fds 0 and 1, which each forked command points at its own files.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for line in requests:
        request = json.loads(line)
        if request["op"] == "run":
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                _command(request)  # raises SystemExit: the child leaves this loop through the interpreter's exit
            # A fork copies only the forking thread: a lock another thread held stays locked in the child. The
            # imports start none; tests/test_preloaded.py checks it with this count.
            reply = {"pid": pid, "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc") else None}
        else:  # "wait": the exit status of a command this server forked
            _, status = os.waitpid(request["pid"], 0)
            reply = {"returncode": os.waitstatus_to_exitcode(status)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _command(request: dict) -> None:
    """In the forked child: become `python -m training.cli ARGS` in the request's session, folder and environment."""
    import numpy as np

    import training.cli.app

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    np.random.seed()  # (Python's `random` reseeds itself in a forked child; NumPy's global generator does not)
    sys.argv = [str(Path(training.cli.__file__).with_name("__main__.py")), *request["args"]]
    sys.modules["__main__"] = training.cli  # Lightning's launcher reads __main__.__spec__ for the ranks' command
    # another entry: tests/test_preloaded.py
    module, _, function = request.get("entry", "training.cli.app:main").partition(":")
    getattr(importlib.import_module(module), function)()
    raise SystemExit(0)


class Server:
    """The client: one server process, started on first use, ended when this process exits (its stdin closes)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.preloaded"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lock = threading.Lock()

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
    """A command forked by the server, used as run_cli uses a subprocess.Popen: pid, communicate(timeout)."""

    def __init__(self, server: Server, args: list[str], cwd: Path, env: dict[str, str], entry: str) -> None:
        self.server = server
        self.folder = Path(tempfile.mkdtemp(prefix="imgcls-cmd-"))
        self.out, self.err = self.folder / "stdout", self.folder / "stderr"
        self.returncode: int | None = None
        try:
            reply = server.ask({"op": "run", "entry": entry, "args": args, "cwd": str(cwd), "env": env,
                                "stdout": str(self.out), "stderr": str(self.err)})
            self.pid, self.server_threads = reply["pid"], reply["threads"]
            self.server.proc.stdin.write(json.dumps({"op": "wait", "pid": self.pid}) + "\n")
            self.server.proc.stdin.flush()
        except BaseException:
            server.lock.release()
            raise

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.returncode is None:
            reply = self.server.reply(timeout)
            if reply is None:
                raise subprocess.TimeoutExpired(["imgcls"], timeout)
            self.returncode = reply["returncode"]
            self.server.lock.release()
        try:
            return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")
        finally:
            for path in (self.out, self.err):
                path.unlink(missing_ok=True)
            self.folder.rmdir()


_SERVER: Server | None = None


def command(args: list[str], cwd: Path, env: dict[str, str], root: Path, server_env: dict[str, str],
            entry: str = "training.cli.app:main") -> Command | None:
    """`args` run by this process's server, started on first use; None where a fresh interpreter must run them."""
    global _SERVER
    if "1" in (os.environ.get("IMGCLS_TEST_FRESH_INTERPRETERS"), env.get("IMGCLS_TEST_FRESH_INTERPRETERS")) \
            or env.get("OMP_NUM_THREADS") != THREADS:
        return None
    if _SERVER is None:
        _SERVER = Server(root, {**server_env, "OMP_NUM_THREADS": THREADS})
    elif _SERVER.proc.poll() is not None:
        raise RuntimeError(f"the preloaded imgcls server of this test process exited ({_SERVER.proc.returncode}); "
                           "its output is above (IMGCLS_TEST_FRESH_INTERPRETERS=1 runs every command without it)")
    # One command at a time per server, whose replies come in order.
    if not _SERVER.lock.acquire(blocking=False):
        raise RuntimeError("a second imgcls command while one runs: the preloaded server runs one at a time; give "
                           "the concurrent one IMGCLS_TEST_FRESH_INTERPRETERS=1 in its env")
    return Command(_SERVER, args, cwd, env, entry)


if __name__ == "__main__":
    serve()
