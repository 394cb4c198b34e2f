"""A private MariaDB (or MySQL-compatible mariadbd) with a ROW binlog, for tests, demos and benchmarks.

Every instance lives in its own directory, listens on its own TCP port (127.0.0.1 only) and its
own unix socket, and never reads a system option file (``--no-defaults``), so it cannot touch a
MariaDB that the machine may already run. Layout of ``data_dir``::

    data/          the datadir (system tables, InnoDB files, binlog.NNNNNN)
    mariadbd.sock  unix socket (moved to a short temp dir when the path is too long)
    mariadbd.pid
    error.log

Start-up is fast (``mariadb-install-db`` is about 0.3 s, the server about 0.1 s on a small
machine), so there is no template data dir to copy; ``start()`` on an initialised ``data_dir``
(``restart()``, or after ``kill()``) skips the install step and keeps the data.

Durability: ``innodb_flush_log_at_trx_commit=2`` and ``sync_binlog=0`` by default. Both still
write every commit to the OS before it returns, so a SIGKILL of the server (``kill()``) loses no
committed transaction; only a machine crash could, which tests do not simulate. Pass
``durable=True`` for the production settings (1 and 1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql

from libs.localservers.common import find_binary, free_port, wait_until

_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/local/mysql/bin", "/usr/local/bin")
# sun_path is 108 bytes on Linux; keep a margin.
_MAX_SOCKET_PATH = 100


@dataclass
class MariaDB:
    data_dir: Path
    port: int = 0
    server_id: int = 1
    # More mariadbd options, appended last so they override the defaults below.
    extra_args: tuple[str, ...] = ()
    durable: bool = False
    start_timeout: float = 60.0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _socket_dir: Path | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ paths

    @property
    def datadir(self) -> Path:
        return self.data_dir / "data"

    @property
    def socket_path(self) -> Path:
        path = self.data_dir / "mariadbd.sock"
        if len(str(path)) <= _MAX_SOCKET_PATH:
            return path
        if self._socket_dir is None:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="sluice-mdb-"))
        return self._socket_dir / "mariadbd.sock"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "error.log"

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/"

    def url_for(self, database: str) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{database}"

    # -------------------------------------------------------------- lifecycle

    def _install(self) -> None:
        self.datadir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_binary("mariadb-install-db", _SBIN_DIRS),
            "--no-defaults",
            f"--datadir={self.datadir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=16M",
            "--innodb-log-file-size=8M",
            # Its bootstrap's temporary tables in this instance's own directory, not the shared
            # /tmp where instances installed at the same moment by other test workers meet.
            f"--tmpdir={self.data_dir}",
        ]
        if os.geteuid() == 0:
            cmd.append("--user=root")
        with open(self.data_dir / "install.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=120).returncode
        if rc != 0:
            tail = (self.data_dir / "install.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"mariadb-install-db failed with exit code {rc}:\n{tail}")

    def _command(self) -> list[str]:
        cmd = [
            find_binary("mariadbd", _SBIN_DIRS),
            "--no-defaults",
            f"--datadir={self.datadir}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.socket_path}",
            f"--pid-file={self.data_dir / 'mariadbd.pid'}",
            f"--log-error={self.log_path}",
            f"--log-bin={self.datadir / 'binlog'}",
            "--binlog-format=ROW",
            "--binlog-row-image=FULL",
            # Column names inside the row events (pymysqlreplication reads them from there
            # instead of asking information_schema, which may already show a later schema).
            "--binlog-row-metadata=FULL",
            f"--server-id={self.server_id}",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_general_ci",
            "--skip-name-resolve",
            "--local-infile=1",
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=32M",
            "--max-connections=300",
            # Rows up to 1 GB (LONGBLOB, JSON) in both directions: written to a source, and
            # written by a sink to a downstream (one row alone is one statement).
            "--max-allowed-packet=1G",
            "--performance-schema=OFF",
            f"--innodb-flush-log-at-trx-commit={1 if self.durable else 2}",
            f"--sync-binlog={1 if self.durable else 0}",
            f"--tmpdir={self.data_dir}",
        ]
        if os.geteuid() == 0:
            cmd.append("--user=root")
        return [*cmd, *self.extra_args]

    def start(self) -> MariaDB:
        """Start (installing the data dir first if it is new) and wait until it accepts logins.

        With ``port=0`` a free port is picked; if another process takes it before mariadbd binds
        it, a new one is tried. Later starts (``restart()``) keep the port.
        """
        if self.alive():
            return self
        auto_port = not self.port
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not (self.datadir / "mysql").is_dir():
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
        raise RuntimeError(f"mariadbd did not start; log {self.log_path}:\n{self.tail_log()}")

    def _launch(self) -> bool:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a stale socket after kill()
        with open(self.data_dir / "mariadbd.out", "ab") as out:
            proc = subprocess.Popen(self._command(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        self.proc = proc

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            try:
                # read_timeout: a stranger listening on the port may never send a handshake.
                self.connect(connect_timeout=2, read_timeout=2, write_timeout=2).close()
            except pymysql.err.OperationalError:
                return False
            return True

        try:
            wait_until(ready, self.start_timeout, f"mariadbd on port {self.port}", interval=0.05)
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
        """Clean shutdown (SIGTERM): InnoDB flushes and the binlog is closed properly."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash. The next start() runs InnoDB and binlog crash recovery."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> MariaDB:
        """Stop and start again on the same port and data dir, as a server restart would."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop and remove the socket temp dir, if one was needed (the data dir stays)."""
        self.stop()
        if self._socket_dir is not None:
            with contextlib.suppress(OSError):
                for p in self._socket_dir.iterdir():
                    p.unlink()
                self._socket_dir.rmdir()
            self._socket_dir = None

    # ----------------------------------------------------------------- access

    def connect(self, database: str | None = None, **kwargs: Any) -> pymysql.connections.Connection[Any]:
        """A pymysql connection as root over TCP, autocommit on, utf8mb4, LOCAL INFILE allowed."""
        params: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": "root",
            "password": "",
            "charset": "utf8mb4",
            "autocommit": True,
            "local_infile": True,
            "connect_timeout": 5,
        }
        if database is not None:
            params["database"] = database
        if not any(k.startswith("ssl") for k in kwargs):
            # A local server has no TLS unless a test gives it some, and pymysql would build (and
            # load the system CA store into) a TLS context on every connect for nothing: ~50 ms
            # of CPU, a few seconds of a process test's connections.
            params["ssl_disabled"] = True
        params.update(kwargs)
        return pymysql.connect(**params)

    def execute(self, *statements: str, database: str | None = None) -> list[tuple[Any, ...]]:
        """Run statements on a fresh connection; returns the rows of the last one."""
        conn = self.connect(database)
        try:
            rows: list[tuple[Any, ...]] = []
            with conn.cursor() as cur:
                for statement in statements:
                    cur.execute(statement)
                    rows = list(cur.fetchall())
            return rows
        finally:
            conn.close()

    def binlog_files(self) -> list[str]:
        """The server's binlog files, oldest first (``SHOW BINARY LOGS``); a new one per start."""
        return [str(row[0]) for row in self.execute("SHOW BINARY LOGS")]

    def replication_settings(self) -> dict[str, Any]:
        """``connection_settings`` for pymysqlreplication's BinLogStreamReader."""
        return {"host": "127.0.0.1", "port": self.port, "user": "root", "passwd": ""}

    def replicate_from(self, source: MariaDB) -> None:
        """Make this server a native GTID replica of ``source`` from its first transaction
        (``MASTER_USE_GTID=slave_pos`` with an empty position): the physical baseline the OLTP
        benchmark sets beside capture. Each server needs its own ``server_id``."""
        self.execute(
            "STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL gtid_slave_pos = ''",
            f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={source.port}, "
            "MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos",
            "START SLAVE")

    def replica_status(self) -> dict[str, Any]:
        """``SHOW SLAVE STATUS`` as a dict (empty when this server is no replica)."""
        conn = self.connect()
        try:
            with conn.cursor(pymysql.cursors.DictCursor) as cur:
                cur.execute("SHOW SLAVE STATUS")
                row = cur.fetchone()
            return dict(row) if row else {}
        finally:
            conn.close()

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"
