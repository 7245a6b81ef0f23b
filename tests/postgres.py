"""A throwaway PostgreSQL server from Debian's packages, for the sweep tests and the sweep-retry benchmark: its own
data directory, its own port on 127.0.0.1 (no Unix socket), a role with a password, stopped at the end.

    with throwaway_server(folder) as server:        # raises Unavailable where no server is installed
        url = server.database("sweeps")             # postgresql://imgcls:<password>@127.0.0.1:<port>/sweeps

PostgreSQL refuses to run as root: as root the server runs as the `postgres` user that Debian's package creates, its
data directory in a folder of the temp directory that it owns (one under the caller's folder may sit below a folder
that only root may enter); as anyone else, in `folder`. Its log is `folder/postgres.log` either way.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import apt_install, free_port

PACKAGES = ("postgresql",)  # Debian's: the server of its default version (bookworm: 15) and the client
SERVICE_USER = "postgres"  # the system user Debian's package creates; the server's user when this runs as root


def ensure_installed() -> None:
    """Install Debian's server where none is, before a test that uses it, whichever test file runs first; where that
    cannot be, `apt_install` skips the test (fails it under CI=true)."""
    if server_bin() is None:
        apt_install(PACKAGES, "PostgreSQL's server is not installed")


class Unavailable(RuntimeError):
    """No PostgreSQL server can run here; the message says why."""


def server_bin() -> Path | None:
    """The folder of the newest installed server's programs (Debian keeps them out of PATH, in
    /usr/lib/postgresql/<version>/bin); else the one holding `initdb` on PATH; None where there is none."""
    versions = [p for p in Path("/usr/lib/postgresql").glob("*/bin/postgres") if p.parents[1].name.isdigit()]
    found = sorted(versions, key=lambda p: int(p.parents[1].name))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and (Path(initdb).parent / "postgres").is_file() else None


def _stop_with_parent() -> None:
    """In the server's process before exec (after its change of user, which would clear it): a fast shutdown when
    the process that started it dies, even of SIGKILL or a timeout's SIGTERM."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


class Server:
    """A running server: `database(name)` creates a database and returns its URL, password included."""

    user = "imgcls"

    def __init__(self, folder: Path, bin_dir: Path) -> None:
        self.folder, self.bin = folder, bin_dir
        self.password = secrets.token_urlsafe(18)
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            try:
                self.owner = pwd.getpwnam(SERVICE_USER)
            except KeyError:
                raise Unavailable(f"running as root, and there is no `{SERVICE_USER}` user to run PostgreSQL as "
                                  f"(Debian's package creates it)") from None
            self.home = Path(tempfile.mkdtemp(prefix="imgcls-postgres-"))
            os.chown(self.home, self.owner.pw_uid, self.owner.pw_gid)
        else:
            self.owner, self.home = None, folder / "server"
            self.home.mkdir()
        self.data = self.home / "data"
        self.log = folder / "postgres.log"
        self.process: subprocess.Popen | None = None

    def url(self, database: str) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, **popen) -> subprocess.Popen:
        user = {"user": self.owner.pw_uid, "group": self.owner.pw_gid, "extra_groups": []} if self.owner else {}
        with open(self.log, "ab") as log:
            return subprocess.Popen([str(self.bin / args[0]), *args[1:]], cwd=self.home, stdout=log,
                                    stderr=subprocess.STDOUT, **user, **popen)

    def start(self, timeout: float = 60) -> None:
        """initdb (the role `user` with its password, which only a password lets in), then the server."""
        password_file = self.home / "password"
        password_file.write_text(self.password)
        if self.owner:
            os.chown(password_file, self.owner.pw_uid, self.owner.pw_gid)
        password_file.chmod(0o600)
        code = self._run("initdb", "-D", str(self.data), "-U", self.user, f"--pwfile={password_file}",
                         "--auth=scram-sha-256", "-E", "UTF8", "--no-instructions").wait(timeout)
        password_file.unlink()
        if code != 0:
            raise Unavailable(f"initdb exited with {code}; see {self.log}")
        # A test's database: durability traded for speed (no fsync), no Unix socket, loopback only.
        self.process = self._run("postgres", "-D", str(self.data), "-p", str(self.port), "-c",
                                 "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=", "-c", "fsync=off",
                                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c",
                                 "shared_buffers=16MB", start_new_session=True, preexec_fn=_stop_with_parent)
        deadline = time.monotonic() + timeout
        while not self._execute("SELECT 1"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"the PostgreSQL server did not start; see {self.log}")
            time.sleep(0.2)

    def _execute(self, sql: str) -> bool:
        """Run `sql` in the database `postgres`; False where the server does not answer (yet)."""
        import psycopg

        try:
            with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=5) as connection:
                connection.execute(sql)
        except psycopg.OperationalError:
            return False
        return True

    def database(self, name: str) -> str:
        """Create the database `name` (owned by `user`); its URL."""
        assert self._execute(f'CREATE DATABASE "{name}"'), f"the server stopped answering; see {self.log}"
        return self.url(name)

    def stop(self) -> None:
        """A fast shutdown (SIGINT: clients disconnected, the server stopped), then the data directory removed."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.home if self.as_root else self.data, ignore_errors=True)


@contextlib.contextmanager
def throwaway_server(folder: Path) -> Iterator[Server]:
    """A PostgreSQL server up for the `with` block, stopped and its data removed afterwards; raises Unavailable where
    none is installed or it cannot start."""
    bin_dir = server_bin()
    if bin_dir is None:
        raise Unavailable(f"PostgreSQL's server is not installed (Debian: apt-get install {' '.join(PACKAGES)})")
    server = Server(folder, bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
