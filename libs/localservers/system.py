"""A whole Sluice system on one machine: nats-server, MariaDB sources, a downstream and every
service as real processes. The demo, the end-to-end tests and the benchmarks start it the same way.
"""

from __future__ import annotations

import itertools
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import nats

from contracts.events.changefeeds import (
    ChangefeedSpecV2,
    InitialLoad,
    SourceRefV1,
    TableFilterV1,
)
from libs.changefeeds import record_changefeed
from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsCluster, NatsServer
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.nats_auth import API

Downstream = Literal["sqlite", "postgres", "mariadb"]

# Leader-elected control services; each runs `replicas` processes.
CONTROL_SERVICES = ("member", "scheduler", "replication_manager", "ddl_lock")


@dataclass
class LocalSystem:
    base_dir: Path
    sources: int = 2
    downstream: Downstream = "sqlite"
    control_replicas: int = 2
    workers: int = 1
    lease_ttl_s: float = 3.0
    with_api: bool = True
    capture_start: Literal["earliest", "current"] = "current"
    control_services: tuple[str, ...] = CONTROL_SERVICES
    standalone_workers: bool = True
    initial_load: InitialLoad = "snapshot"
    """How the changefeeds of ``changefeed_spec`` start (the demo copies its tables first)."""
    """Workers run every span themselves (``SLUICE_SINK_STANDALONE``); False: the control
    plane (member, scheduler, replication-manager) distributes the spans over them."""
    worker_env: dict[str, str] = field(default_factory=dict)
    control_env: dict[str, str] = field(default_factory=dict)
    nats_tls: bool = False
    """nats-server requires TLS with client certificates (authentication is always on)."""
    nats_sync_interval: str | None = None
    """JetStream's fsync interval (the demo: ``always``); None keeps the server's default."""
    nats_nodes: int = 1
    """1: one nats-server; 3 (or more): a ``NatsCluster`` of that many nodes, and every Sluice
    stream and bucket with as many replicas (SLUICE_STREAM_REPLICAS)."""
    nats: NatsServer | None = None
    """The nats-server, or with a cluster its first node (the cluster is ``nats_cluster``)."""
    nats_cluster: NatsCluster | None = None
    source_dbs: list[MariaDB] = field(default_factory=list)
    downstream_db: MariaDB | PostgreSQL | None = None
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    api_token: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    """The api's operator token: the api runs with auth on, as in production."""
    _server_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # ------------------------------------------------------------------ infrastructure

    def start_infra(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.nats_nodes > 1:
            assert not self.nats_tls, "a local NATS cluster runs without TLS"
            self.nats_cluster = NatsCluster(self.base_dir / "nats", size=self.nats_nodes,
                                            sync_interval=self.nats_sync_interval).start()
            self.nats = self.nats_cluster.nodes[0]
        else:
            self.nats = NatsServer(data_dir=self.base_dir / "nats", tls=self.nats_tls,
                                   sync_interval=self.nats_sync_interval).start()
        for i in range(self.sources):
            db = MariaDB(data_dir=self.base_dir / f"source{i + 1}", server_id=next(self._server_ids))
            self.source_dbs.append(db.start())
        if self.downstream == "postgres":
            self.downstream_db = PostgreSQL(data_dir=self.base_dir / "downstream-pg").start()
        elif self.downstream == "mariadb":
            self.downstream_db = MariaDB(data_dir=self.base_dir / "downstream-mariadb",
                                         server_id=next(self._server_ids)).start()

    @property
    def sink_url(self) -> str:
        if self.downstream_db is None:
            return f"sqlite:///{self.base_dir / 'downstream.db'}"
        return self.downstream_db.url

    def source_id(self, index: int) -> str:
        return f"src{index + 1}"

    @property
    def nats_urls(self) -> list[str]:
        """The admin user's URL of every NATS node: what the tests' and tools' own clients
        connect to (``nats.connect(servers=...)``), so they outlive one node."""
        if self.nats_cluster is not None:
            return self.nats_cluster.urls
        assert self.nats is not None
        return [self.nats.url]

    def env(self) -> dict[str, str]:
        assert self.nats is not None
        return {
            # A service is handed its own role's user and every node (ServiceProcess).
            "SLUICE_NATS_URL": ",".join(self.nats_urls),
            "SLUICE_STREAM_REPLICAS": str(self.nats_nodes),
            "SLUICE_LEASE_TTL_S": str(self.lease_ttl_s),
            "SLUICE_STATE_DB_URL": f"sqlite:///{self.base_dir / 'state.db'}",
            "SLUICE_DOWNSTREAM_URL": self.sink_url,
        }

    # ------------------------------------------------------------------ services

    def _start(self, name: str, module: str, extra: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(module, {**self.env(), **(extra or {})}, self.base_dir / "logs",
                              instance_id=name).start()
        self.processes[name] = proc
        return proc

    def start_services(self) -> None:
        for i, db in enumerate(self.source_dbs):
            sid = self.source_id(i)
            self._start(f"capture-{sid}", "services.capture", {
                "SLUICE_SOURCE_ID": sid,
                "SLUICE_SOURCE_URL": f"{db.url}?start={self.capture_start}",
                "SLUICE_SOURCE_SERVER_ID": str(4100 + i),
            })
        for service in self.control_services:
            for r in range(self.control_replicas):
                self.start_control(service, r + 1)
        for w in range(self.workers):
            self.start_worker(w + 1)
        if self.with_api:
            self._start("api-1", "services.api", {"SLUICE_API_TOKEN": self.api_token})

    def start_control(self, service: str, replica: int) -> ServiceProcess:
        """(Re)start one replica of a leader-elected control service."""
        return self._start(f"{service.replace('_', '-')}-{replica}", f"services.{service}", self.control_env)

    def start_worker(self, n: int) -> ServiceProcess:
        """(Re)start sink-worker ``n`` (its member id is its process name)."""
        env = {"SLUICE_SINK_STANDALONE": str(self.standalone_workers).lower(), **self.worker_env}
        return self._start(f"sink-worker-{n}", "services.sink_worker", env)

    def process_pids(self) -> dict[str, int]:
        """The pid of every live service process by name, of the nats-server, of the first source
        and of a MariaDB downstream: the roots a benchmark samples memory and CPU under."""
        pids = {n: p.proc.pid for n, p in list(self.processes.items()) if p.alive() and p.proc is not None}
        if self.nats is not None and self.nats.proc is not None:
            pids["nats-server"] = self.nats.proc.pid
        for label, db in (("MariaDB source", self.source_dbs[0] if self.source_dbs else None),
                          ("MariaDB downstream", self.downstream_db)):
            if isinstance(db, MariaDB) and db.proc is not None:
                pids[label] = db.proc.pid
        return pids

    def wait_healthy(self, timeout: float = 90) -> None:
        """Until every process is healthy, and the api ready too: a healthy api that is still
        rebuilding its read models answers requests with 503."""
        for proc in self.processes.values():
            if proc.module == "services.api":
                proc.wait_ready(timeout)
            else:
                proc.wait_healthy(timeout)

    def stop(self) -> None:
        # All at once: each process and server gets its own grace period, and a dozen of them
        # one after another would add their shutdown times up.
        def end(proc: ServiceProcess) -> None:
            try:
                proc.terminate(timeout=20)
            except Exception:
                proc.kill()

        live = [p for p in self.processes.values() if p.alive()]
        dbs = [*self.source_dbs, *([self.downstream_db] if self.downstream_db else [])]
        with ThreadPoolExecutor(max_workers=max(1, len(live), len(dbs))) as pool:
            list(pool.map(end, live))
            list(pool.map(lambda db: db.stop(), dbs))
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        elif self.nats is not None:
            self.nats.stop()

    # ------------------------------------------------------------------ changefeeds

    def changefeed_spec(self, changefeed_id: str, include: list[str]) -> ChangefeedSpecV2:
        return ChangefeedSpecV2(
            id=changefeed_id,
            sources=[SourceRefV1(id=self.source_id(i), url=db.url) for i, db in enumerate(self.source_dbs)],
            filter=TableFilterV1(include=include),
            sink_url=self.sink_url,
            initial_load=self.initial_load,
        )

    async def create_changefeed(self, spec: ChangefeedSpecV2, requested_by: str = "demo") -> int:
        """Record the changefeed in its domain stream, as the api does for an operator (and with
        the api's NATS user)."""
        assert self.nats is not None
        nc = await nats.connect(**self.nats.client_options(API))
        try:
            # The system's stream settings, not this process' defaults: ensuring the changefeeds
            # log with another replica count would rescale it.
            return await record_changefeed(nc.jetstream(), spec, requested_by,
                                           settings=Settings(stream_replicas=self.nats_nodes))
        finally:
            await nc.close()


