"""Entry point: ``python -m services.sink_worker`` (the ``sluice-sink-worker`` script).

The worker's state is in its health status (``GET /healthz``: changefeeds, spans with their
checkpoint, resolved ts and lag, the last round, and with the control plane the agent: member
id, incarnation, epoch seen, every dispatched span's state) and its Prometheus metrics
(``sluice_sink_*``).
"""

from __future__ import annotations

import asyncio
import logging

from libs.service import ServiceRuntime, run_service
from libs.spark import get_spark, stop_spark
from services.sink_worker.agent import SinkAgent
from services.sink_worker.ddl.shard import ShardDdl
from services.sink_worker.worker import SinkWorker

log = logging.getLogger(__name__)


async def run(runtime: ServiceRuntime) -> None:
    settings = runtime.settings
    agent = None
    if not settings.sink_standalone:
        agent = SinkAgent(runtime.nc, member_id=settings.instance_id,
                          address=f"http://{settings.http_host}:{runtime.port}",
                          heartbeat_interval_s=settings.heartbeat_interval_s,
                          writer_log=settings.sink_writer_log, producer=runtime.producer,
                          fence_s=settings.member_fence_s)
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
        if worker.spark_started:
            # Bounded: the runtime's grace period is shared with the round that just ended.
            try:
                await asyncio.wait_for(asyncio.to_thread(stop_spark), timeout=3.0)
            except Exception:
                log.warning("Spark did not stop in time; the JVM ends with the process")


def main() -> None:
    run_service("sink-worker", run)


if __name__ == "__main__":
    main()
