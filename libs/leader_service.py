"""The ``main`` of a leader-elected service: the leader loop wired to the service runtime."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from libs.election import Work, hold_leadership, run_leader_loop
from libs.service import ServiceRuntime

ServiceMain = Callable[[ServiceRuntime], Coroutine[Any, Any, None]]


def leader_main(domain: str, work: Work | None = None) -> ServiceMain:
    """A service main that campaigns for the service's lease and, while leader, owns ``domain``.

    ``work`` runs with the open domain log for as long as the lease holds; the default only
    holds the lease, for services whose domain logic arrives later.
    """

    async def main(runtime: ServiceRuntime) -> None:
        settings = runtime.settings
        await run_leader_loop(
            runtime.nc.jetstream(), service=runtime.name, candidate=settings.instance_id,
            domain=domain, producer=runtime.producer, ttl=settings.lease_ttl_s,
            work=work or hold_leadership, stopping=runtime.stopping, status=runtime.status,
            replicas=settings.stream_replicas,
        )

    return main
