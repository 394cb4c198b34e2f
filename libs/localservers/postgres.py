"""A private PostgreSQL for tests, demos and benchmarks.

Each instance has its own cluster (``initdb`` with trust auth for the ``postgres`` superuser),
listens on 127.0.0.1 only on its own port, and keeps its unix socket inside ``data_dir`` (or in
a short temp dir when that path is too long for a socket), so it cannot touch a PostgreSQL that
the machine may already run. Layout of ``data_dir``::

    pgdata/        the cluster
    postgres.log   server output

PostgreSQL refuses to run as root. When this process is root, ``initdb`` and ``postgres`` run as
an unprivileged OS user: ``postgres`` if it exists, else a ``sluice`` system user created with
``useradd``. ``data_dir`` is then chowned to that user, so every directory above it must be
traversable by it: pytest's ``tmp_path`` (under a 0700 ``/tmp/pytest-of-root``) is not; use a
directory from ``tempfile.mkdtemp()`` instead (as ``tests/fixtures_servers.py`` does).

Test settings: ``fsync=off``, ``full_page_writes=off`` (``synchronous_commit`` stays on). A
SIGKILL of the server (``kill()``) loses no committed transaction with these (the WAL is written
to the OS before a commit returns); only a machine crash could. ``durable=True`` keeps the
defaults.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from libs.localservers.common import find_binary, free_port, wait_until
from libs.process_alive import pid_alive

_PG_DIRS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin", "/usr/pgsql-*/bin", "/usr/local/bin")
_MAX_SOCKET_DIR = 90  # + "/.s.PGSQL.NNNNN" must stay under sun_path's 108 bytes
_FALLBACK_USER = "sluice"


def _run_user() -> pwd.struct_passwd | None:
    """The OS user PostgreSQL runs as, or None to run as ourselves (we are not root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", _FALLBACK_USER):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _FALLBACK_USER],
        check=True, capture_output=True,
    )
    return pwd.getpwnam(_FALLBACK_USER)


def _children(pid: int) -> list[int]:
    """Every live process whose parent is ``pid`` (the postmaster's backends and workers)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


@dataclass
class PostgreSQL:
    data_dir: Path
    port: int = 0
    # More server settings, each passed as ``-c name=value``; they override the defaults below.
    conf: dict[str, str] = field(default_factory=dict)
    durable: bool = False
    start_timeout: float = 60.0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _socket_dir: Path | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ paths

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def socket_dir(self) -> Path:
        if len(str(self.data_dir)) <= _MAX_SOCKET_DIR:
            return self.data_dir
        if self._socket_dir is None:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
            self._chown(self._socket_dir)
        return self._socket_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    # -------------------------------------------------------------- lifecycle

    def _chown(self, path: Path) -> None:
        user = _run_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _spawn_kwargs(self) -> dict[str, Any]:
        user = _run_user()
        if user is None:
            return {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(HOME=str(self.data_dir), USER=user.pw_name, LOGNAME=user.pw_name)
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": env,
                "cwd": str(self.data_dir)}

    def _install(self) -> None:
        kwargs = self._spawn_kwargs()
        probe = subprocess.run(["test", "-w", str(self.data_dir)], check=False, **kwargs)
        if probe.returncode != 0:
            raise PermissionError(
                f"{self.data_dir} is not writable by the PostgreSQL OS user; every directory above "
                "it must be traversable by that user (use tempfile.mkdtemp(), not pytest's tmp_path)"
            )
        cmd = [find_binary("initdb", _PG_DIRS), "-D", str(self.pgdata), "-U", "postgres",
               "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync", "--no-instructions"]
        with open(self.data_dir / "initdb.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=120, **kwargs).returncode
        if rc != 0:
            tail = (self.data_dir / "initdb.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"initdb failed with exit code {rc}:\n{tail}")

    def _command(self) -> list[str]:
        conf = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": "200",
            "shared_buffers": "64MB",
            "dynamic_shared_memory_type": "posix",
            "logging_collector": "off",
            "log_min_messages": "warning",
        }
        if not self.durable:
            # Not synchronous_commit=off: that returns before the WAL is even written, so a
            # SIGKILL would lose the last commits. fsync=off only skips the flush to disk.
            conf.update(fsync="off", full_page_writes="off")
        conf.update(self.conf)
        cmd = [find_binary("postgres", _PG_DIRS), "-D", str(self.pgdata)]
        for name, value in conf.items():
            cmd += ["-c", f"{name}={value}"]
        return cmd

    def start(self) -> PostgreSQL:
        """Start (running initdb first if the cluster is new) and wait until it accepts logins.

        With ``port=0`` a free port is picked; if another process takes it before postgres binds
        it, a new one is tried. Later starts (``restart()``) keep the port.
        """
        if self.alive():
            return self
        auto_port = not self.port
        if not self.data_dir.exists():
            self.data_dir.mkdir(parents=True)
        self._chown(self.data_dir)
        if not (self.pgdata / "PG_VERSION").exists():
            self._install()
        for attempt in range(3):
            if auto_port and (attempt or not self.port):
                self.port = free_port()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            if self._launch():
                return self
            new_log = self.log_path.read_text(errors="replace")[log_offset:]
            if not (auto_port and "Address already in use" in new_log):
                break
        raise RuntimeError(f"postgres did not start; log {self.log_path}:\n{self.tail_log()}")

    def _launch(self) -> bool:
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **self._spawn_kwargs())
        self.proc = proc

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            try:
                self.connect(connect_timeout=2).close()
            except psycopg.OperationalError:
                return False
            return True

        try:
            wait_until(ready, self.start_timeout, f"postgres on port {self.port}", interval=0.05)
        except TimeoutError:
            self.kill()
            raise
        if proc.poll() is not None:
            self.proc = None
            return False
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """Fast shutdown (SIGINT): open sessions are ended, then a shutdown checkpoint."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the postmaster and all its processes: a crash; the next start() recovers."""
        if self.proc and self.proc.poll() is None:
            # Freeze the postmaster first so it cannot fork a backend we would miss.
            self.proc.send_signal(signal.SIGSTOP)
            children = _children(self.proc.pid)
            self.proc.send_signal(signal.SIGKILL)
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            # The old backends must be gone before a new postmaster may use the data dir.
            wait_until(lambda: not any(pid_alive(p) for p in children), 10,
                       "the killed postgres backends to exit")
        self.proc = None

    def restart(self) -> PostgreSQL:
        """Stop and start again on the same port and data dir, as a server restart would."""
        self.stop()
        return self.start()

    def cleanup(self, remove_data: bool = False) -> None:
        """Stop; remove the socket temp dir (and, with ``remove_data``, the whole data dir)."""
        self.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if remove_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # ----------------------------------------------------------------- access

    def connect(self, database: str | None = None, **kwargs: Any) -> psycopg.Connection[Any]:
        """A psycopg connection as ``postgres`` over TCP, autocommit on."""
        params: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": "postgres",
            "dbname": database or "postgres",
            "autocommit": True,
            "connect_timeout": 5,
        }
        params.update(kwargs)
        return psycopg.connect(**params)

    def execute(self, *statements: str, database: str | None = None) -> list[tuple[Any, ...]]:
        """Run statements on a fresh connection; returns the rows of the last one (if any)."""
        with self.connect(database) as conn, conn.cursor() as cur:
            rows: list[tuple[Any, ...]] = []
            for statement in statements:
                cur.execute(statement.encode())
                rows = list(cur.fetchall()) if cur.description is not None else []
            return rows

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"
