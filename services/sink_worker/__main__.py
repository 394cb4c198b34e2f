"""Entry point: ``python -m services.sink_worker`` (the ``sluice-sink-worker`` script).

The worker's state is in its health status (``GET /healthz``: changefeeds, spans with their
checkpoint, resolved ts and lag, the last round, and with the control plane the agent: member
id, incarnation, epoch seen, every dispatched span's state) and its Prometheus metrics
(``sluice_sink_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.service import ServiceRuntime

log = logging.getLogger(__name__)

# Set in the environment of a worker that re-executed itself for its allocator; Spark's Python
# processes, which it starts, go back to Python's own (libs/spark.py).
MALLOC_REEXEC = "SLUICE_INTERNAL_MALLOC_REEXEC"
# Python's own allocator by default: under glibc's, a streamed large transaction's windows left
# the worker's peak RSS 466 MiB up instead of 55 (test_large_txn_process, three spans), the
# memory only given back at the idle trim; "malloc" trades that peak for a smaller idle process.
DEFAULT_MALLOC = ""


def reexec_args(environ: dict[str, str], orig_argv: list[str], executable: str,
                allocator: str) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute this process with ``PYTHONMALLOC=allocator``,
    or None when it runs with it already, the operator chose one, or ``allocator`` is empty.

    Why: a round allocates hundreds of MiB of small objects that live until it is applied;
    pymalloc keeps each 1 MiB arena of them as long as one object in it lives, and returns
    nothing in between (measured: 187 arenas held for 68 MB of live objects, the worker's
    process at 400 MiB idle). Under the C allocator the same memory is freed to glibc, whose
    ``malloc_trim`` at the idle trim gives it back (209 MiB idle)."""
    if not allocator or environ.get("PYTHONMALLOC"):
        return None
    return [executable, *orig_argv[1:]], {**environ, "PYTHONMALLOC": allocator, MALLOC_REEXEC: "1"}


async def run(runtime: ServiceRuntime) -> None:
    from libs.nats_client import connect
    from libs.spark import get_spark, stop_spark
    from services.sink_worker.agent import SinkAgent
    from services.sink_worker.ddl.shard import ShardDdl
    from services.sink_worker.worker import SinkWorker

    settings = runtime.settings
    agent = None
    heartbeat_nc = None
    if not settings.sink_standalone:
        # Heartbeats on a connection of their own: see SinkAgent.hb_nc.
        heartbeat_nc = await connect(settings, name=f"{runtime.producer}/heartbeats", service=runtime.name)
        agent = SinkAgent(runtime.nc, member_id=settings.instance_id, heartbeat_nc=heartbeat_nc,
                          address=f"http://{settings.http_host}:{runtime.port}",
                          heartbeat_interval_s=settings.heartbeat_interval_s,
                          writer_log=settings.sink_writer_log, producer=runtime.producer,
                          fence_s=settings.member_fence_s,
                          heartbeat_complete_s=settings.heartbeat_complete_interval_s)
        runtime.add_ready_check("heartbeats", lambda: agent is not None and agent.heartbeats_sent > 0)
    shard_ddl = ShardDdl(runtime.nc, producer=runtime.producer,
                         info_resend_s=settings.shard_ddl_info_resend_s,
                         discovery_interval_s=settings.sink_discovery_interval_s)
    worker = SinkWorker(runtime.nc.jetstream(), settings, runtime.stopping,
                        lambda: get_spark(settings), status=runtime.status, agent=agent, shard_ddl=shard_ddl)
    runtime.add_ready_check("changefeeds", lambda: worker.changefeeds_replayed)
    if agent is not None:
        # A member warms Spark at start; until then a span it takes pays the cold start.
        runtime.add_ready_check("spark_warm", lambda: worker.spark_warm)
    try:
        await worker.run()
    finally:
        if heartbeat_nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(heartbeat_nc.close(), timeout=2.0)
        if worker.spark_started:
            # Bounded: the runtime's grace period is shared with the round that just ended.
            try:
                await asyncio.wait_for(asyncio.to_thread(stop_spark), timeout=3.0)
            except Exception:
                log.warning("Spark did not stop in time; the JVM ends with the process")


def main() -> None:
    # Before the service's own imports, and read from the environment as Settings reads it
    # (``sink_python_malloc``) without importing pydantic: the new process starts over.
    allocator = os.environ.get("SLUICE_SINK_PYTHON_MALLOC", DEFAULT_MALLOC)
    command = reexec_args(dict(os.environ), sys.orig_argv, sys.executable, allocator)
    if command is not None:
        argv, env = command
        os.execve(argv[0], argv, env)
    from libs.service import run_service

    run_service("sink-worker", run)


if __name__ == "__main__":
    main()
