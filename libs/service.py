"""The runtime every Sluice service shares: health/metrics over uvicorn, NATS, SIGTERM.

A service is a ``main(runtime)`` coroutine that does its work until ``runtime.stopping`` is set.
``run_service`` serves ``/healthz``, ``/readyz`` and ``/metrics`` beside it and shuts down
cleanly on SIGTERM or SIGINT: it sets ``stopping``, gives ``main`` time to finish, stops uvicorn
and drains the NATS connection, then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

import uvicorn
from nats.aio.client import Client

from libs.config import Settings, get_settings
from libs.loop_watch import LoopWatch
from libs.nats_client import connect
from libs.ops_http import OpsAnswer, OpsApp, json_answer
from libs.telemetry.logs import setup_logging
from libs.telemetry.metrics import render_latest
from libs.telemetry.tracing import setup_tracing, shutdown_tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

# Default HTTP ports, one per service, so a whole system can run on one host.
DEFAULT_PORTS = {
    "api": 8100,
    "capture": 8101,
    "member": 8102,
    "scheduler": 8103,
    "replication-manager": 8104,
    "ddl-lock": 8105,
    "sink-worker": 8106,
}

ReadyCheck = Callable[[], bool]

# How long the exit waits for worker threads (``asyncio.to_thread``) once ``main`` is done. A
# thread blocked in a JVM start or a Spark job cannot be interrupted from Python, and both
# asyncio.run (shutdown_default_executor) and the interpreter (it joins executor threads at
# exit) would wait for it without a bound: a sink-worker stopped while warming Spark hung
# past its 20 s kill. Whatever such a thread still does writes nothing that matters: every
# write path is awaited by ``main`` (checkpoints stored, NATS flushed) before this point.
_THREADS_GRACE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ServiceRuntime:
    def __init__(self, name: str, settings: Settings | None = None, app: FastAPI | None = None) -> None:
        self.name = name
        self.settings = settings or get_settings()
        self.stopping = asyncio.Event()
        self.status: dict[str, Any] = {}
        self._ready_checks: dict[str, ReadyCheck] = {}
        self._nc: Client | None = None
        self.port = self.settings.http_port or DEFAULT_PORTS.get(name, 8199)
        ops = {"/healthz": self._healthz, "/readyz": self._readyz, "/metrics": self._metrics}
        self.app: Any = OpsApp(ops) if app is None else _with_ops_routes(app, ops)

    @property
    def producer(self) -> str:
        return f"{self.name}/{self.settings.instance_id}"

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError("NATS is not connected yet")
        return self._nc

    def add_ready_check(self, name: str, check: ReadyCheck) -> None:
        self._ready_checks[name] = check

    def _healthz(self) -> OpsAnswer:
        # A service sets status["unhealthy"] to the reason when it cannot do its job and only
        # an operator can mend it (e.g. capture's source purged the binlog it needs).
        unhealthy = self.status.get("unhealthy")
        # A value may be a function: a status that costs something to build (every span's) is
        # built when asked for, not on every change.
        status = {k: v() if callable(v) else v for k, v in self.status.items()}
        body = {"status": "unhealthy" if unhealthy else "ok", "service": self.name,
                "instance": self.settings.instance_id, **status}
        return json_answer(body, 503 if unhealthy else 200)

    def _readyz(self) -> OpsAnswer:
        failing = [n for n, check in self._ready_checks.items() if not check()]
        if self._nc is None or not self._nc.is_connected:
            failing.append("nats")
        return json_answer({"ready": not failing, "failing": failing}, 200 if not failing else 503)

    def _metrics(self) -> OpsAnswer:
        payload, content_type = render_latest()
        return 200, payload, content_type

    async def run(self, main: Callable[[ServiceRuntime], Coroutine[Any, Any, None]]) -> None:
        # Whatever a service writes (the api's read model, spools, Spark's files) is its own:
        # 0600 files, 0700 directories.
        os.umask(0o077)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        watch = LoopWatch(loop, threshold_s=self.settings.loop_stall_log_s)
        if self.settings.loop_stall_log_s > 0:
            watch.start()
        self._nc = await connect(self.settings, name=self.producer, service=self.name)
        server = _Server(uvicorn.Config(self.app, host=self.settings.http_host, port=self.port,
                                        log_config=None, access_log=False, lifespan="off"))
        server_task = asyncio.create_task(server.serve(), name="uvicorn")
        main_task = asyncio.create_task(main(self), name=f"{self.name}-main")
        log.info("service started", extra={"service": self.name, "port": self.port})
        stop_wait = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait({main_task, server_task, stop_wait},
                                     return_when=asyncio.FIRST_COMPLETED)
        failure: BaseException | None = None
        for task in (main_task, server_task):
            if task in done and not task.cancelled() and task.exception() is not None:
                failure = task.exception()
                log.error("%s exited with an error", task.get_name(), exc_info=failure)
        self.stopping.set()
        # main gets a grace period to finish its work (drain, resign) before it is cancelled.
        if not main_task.done():
            try:
                await asyncio.wait_for(main_task, timeout=10)
            except (TimeoutError, asyncio.CancelledError):
                pass
            except Exception as exc:  # already logged by the task itself where it matters
                failure = failure or exc
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server_task, timeout=5)
        stop_wait.cancel()
        # main has finished its work (or was cancelled), so there is nothing left for a drain to
        # wait for but the subscriptions' queues, and a drain cut short by a timeout leaves
        # nats-py's gathered future unretrieved (an asyncio ERROR at every stop): flush what was
        # published, then close.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.flush(), timeout=5)
        with contextlib.suppress(Exception):
            await self._nc.close()
        watch.stop()
        shutdown_tracing()
        log.info("service stopped", extra={"service": self.name})
        if failure is not None:
            raise failure


def _with_ops_routes(app: FastAPI, ops: dict[str, Callable[[], OpsAnswer]]) -> FastAPI:
    """The api's FastAPI app with the ops handlers as routes (listed in its OpenAPI, tag ops)."""
    from fastapi import Response

    def route(handler: Callable[[], OpsAnswer]) -> Callable[[], Response]:
        # A closure, not a default argument: FastAPI would read a parameter as a query field.
        def endpoint() -> Response:
            status, body, content_type = handler()
            return Response(body, status_code=status, media_type=content_type)
        return endpoint

    for path, handler in ops.items():
        app.add_api_route(path, route(handler), methods=["GET"], tags=["ops"], name=path.strip("/"),
                          response_model=None)
    return app


def run_service(name: str, main: Callable[[ServiceRuntime], Coroutine[Any, Any, None]],
                app: FastAPI | None = None) -> None:
    settings = get_settings()
    setup_logging(name, settings)
    setup_tracing(name)
    runtime = ServiceRuntime(name, settings, app=app)
    code = 0
    try:
        _run_bounded(runtime.run(main))
    except Exception:
        log.exception("service %s failed", name)
        code = 1
    busy = _busy_threads(time.monotonic() + _THREADS_GRACE_S)
    if busy:
        log.warning("exiting with threads still busy", extra={"threads": busy[:10]})
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def _busy_threads(deadline: float) -> list[str]:
    """Names of the non-daemon threads still running at ``deadline`` (each gets until then)."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and t.is_alive() and not t.daemon]


def _run_bounded(coro: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` with a bounded wait for the default executor's threads."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=_THREADS_GRACE_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
            # Not loop.shutdown_default_executor(): even cancelled, it joins the executor's
            # threads without a bound. close() shuts the executor down without waiting.
        finally:
            asyncio.set_event_loop(None)
            loop.close()
