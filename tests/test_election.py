"""Leader election and fencing against the session's real nats-server, with real processes.

Each test has its own lease bucket and domain (stream), so they cannot see each other's leaders.
Waits are conditions with deadlines; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext

from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2
from libs.election import Election
from libs.eventstore import DomainLog, Fenced, LeaseLost
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.streams import LEADER_BUCKET, domain_stream
from tests.helpers.election import (
    TTL,
    Candidate,
    RawLog,
    eventually,
    leader_and_follower,
    leader_with_ticks,
    resumed_leader_stays_fenced,
)


@pytest.fixture
def candidates(tmp_path: Path) -> Iterator[list[Candidate]]:
    started: list[Candidate] = []
    yield started
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()

pytestmark = pytest.mark.integration


def unique(prefix: str) -> str:
    return f"{prefix}{uuid4().hex[:10]}"


def joined(member: str) -> MemberJoinedV2:
    return MemberJoinedV2(member_id=member, incarnation="i", address="")


# --------------------------------------------------------------------------- in-process


async def test_deposed_domain_log_is_fenced(js: JetStreamContext) -> None:
    domain = unique("fence")
    old = DomainLog[Any](js, domain, producer="svc/old")
    await old.open("svc", "old", epoch=1)
    await old.append(joined("a"))

    new = DomainLog[Any](js, domain, producer="svc/new")
    elected_seq = await new.open("svc", "new", epoch=2)

    with pytest.raises(Fenced):
        await old.append(joined("written-by-a-deposed-leader"))
    with pytest.raises(Fenced):  # and it stays fenced without asking the server again
        await old.snapshot({"x": 1})
    assert await new.append(joined("b")) == elected_seq + 1
    rlog = RawLog(js, domain_stream(domain))
    entries = await rlog.refresh()
    assert not any(e.data.get("member_id") == "written-by-a-deposed-leader" for e in entries)

    # A candidate that won an older epoch than the log already holds must not lead at all.
    stale = DomainLog[Any](js, domain, producer="svc/stale")
    with pytest.raises(Fenced):
        await stale.open("svc", "stale", epoch=1)
    await js.delete_stream(domain_stream(domain))


async def test_domain_log_state_and_snapshot_survive_a_leader_change(js: JetStreamContext) -> None:
    domain = unique("snap")

    def fold(state: dict[str, Any], ev: Any) -> dict[str, Any]:
        if isinstance(ev.event, MemberJoinedV2):
            return {**state, ev.event.member_id: ev.seq}
        if isinstance(ev.event, LeaderElectedV1):
            return {**state, "_epoch": ev.event.epoch}
        return state

    empty: dict[str, Any] = {}
    first = DomainLog(js, domain, producer="svc/1", fold=fold, initial=empty)
    await first.open("svc", "one", epoch=3)
    for m in ("a", "b", "c"):
        await first.append(joined(m))
    await first.snapshot()
    await first.append(joined("d"))

    second = DomainLog(js, domain, producer="svc/2", fold=fold, initial=empty)
    await second.open("svc", "two", epoch=5)
    assert second.loaded is not None and second.loaded.snapshot_seq is not None
    assert second.loaded.events_replayed == 1  # only "d" came after the snapshot
    # Same members at the same sequences as the old leader knew, plus its own election.
    assert second.state == {**(first.state or {}), "_epoch": 5}
    await js.delete_stream(domain_stream(domain))


class _ExpiredLease:
    epoch = 1

    def valid(self) -> bool:
        return False


async def test_domain_log_checks_the_lease_before_publishing(js: JetStreamContext) -> None:
    domain = unique("lease")
    dlog = DomainLog[Any](js, domain, producer="svc/x")
    await dlog.open("svc", "x", epoch=1)
    before = await dlog.store.last_seq()
    dlog.leadership = _ExpiredLease()
    with pytest.raises(LeaseLost):
        await dlog.append(joined("late"))
    assert await dlog.store.last_seq() == before
    await js.delete_stream(domain_stream(domain))


async def test_a_stalled_leader_stops_trusting_its_lease_before_anyone_else_can_win(
        js: JetStreamContext) -> None:
    bucket = unique("lb")
    a = Election(js, "svc", "a", TTL, bucket=bucket)
    b = Election(js, "svc", "b", TTL, bucket=bucket)
    won = await a.try_acquire()
    assert won is not None and won.valid()
    assert await b.try_acquire() is None
    assert (await b.current()) is not None and b.observed is not None and b.observed.candidate == "a"

    # a never renews (as if stalled): b wins once the key expires, and by then a knows it is out.
    stopping = asyncio.Event()
    taken = await asyncio.wait_for(b.campaign(stopping), 3 * TTL)
    assert taken is not None and taken.epoch > won.epoch
    assert not won.valid() and won.lost_reason == "lease-expired"
    assert won.deadline < time.monotonic()

    # Resigning hands over without waiting for a TTL; renewing a resigned lease is impossible.
    keeper = asyncio.create_task(b.keep(taken))
    assert await b.resign(taken)
    await asyncio.wait_for(keeper, 2)
    again = await a.try_acquire()
    assert again is not None and again.epoch > taken.epoch
    await a.resign(again)
    await js.delete_key_value(bucket)


# --------------------------------------------------------------------------- processes


async def test_sigkill_leader_fails_over_within_two_ttl(js: JetStreamContext, nats_server: NatsServer,
                                                      candidates: list[Candidate], tmp_path: Path) -> None:
    bucket, domain = unique("lb"), unique("kill")
    candidates += [Candidate(n, nats_server.url, bucket, domain, tmp_path) for n in ("a", "b")]
    rlog = RawLog(js, domain_stream(domain))
    try:
        first, leader, other = await leader_and_follower(rlog, candidates)

        leader.signal(signal.SIGKILL)
        killed_at = datetime.now().astimezone()
        leader.proc.wait()
        second = await leader_with_ticks(rlog, after_epoch=first.epoch)

        assert second.data["candidate"] == other.name
        takeover = (second.time - killed_at).total_seconds()
        print(f"takeover after SIGKILL: {takeover:.2f}s (ttl {TTL})")
        assert takeover < 2 * TTL, f"took over after {takeover:.2f}s"
        assert not [t for t in rlog.ticks(first.epoch) if t.seq > second.seq]
        assert other.stop() == 0
    except BaseException:
        for c in candidates:
            print(c.diagnostics())
        raise


async def test_sigstopped_leader_steps_down_and_is_fenced(js: JetStreamContext, nats_server: NatsServer,
                                                          candidates: list[Candidate],
                                                          tmp_path: Path) -> None:
    bucket, domain = unique("lb"), unique("stop")
    candidates += [Candidate(n, nats_server.url, bucket, domain, tmp_path) for n in ("a", "b")]
    rlog = RawLog(js, domain_stream(domain))
    try:
        first, old, new = await leader_and_follower(rlog, candidates)

        old.signal(signal.SIGSTOP)
        try:
            second = await leader_with_ticks(rlog, after_epoch=first.epoch)
        finally:
            old.signal(signal.SIGCONT)
        assert second.data["candidate"] == new.name
        # Let the new leader keep ticking for a while after the old one woke up.
        await resumed_leader_stays_fenced(rlog, old, first, second, 10)
        assert old.proc.poll() is None, "the old leader should step down, not crash"
        assert old.stop() == 0 and new.stop() == 0
    except BaseException:
        for c in candidates:
            print(c.diagnostics())
        raise


async def _health(proc: ServiceProcess) -> dict[str, Any] | None:
    return await asyncio.to_thread(proc.health)


@pytest.fixture
async def members(service_env: dict[str, str], tmp_path: Path) -> AsyncIterator[list[ServiceProcess]]:
    procs = [ServiceProcess("services.member", env=service_env, log_dir=tmp_path, instance_id=f"member-{n}")
             for n in ("a", "b")]
    yield procs
    for p in procs:
        p.kill()


async def test_member_service_failover(js: JetStreamContext, members: list[ServiceProcess]) -> None:
    for p in members:
        p.start()
    try:
        for p in members:
            await asyncio.to_thread(p.wait_healthy, 60)
        # The bucket may predate this test with another TTL; the lease follows the bucket's.
        ttl = (await (await js.key_value(LEADER_BUCKET)).status()).ttl or 0.0
        assert ttl > 0
        state: dict[str, Any] = {}

        async def one_leader() -> bool:
            healths = [await _health(p) for p in members]
            leaders = [h for h in healths if h and h.get("leader")]
            followers = [h for h in healths if h and h.get("leader") is False]
            if len(leaders) == 1 and len(followers) == 1 and \
                    followers[0].get("leader_id") == leaders[0]["instance"]:
                state["leader"] = leaders[0]
                return True
            return False

        await eventually(one_leader, 30, "exactly one member leader", interval=0.1)
        first = state["leader"]
        leader = next(p for p in members if p.instance_id == first["instance"])
        survivor = next(p for p in members if p is not leader)

        leader.kill()
        killed_at = time.monotonic()

        async def took_over() -> bool:
            h = await _health(survivor)
            if h and h.get("leader") and h["epoch"] > first["epoch"]:
                state["new"] = h
                return True
            return False

        await eventually(took_over, 6 * ttl, "the survivor to take over", interval=0.05)
        takeover = time.monotonic() - killed_at
        print(f"member takeover after SIGKILL: {takeover:.2f}s (ttl {ttl})")
        assert takeover < 2 * ttl, f"took over after {takeover:.2f}s (ttl {ttl})"
        assert state["new"]["leader_id"] == survivor.instance_id

        assert await asyncio.to_thread(survivor.terminate) == 0
    except BaseException:
        for p in members:
            print(f"--- {p.instance_id}\n{p.tail_log(60)}")
        raise


async def test_append_many_lands_in_order_and_a_writer_in_between_fences_it(js: JetStreamContext) -> None:
    """``append_many`` pipelines its publishes, each fenced on the sequence right before it:
    a burst lands in order with the fold following it, and a writer that got in between (a
    deposed leader's rival) refuses the whole burst and fences the log, nothing of it stored."""
    domain = unique("many")

    def fold(state: dict[str, Any], ev: Any) -> dict[str, Any]:
        if isinstance(ev.event, MemberJoinedV2):
            return {**state, ev.event.member_id: ev.seq}
        return state

    empty: dict[str, Any] = {}
    dlog = DomainLog(js, domain, producer="svc/1", fold=fold, initial=empty)
    await dlog.open("svc", "one", epoch=1)
    start = dlog.last_seq
    names = [f"m{i:03d}" for i in range(200)]
    seqs = await dlog.append_many([joined(n) for n in names])
    assert seqs == list(range(start + 1, start + 201)) and dlog.last_seq == start + 200
    assert dlog.state == {n: start + 1 + i for i, n in enumerate(names)}
    stored = [ev async for ev in dlog.store.replay(dlog.events_subject)]
    assert [ev.event.member_id for ev in stored if isinstance(ev.event, MemberJoinedV2)] == names

    # A second writer appends behind this log's back: the next burst is refused as a whole.
    rival = DomainLog(js, domain, producer="svc/2", fold=fold, initial=empty)
    await rival.open("svc", "two", epoch=2)
    before = await dlog.store.last_seq()
    with pytest.raises(Fenced):
        await dlog.append_many([joined("late1"), joined("late2"), joined("late3")])
    assert dlog.fenced and await dlog.store.last_seq() == before
    await js.delete_stream(domain_stream(domain))


async def test_append_many_settles_an_event_that_landed_without_its_ack(js: JetStreamContext) -> None:
    """An event of a burst stored while its ack went missing is found by its message id at the
    next sequence (not published twice, not taken for a rival's write); the rest follow it."""
    domain = unique("lost")
    dlog = DomainLog[Any](js, domain, producer="svc/1")
    await dlog.open("svc", "one", epoch=1)
    start = dlog.last_seq
    real = dlog.store.append_raw_pipelined

    async def first_ack_lost(items: Any, *, expected_last_seq: int, ack_within_s: float) -> list[Any]:
        results = await real(items, expected_last_seq=expected_last_seq, ack_within_s=ack_within_s)
        return [TimeoutError("ack lost"), *results[1:]]

    dlog.store.append_raw_pipelined = first_ack_lost  # type: ignore[method-assign]
    seqs = await dlog.append_many([joined("a"), joined("b"), joined("c")])
    assert seqs == [start + 1, start + 2, start + 3] and not dlog.fenced
    assert await dlog.store.last_seq() == start + 3
    await js.delete_stream(domain_stream(domain))
