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

import asyncio
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Counter, Gauge
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.scheduling import MemberHeartbeatV1
from libs.control.members import MembersState, MemberTracker, members_fold
from libs.control.snapshots import SnapshotPolicy
from libs.election import Leadership
from libs.eventstore import DomainLog, dead_letter
from libs.service import ServiceRuntime
from libs.streams import HEARTBEAT_SUBJECTS, member_probe_subject
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
        state = domain_log.state
        assert isinstance(state, MembersState)
        tracker = self.tracker = MemberTracker(state, self.settings.member_ttl_s, time.monotonic())
        probes = MemberProbes(self.settings.heartbeat_interval_s, self.settings.member_fence_s)
        nc = self.runtime.nc
        reconnects = nc.stats.get("reconnects", 0)
        reconnected_at: float | None = None
        probing: set[asyncio.Task[None]] = set()

        async def probe(member: str, incarnation: str) -> None:
            try:
                await nc.request(member_probe_subject(member, incarnation), b"", timeout=0.5)
            except NoRespondersError:
                probes.no_responders(member, incarnation, time.monotonic())
            except (TimeoutError, NatsTimeoutError):
                pass  # alive but slow (or stopped): only the TTL replaces it
            except Exception:
                log.debug("member probe failed", exc_info=True)
            else:
                probes.answered(member, incarnation)
        policy = SnapshotPolicy(self.settings.control_snapshot_every)
        policy.opened(domain_log)
        queue: asyncio.Queue[MemberHeartbeatV1] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            try:
                decoded = REGISTRY.decode(msg.data)
                if not isinstance(decoded.event, MemberHeartbeatV1):
                    raise ContractError("unknown_type", f"{decoded.envelope.type} on a heartbeat subject")
            except ContractError as exc:
                BAD_HEARTBEATS.inc()
                await dead_letter(self.js, msg, exc.reason, exc.kind, "heartbeats", ack=False)
                return
            queue.put_nowait(decoded.event)

        sub = await self.runtime.nc.subscribe(HEARTBEAT_SUBJECTS, cb=on_msg)
        log.info("member leader tracking heartbeats", extra={"epoch": leadership.epoch,
                                                             "members": sorted(state.members)})
        check_every = max(0.02, min(0.1, self.settings.member_ttl_s / 10))
        try:
            while True:
                events: list[BaseModel] = []
                try:
                    hb = await asyncio.wait_for(queue.get(), timeout=check_every)
                except TimeoutError:
                    pass
                else:
                    probes.heard(hb.member_id)
                    events.extend(tracker.on_heartbeat(hb, time.monotonic()))
                now = time.monotonic()
                if nc.stats.get("reconnects", 0) != reconnects:
                    reconnects, reconnected_at = nc.stats.get("reconnects", 0), now
                for member, incarnation in probes.to_probe(state, tracker.last_seen, now):
                    task = asyncio.create_task(probe(member, incarnation))
                    probing.add(task)
                    task.add_done_callback(probing.discard)
                for left in probes.due(state, tracker.last_seen, now, reconnected_at):
                    tracker.last_seen.pop(left.member_id, None)
                    events.append(left)
                events.extend(tracker.expire(now))
                for event in events:
                    # Appending folds the event into `state`, which the tracker reads next.
                    await domain_log.append(event)
                    policy.appended()
                    etype = REGISTRY.key_of(type(event))[0]
                    MEMBER_EVENTS.labels(etype).inc()
                    log.info(etype, extra={"epoch": leadership.epoch, **event.model_dump()})
                await policy.maybe_snapshot(domain_log)
                self._publish_status(state, tracker)
        finally:
            for task in probing:
                task.cancel()
            await sub.unsubscribe()
            self.runtime.status.pop("members", None)

    def _publish_status(self, state: MembersState, tracker: MemberTracker) -> None:
        now = time.monotonic()
        self.runtime.status["members"] = {
            m: {"incarnation": r.incarnation, "address": r.address, "draining": r.draining,
                "silent_s": round(now - tracker.last_seen.get(m, now), 2)}
            for m, r in sorted(state.members.items())
        }
        draining = sum(1 for r in state.members.values() if r.draining)
        MEMBERS.labels("alive").set(len(state.members) - draining)
        MEMBERS.labels("draining").set(draining)
