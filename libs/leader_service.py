"""The ``main`` of a leader-elected service: the leader loop wired to the service runtime."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from libs.election import Leadership, Work, hold_leadership, run_leader_loop
from libs.eventstore import DomainLog
from libs.service import ServiceRuntime

ServiceMain = Callable[[ServiceRuntime], Coroutine[Any, Any, None]]


class LeaderDomain(Protocol):
    """A service's leader side: the work of one term, and the domain log it works on (a log
    with the domain's fold, so the term starts from the replayed state)."""

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None: ...

    def make_log(self) -> DomainLog[Any]: ...


def leader_main(domain: str, work: Work | None = None,
                service: Callable[[ServiceRuntime], LeaderDomain] | None = None) -> ServiceMain:
    """A service main that campaigns for the service's lease and, while leader, owns ``domain``.

    ``service`` builds the leader side from the runtime (its ``lead`` and ``make_log``);
    otherwise ``work`` runs with a plain domain log. The default only holds the lease, for
    services whose domain logic arrives later.
    """

    async def main(runtime: ServiceRuntime) -> None:
        settings = runtime.settings
        leader = service(runtime) if service is not None else None
        await run_leader_loop(
            runtime.nc.jetstream(), service=runtime.name, candidate=settings.instance_id,
            domain=domain, producer=runtime.producer, ttl=settings.lease_ttl_s,
            work=leader.lead if leader is not None else (work or hold_leadership),
            stopping=runtime.stopping, status=runtime.status,
            log_factory=leader.make_log if leader is not None else None,
            replicas=settings.stream_replicas, nc=runtime.nc,
        )

    return main
