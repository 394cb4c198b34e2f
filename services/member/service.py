"""The member service leader: sink-worker liveness from heartbeats, as events.

Heartbeats arrive on core NATS (``heartbeat_subject(member)``, every ~1 s). The leader keeps the
last time it heard from each member; ``MemberTracker`` turns heartbeats and silence into
``member.joined`` / ``member.draining`` / ``member.left`` events, which the leader appends to
the members domain log. The log's fold is the list of live members, so a new leader starts from
the replayed list and gives every member on it a full TTL to be heard from.

One loop handles heartbeats and expiry in order: each event is appended (and folded) before
the next heartbeat is looked at, so a member cannot join twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.scheduling import MemberHeartbeatV3
from libs.config import Settings
from libs.control.members import MembersState, MemberTracker, members_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, LeaderLog, LeaseView, dead_letter
from libs.leader_service import Entry, LeaderLoop
from libs.service import ServiceRuntime
from libs.streams import HEARTBEAT_SUBJECTS, member_probe_subject
from services.member.liveness import decode_liveness
from services.member.probe import MemberProbes

log = logging.getLogger(__name__)

DOMAIN = "members"

MEMBERS = Gauge("sluice_members", "Live sink-worker members as the member leader sees them.", ["state"])
MEMBER_EVENTS = Counter("sluice_member_events", "Member events appended by this leader.", ["type"])
BAD_HEARTBEATS = Counter("sluice_member_bad_heartbeats", "Heartbeats that were not valid contracts.")


class MemberService:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.js = runtime.nc.jetstream()
        self.tracker: MemberTracker | None = None

    def make_log(self) -> DomainLog[MembersState]:
        return DomainLog(self.js, DOMAIN, producer=self.runtime.producer, fold=members_fold,
                         initial=MembersState(), restore=MembersState.restore, dump=MembersState.dump,
                         settings=self.settings)

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        nc = self.runtime.nc
        async with LeaderLoop[MemberHeartbeatV3, None](self.runtime, status_key=DOMAIN) as loop:
            handlers = MemberHandlers(leadership, domain_log, self.settings,
                                      probe=lambda member, incarnation: loop.spawn(
                                          self._probe(handlers.probes, member, incarnation)),
                                      reconnects=lambda: nc.stats.get("reconnects", 0),
                                      publish_status=loop.publish_status)
            self.tracker = handlers.tracker

            async def on_msg(msg: Msg) -> None:
                try:
                    # Liveness only: the tables (most of a heartbeat) are not read here.
                    heartbeat = decode_liveness(msg.data)
                    if not isinstance(heartbeat, MemberHeartbeatV3):
                        raise ContractError("unknown_type",
                                            f"{type(heartbeat).__name__} on a heartbeat subject")
                except ContractError as exc:
                    BAD_HEARTBEATS.inc()
                    await dead_letter(self.js, msg, exc.reason, exc.kind, "heartbeats", ack=False)
                    return
                loop.inbox.put(heartbeat)

            await loop.subscribe(HEARTBEAT_SUBJECTS, on_msg)
            log.info("member leader tracking heartbeats", extra={"epoch": leadership.epoch,
                                                                 "members": sorted(handlers.state.members)})
            await loop.run(handlers.handle, handlers.tick, lambda: handlers.check_every)

    async def _probe(self, probes: MemberProbes, member: str, incarnation: str) -> None:
        try:
            await self.runtime.nc.request(member_probe_subject(member, incarnation), b"", timeout=0.5)
        except NoRespondersError:
            probes.no_responders(member, incarnation, time.monotonic())
        except (TimeoutError, NatsTimeoutError):
            pass  # alive but slow (or stopped): only the TTL replaces it
        except Exception:
            log.debug("member probe failed", exc_info=True)
        else:
            probes.answered(member, incarnation)


class MemberHandlers:
    """One term's handlers: heartbeats go to the ``MemberTracker``; each turn probes the silent
    members and expires the gone ones. Each event is appended (and folded into ``state``, which
    the tracker reads next) before the next heartbeat is looked at."""

    def __init__(self, leadership: LeaseView, domain_log: LeaderLog, settings: Settings, *,
                 probe: Callable[[str, str], object], reconnects: Callable[[], int],
                 publish_status: Callable[[dict[str, Any]], None]) -> None:
        state = domain_log.state
        assert isinstance(state, MembersState)
        self.state = state
        self.epoch = leadership.epoch
        self.domain_log = domain_log
        self.tracker = MemberTracker(state, settings.member_ttl_s, time.monotonic())
        self.probes = MemberProbes(settings.heartbeat_interval_s, settings.member_fence_s)
        self.probe = probe
        self.reconnects = reconnects
        self.seen_reconnects = reconnects()
        self.reconnected_at: float | None = None
        self.publish_status = publish_status
        self.policy = SnapshotPolicy(settings.control_snapshot_every)
        self.policy.opened(domain_log)
        self.check_every = max(0.02, min(0.1, settings.member_ttl_s / 10))

    async def handle(self, entry: Entry[MemberHeartbeatV3, None]) -> None:
        hb = entry.item
        self.probes.heard(hb.member_id)
        await self._append(self.tracker.on_heartbeat(hb, time.monotonic()))

    async def tick(self) -> None:
        tracker, probes, state = self.tracker, self.probes, self.state
        events: list[BaseModel] = []
        now = time.monotonic()
        if self.reconnects() != self.seen_reconnects:
            self.seen_reconnects, self.reconnected_at = self.reconnects(), now
        for member, incarnation in probes.to_probe(state, tracker.last_seen, now):
            self.probe(member, incarnation)
        for left in probes.due(state, tracker.last_seen, now, self.reconnected_at):
            tracker.last_seen.pop(left.member_id, None)
            events.append(left)
        events.extend(tracker.expire(now))
        await self._append(events)
        await self.policy.maybe_snapshot(self.domain_log)
        self._publish_status()

    async def _append(self, events: list[BaseModel] | list[Any]) -> None:
        for event in events:
            # Appending folds the event into `state`, which the tracker reads next.
            await self.domain_log.append(event)
            self.policy.appended()
            etype = REGISTRY.key_of(type(event))[0]
            MEMBER_EVENTS.labels(etype).inc()
            log.info(etype, extra={"epoch": self.epoch, **event.model_dump()})

    def _publish_status(self) -> None:
        state, tracker = self.state, self.tracker
        now = time.monotonic()
        self.publish_status({
            m: {"incarnation": r.incarnation, "address": r.address, "draining": r.draining,
                "silent_s": round(now - tracker.last_seen.get(m, now), 2)}
            for m, r in sorted(state.members.items())
        })
        draining = sum(1 for r in state.members.values() if r.draining)
        MEMBERS.labels("alive").set(len(state.members) - draining)
        MEMBERS.labels("draining").set(draining)
