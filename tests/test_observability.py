"""Operator surface with real processes: MariaDB -> capture -> JetStream -> member, scheduler,
replication-manager -> sink-worker (Spark) -> the NATS sink, every service exporting its spans to
an OTLP/HTTP receiver started here and serving Prometheus metrics.

One system for the module (its start costs most of the time); the tests run in file order:
the NATS sink delivers every change in order in both envelopes; one trace runs from capture's
publish through the sink's sort and publish; a schedule task's trace runs from the scheduler
through the replication-manager to the worker; every service's metrics are there and move; a
sink-worker killed with SIGKILL and restarted neither duplicates nor loses a change."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import nats
import pytest

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.sink import SinkRowChangedV1
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.streams import PREPARE_BUCKET, rows_subject
from tests.helpers.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.helpers.worker_env import SPARK_WORKER_ENV

pytestmark = pytest.mark.integration

SOURCE = "obs"
API_TOKEN = "obs-api-token-3f9a"
CONTROL = ("member", "scheduler", "replication_manager", "ddl_lock", "api")


@dataclass
class ObsSystem:
    nats: NatsServer
    receiver: OtlpReceiver
    source: MariaDB
    db: str
    env: dict[str, str]
    logs: Path
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)
    """format -> output stream name"""
    changefeeds: dict[str, str] = field(default_factory=dict)
    """format -> changefeed id"""
    expected: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(op, before, after) of every change made upstream, in commit order."""

    def start(self, name: str, module: str, extra: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(module, {**self.env, **(extra or {})}, self.logs, instance_id=name).start()
        self.processes[name] = proc
        return proc

    def start_worker(self) -> ServiceProcess:
        return self.start("sink-worker-1", "services.sink_worker", {
            **SPARK_WORKER_ENV})

    def diagnostics(self) -> str:
        return "\n".join(f"--- {n}: alive={p.alive()}\n{p.tail_log(8)}" for n, p in self.processes.items())

    def sql(self, *statements: str, database: str | None = "") -> None:
        conn = self.source.connect(self.db if database == "" else database)
        try:
            with conn.cursor() as cur:
                for st in statements:
                    cur.execute(st)
        finally:
            conn.close()

    def insert(self, id_: int, v: str) -> None:
        self.sql(f"INSERT INTO t (id, v) VALUES ({id_}, '{v}')")
        self.expected.append(("insert", None, {"id": id_, "v": v}))

    def update(self, id_: int, old: str, new: str) -> None:
        self.sql(f"UPDATE t SET v = '{new}' WHERE id = {id_}")
        self.expected.append(("update", {"id": id_, "v": old}, {"id": id_, "v": new}))

    def delete(self, id_: int, old: str) -> None:
        self.sql(f"DELETE FROM t WHERE id = {id_}")
        self.expected.append(("delete", {"id": id_, "v": old}, None))

    def wait(self, check: Callable[[], Any], within: float, what: str,
             detail: Callable[[], str] | None = None) -> Any:
        deadline = time.monotonic() + within
        while True:
            value = check()
            if value:
                return value
            for name, proc in self.processes.items():
                assert proc.alive(), f"{name} died:\n{proc.tail_log()}"
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{detail() if detail else self.diagnostics()}")
            time.sleep(0.3)  # polling a condition with a deadline

    def stop(self) -> None:
        for proc in self.processes.values():
            proc.kill()


async def _stream_messages(url: str, stream: str) -> list[tuple[str, dict[str, str], bytes]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return []
        out = []
        # A stream the sink has just made and not written to yet says first_seq 0, and the
        # server answers a read of sequence 0 with 400 "bad request": nothing to read then.
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            out.append((msg.subject, dict(msg.headers or {}), msg.data or b""))
        return out
    finally:
        await nc.close()


async def _prepare_entries(url: str) -> dict[str, dict[str, Any]]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(PREPARE_BUCKET)
        return {k: json.loads((await kv.get(k)).value or b"{}") for k in await kv.keys()}
    finally:
        await nc.close()


def stream_messages(system: ObsSystem, fmt: str) -> list[tuple[str, dict[str, str], bytes]]:
    return asyncio.run(_stream_messages(system.nats.url, system.streams[fmt]))


def changes_of(fmt: str, msgs: list[tuple[str, dict[str, str], bytes]]) -> list[tuple[str, Any, Any]]:
    ops = {"c": "insert", "u": "update", "d": "delete"}
    out = []
    for _, _, data in msgs:
        if fmt == "sluice":
            ev = REGISTRY.decode(data).event
            assert isinstance(ev, SinkRowChangedV1)
            out.append((ev.op, ev.before, ev.after))
        else:
            body = json.loads(data)
            out.append((ops[body["op"]], body["before"], body["after"]))
    return out


@pytest.fixture(scope="module")
def system(mariadb: MariaDB, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObsSystem]:
    base = tmp_path_factory.mktemp("obs")
    # A private broker: the control plane here must see only this module's changefeeds.
    broker = NatsServer(data_dir=base / "nats").start()
    receiver = OtlpReceiver().start()
    db = f"obs_{uuid4().hex[:6]}"
    env = {
        "SLUICE_NATS_URL": broker.url, "SLUICE_LEASE_TTL_S": "1.5", "SLUICE_LOG_JSON": "true",
        "SLUICE_STATE_DB_URL": f"sqlite:///{base / 'state.db'}",
        "SLUICE_DOWNSTREAM_URL": f"sqlite:///{base / 'down.db'}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "300",
        "SLUICE_API_TOKEN": API_TOKEN,
    }
    system = ObsSystem(broker, receiver, mariadb, db, env, base / "logs")
    try:
        system.sql(f"CREATE DATABASE {db}", database=None)
        system.sql("CREATE TABLE t (id int PRIMARY KEY, v varchar(20))")
        capture = system.start("capture-obs", "services.capture", {
            "SLUICE_SOURCE_ID": SOURCE,
            "SLUICE_SOURCE_URL": f"{mariadb.url_for(db)}?heartbeat=0.5&start=current&databases={db}",
            "SLUICE_SOURCE_SERVER_ID": "4801"})
        for fmt in ("sluice", "debezium"):
            system.streams[fmt] = f"OBS_{fmt.upper()}"
            system.changefeeds[fmt] = f"obs-{fmt}"
            spec = ChangefeedSpecV2(
                id=system.changefeeds[fmt], sources=[SourceRefV1(id=SOURCE, url=mariadb.url_for(db))],
                filter=TableFilterV1(include=[f"{db}.*"]), initial_load="binlog-only",
                sink_url=f"{broker.url}/{system.streams[fmt]}?subject=obs.{fmt}&format={fmt}")

            async def record(spec: ChangefeedSpecV2 = spec) -> None:
                nc = await nats.connect(broker.url)
                try:
                    await record_changefeed(nc.jetstream(), spec, requested_by="test")
                finally:
                    await nc.close()

            asyncio.run(record())
        for module in CONTROL:
            system.start(f"{module.replace('_', '-')}-1", f"services.{module}")
        system.start_worker()
        for proc in system.processes.values():
            proc.wait_healthy(90)
        # start=current: capture fixes its start position only once it reads; a change made
        # before that would not be captured. Its first resolved mark says it is reading.
        system.wait(lambda: _value(_metrics(capture), "sluice_capture_resolved_timestamp_seconds",
                                   source=SOURCE) > 0, 90, "capture's first resolved mark")
        yield system
    finally:
        system.stop()
        receiver.stop()
        broker.stop()


def test_nats_sink_delivers_every_change_in_order_in_both_envelopes(system: ObsSystem) -> None:
    system.insert(1, "a")
    system.insert(2, "b")
    system.sql("INSERT INTO t (id, v) VALUES (3, 'c'), (4, 'd')")  # one transaction, two rows
    system.expected += [("insert", None, {"id": 3, "v": "c"}), ("insert", None, {"id": 4, "v": "d"})]
    system.update(1, "a", "a2")
    system.delete(2, "b")
    system.update(1, "a2", "a3")
    for fmt in ("sluice", "debezium"):
        msgs = system.wait(lambda fmt=fmt: (lambda m: m if len(m) >= len(system.expected) else None)(
            stream_messages(system, fmt)), 180, f"{len(system.expected)} changes on the {fmt} stream")
        assert changes_of(fmt, msgs) == system.expected, fmt
        assert {s for s, _, _ in msgs} == {f"obs.{fmt}.{system.db}.t"}
        assert len({h["Nats-Msg-Id"] for _, h, _ in msgs}) == len(msgs)


def _spans(system: ObsSystem, service: str, name: str | Callable[[str], bool]) -> list[ReceivedSpan]:
    match = name if callable(name) else (lambda n: n == name)
    return [s for s in system.receiver.snapshot() if s.service == f"sluice-{service}" and match(s.name)]


def test_one_trace_runs_from_capture_publish_to_sink_publish(system: ObsSystem) -> None:
    subject = rows_subject(SOURCE, system.db, "t")

    def chain() -> tuple[ReceivedSpan, ReceivedSpan, list[ReceivedSpan]] | None:
        published = {s.span_id: s for s in _spans(system, "capture", f"publish {subject}")}
        for batch in _spans(system, "sink-worker", "sink batch"):
            parent = published.get(batch.parent_span_id)
            children = [s for s in system.receiver.snapshot() if s.parent_span_id == batch.span_id]
            if parent is not None and {"sort", "publish changes"} <= {c.name for c in children}:
                return parent, batch, children
        return None

    publish, batch, children = system.wait(chain, 60, "a sink batch span under a capture publish span")
    assert batch.trace_id == publish.trace_id
    assert all(c.trace_id == publish.trace_id and c.service == "sluice-sink-worker" for c in children)
    # The pull of that very message is a child of the same publish span (another process).
    processed = [s for s in _spans(system, "sink-worker", f"process {subject}")
                 if s.parent_span_id == publish.span_id]
    assert processed and processed[0].trace_id == publish.trace_id


def test_schedule_task_trace_runs_from_scheduler_to_worker(system: ObsSystem) -> None:
    def chain() -> tuple[ReceivedSpan, ...] | None:
        for task in _spans(system, "scheduler", "schedule schedule.add_table"):
            appended = [s for s in _spans(system, "scheduler", "publish sluice.ctl.schedule.events")
                        if s.parent_span_id == task.span_id]
            if not appended:
                continue
            dispatch = [s for s in _spans(system, "replication-manager", lambda n: n.startswith("dispatch "))
                        if s.parent_span_id == appended[0].span_id]
            for d in dispatch:
                sent = [s for s in _spans(system, "replication-manager",
                                          lambda n: n.startswith("publish sluice.dispatch."))
                        if s.parent_span_id == d.span_id]
                handled = [s for s in _spans(system, "sink-worker",
                                             lambda n: n.startswith("process sluice.dispatch."))
                           if sent and s.parent_span_id == sent[0].span_id]
                if handled:
                    return task, appended[0], d, sent[0], handled[0]
        return None

    spans = system.wait(chain, 60, "scheduler -> replication-manager -> worker spans of one task")
    assert len({s.trace_id for s in spans}) == 1
    assert spans[2].name in ("dispatch add-prepare", "dispatch add-commit")
    # Both phases of the two-phase dispatch of a span belong to the task's trace. The chain above
    # may be found while the span still prepares: the commit comes once it reports Prepared.
    both = {"dispatch add-prepare", "dispatch add-commit"}

    def phases() -> set[str]:
        return {s.name for s in _spans(system, "replication-manager", lambda n: n.startswith("dispatch "))
                if s.trace_id == spans[0].trace_id}

    system.wait(lambda: both <= phases(), 60, "the add-commit dispatch in the task's trace",
                detail=lambda: f"phases in the trace: {sorted(phases())}")
    assert both <= phases()


def _metrics(proc: ServiceProcess) -> str:
    with urllib.request.urlopen(proc.base_url + "/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _values(text: str, name: str, **labels: str) -> list[float]:
    """The samples of ``name`` whose labels include ``labels``."""
    out: list[float] = []
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


def _value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(_values(text, name, **labels))


def test_every_service_serves_the_metrics_operators_watch(system: ObsSystem) -> None:
    procs = system.processes
    for name, proc in procs.items():
        text = _metrics(proc)
        assert "sluice_nats_reconnects_total" in text, name
        assert "sluice_leader_epoch" in text and "sluice_dead_letters_total" in text, name
    # Each control service has a leader with a positive epoch.
    for name in ("member-1", "scheduler-1", "replication-manager-1", "ddl-lock-1"):
        service = name.rsplit("-", 1)[0]
        system.wait(lambda name=name, service=service: _value(_metrics(procs[name]), "sluice_leader_epoch",
                                                            service=service) > 0, 30, f"{name} leading")
    capture = _metrics(procs["capture-obs"])
    assert _value(capture, "sluice_capture_rows_published_total", source=SOURCE) >= len(system.expected)
    scheduler = _metrics(procs["scheduler-1"])
    assert "sluice_scheduler_tasks_in_flight" in scheduler
    assert _value(scheduler, "sluice_scheduler_tasks_total", type="schedule.add_table") >= 2
    # The manager's gauges follow its state machine a moment behind (a set's commit is reported,
    # then counted): wait for both spans replicating on the worker.
    system.wait(lambda: _value(_metrics(procs["replication-manager-1"]), "sluice_replication_sets",
                               state="replicating") == 2, 30, "the manager's gauge of 2 replicating sets")
    manager = _metrics(procs["replication-manager-1"])
    # The worker recorded what each span's prepare waited for (the api's waiting_for): its
    # last phase is the commit it then got.
    prepared = asyncio.run(_prepare_entries(system.nats.url))
    assert {e["member"] for e in prepared.values()} == {"sink-worker-1"}, prepared
    assert len(prepared) == 2 and {e["phase"] for e in prepared.values()} == {"prepared"}, prepared
    assert _value(manager, "sluice_replication_member_spans", member="sink-worker-1") == 2
    cf = system.changefeeds["sluice"]
    system.wait(lambda: f'sluice_changefeed_checkpoint_lag_seconds{{changefeed="{cf}"}}'
                in _metrics(procs["replication-manager-1"]), 30, "the changefeed lag gauge")
    lag = _value(_metrics(procs["replication-manager-1"]), "sluice_changefeed_checkpoint_lag_seconds",
                 changefeed=cf)
    assert 0 <= lag < 120
    worker = _metrics(procs["sink-worker-1"])
    published = _value(worker, "sluice_sink_rows_applied_total", changefeed=cf, op="publish")
    assert published == len(system.expected)
    assert _value(worker, "sluice_sink_apply_seconds_count") > 0
    assert _value(worker, "sluice_sink_batch_rows_count") > 0
    assert _value(worker, "sluice_sink_batch_events_sum") > 0
    assert _value(worker, "sluice_sink_spans", state="replicating") == 2
    assert _value(worker, "sluice_sink_checkpoint_lag_seconds", changefeed=cf) >= 0
    # Checkpoints and resolved marks are exported as Unix seconds (a raw ts, ~4.7e17, is beyond
    # float64's exact integers): each is a time of this run.
    def stamps() -> dict[str, list[float]]:
        return {"sink": _values(_metrics(procs["sink-worker-1"]),
                                "sluice_sink_checkpoint_timestamp_seconds", changefeed=cf),
                "manager": _values(_metrics(procs["replication-manager-1"]),
                                   "sluice_replication_checkpoint_timestamp_seconds", changefeed=cf),
                "capture": _values(_metrics(procs["capture-obs"]),
                                   "sluice_capture_resolved_timestamp_seconds", source=SOURCE)}

    system.wait(lambda: all(stamps().values()), 30, "every checkpoint and resolved timestamp gauge")
    now = time.time()
    for who, values in stamps().items():
        assert all(now - 600 < v <= now + 5 for v in values), (who, values, now)

    # Garbage on the span's subject: dead-lettered by the worker, and the counter moves.
    before = _value(worker, "sluice_dead_letters_total", stream="SLUICE_ROWS")

    async def garbage() -> None:
        nc = await nats.connect(system.nats.url)
        try:
            await nc.jetstream().publish(rows_subject(SOURCE, system.db, "t"), b"{not json")
        finally:
            await nc.close()

    asyncio.run(garbage())
    system.wait(lambda: _value(_metrics(procs["sink-worker-1"]), "sluice_dead_letters_total",
                               stream="SLUICE_ROWS") > before, 60, "the dead-letter counter to move")


def test_sink_worker_kill_9_and_restart_neither_duplicates_nor_loses(system: ObsSystem) -> None:
    before = {fmt: len(stream_messages(system, fmt)) for fmt in system.streams}
    system.processes["sink-worker-1"].kill()
    system.insert(5, "e")
    system.update(5, "e", "e2")
    system.start_worker().wait_healthy(90)
    system.insert(6, "f")
    for fmt in ("sluice", "debezium"):
        msgs = system.wait(lambda fmt=fmt: (lambda m: m if len(m) >= len(system.expected) else None)(
            stream_messages(system, fmt)), 180, f"the changes after the restart on the {fmt} stream")
        assert len(msgs) > before[fmt]
        # Exactly once each, in order: the re-read from the stored checkpoint was deduplicated.
        assert changes_of(fmt, msgs) == system.expected, fmt


# Last: its changefeed adds spans the tests above count.
def test_a_changefeed_requests_trace_continues_into_the_placement_of_its_tables(
        system: ObsSystem, tmp_path: Path) -> None:
    api_url = system.processes["api-1"].base_url + "/api/v1/changefeeds"
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    spec = {"id": "obs-trace", "sources": [{"id": SOURCE, "url": system.source.url_for(system.db)}],
            "filter": {"include": [f"{system.db}.*"]}, "sink_url": f"sqlite:///{tmp_path / 'trace.db'}",
            "initial_load": "binlog-only"}
    # A row makes the table a span the scheduler discovers (spans come from the ROWS stream).
    system.sql("INSERT INTO t VALUES (990001, 'trace')")
    created = httpx.post(api_url, json=spec, headers=headers, timeout=30)
    assert created.status_code == 202, created.text
    try:
        def chain() -> tuple[ReceivedSpan, ReceivedSpan, ReceivedSpan] | None:
            # The api's server span of the one POST /changefeeds this module makes.
            for request in _spans(system, "api", "POST /api/v1/changefeeds"):
                if request.attributes.get("http.response.status_code") != "202":
                    continue
                tasks = [s for s in _spans(system, "scheduler", "schedule schedule.add_table")
                         if s.trace_id == request.trace_id]
                dispatched = [s for s in _spans(system, "replication-manager", "dispatch add-prepare")
                              if s.trace_id == request.trace_id]
                if tasks and dispatched:
                    return request, tasks[0], dispatched[0]
            return None

        def seen() -> str:
            api_spans = [(s.name, s.trace_id, s.attributes) for s in system.receiver.snapshot()
                         if s.service == "sluice-api"]
            tasks = [(s.name, s.trace_id, s.parent_span_id) for s in system.receiver.snapshot()
                     if s.service == "sluice-scheduler" and s.name.startswith("schedule ")]
            return f"api spans {api_spans[-5:]}; scheduler spans {tasks[-8:]}"

        request, task, dispatch = system.wait(chain, 120, "the api request's trace reaching the dispatch",
                                              detail=seen)
        assert request.parent_span_id in ("", "0" * 16)  # the request is the trace's root
        assert task.parent_span_id != "" and dispatch.trace_id == request.trace_id
    finally:
        assert httpx.delete(f"{api_url}/obs-trace", headers=headers, timeout=30).status_code == 202
