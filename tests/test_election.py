"""Leader election and fencing against the session's real nats-server, with real processes.

Each test has its own lease bucket and domain (stream), so they cannot see each other's leaders.
Waits are conditions with deadlines; nothing sleeps in place of synchronisation.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2
from libs.election import Election
from libs.eventstore import DomainLog, Fenced, LeaseLost
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.streams import LEADER_BUCKET, domain_stream

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
CANDIDATE = REPO / "tests" / "helpers" / "candidate.py"
TTL = 1.0


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str,
                     interval: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


def unique(prefix: str) -> str:
    return f"{prefix}{uuid4().hex[:10]}"


def joined(member: str) -> MemberJoinedV2:
    return MemberJoinedV2(member_id=member, incarnation="i", address="")


@dataclass(frozen=True)
class Entry:
    """One domain-log message read raw: the test process does not know the test.tick contract."""

    seq: int
    type: str
    epoch: int
    data: dict[str, Any]
    time: datetime


class RawLog:
    """Reads a domain stream message by message, without decoding through the registry."""

    def __init__(self, js: JetStreamContext, stream: str) -> None:
        self.js = js
        self.stream = stream
        self.entries: list[Entry] = []
        self._next = 1

    async def refresh(self) -> list[Entry]:
        try:
            last = (await self.js.stream_info(self.stream)).state.last_seq
        except NotFoundError:
            return self.entries
        while self._next <= last:
            try:
                raw = await self.js.get_msg(self.stream, seq=self._next)
            except NotFoundError:  # a snapshot rolled up
                raw = None
            if raw is not None and raw.data:
                env = json.loads(raw.data)
                self.entries.append(Entry(self._next, env["type"], env["epoch"], env["data"],
                                          datetime.fromisoformat(env["time"])))
            self._next += 1
        return self.entries

    def elected(self) -> list[Entry]:
        return [e for e in self.entries if e.type == "leader.elected"]

    def ticks(self, epoch: int | None = None) -> list[Entry]:
        return [e for e in self.entries if e.type == "test.tick" and (epoch is None or e.epoch == epoch)]


class Candidate:
    def __init__(self, name: str, url: str, bucket: str, domain: str, out_dir: Path) -> None:
        self.name = name
        self.out = out_dir / f"{name}.out"
        self.err = out_dir / f"{name}.err"
        env = {**os.environ, "SLUICE_NATS_URL": url}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CANDIDATE), "--url", url, "--bucket", bucket, "--domain", domain,
                 "--service", "svc", "--candidate", name, "--ttl", str(TTL)],
                stdout=out, stderr=err, env=env, cwd=REPO)

    def lines(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return int(self.proc.returncode)

    def diagnostics(self) -> str:
        return f"--- {self.name} stdout\n{self.out.read_text()}\n--- stderr\n{self.err.read_text()[-3000:]}"


@pytest.fixture
def candidates(tmp_path: Path) -> Iterator[list[Candidate]]:
    started: list[Candidate] = []
    yield started
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


async def leader_with_ticks(rlog: RawLog, after_epoch: int = 0, ticks: int = 3) -> Entry:
    """Wait for a LeaderElected newer than ``after_epoch`` followed by some of its ticks."""
    found: list[Entry] = []

    async def check() -> bool:
        await rlog.refresh()
        newer = [e for e in rlog.elected() if e.epoch > after_epoch]
        if newer and len([t for t in rlog.ticks(newer[-1].epoch) if t.seq > newer[-1].seq]) >= ticks:
            found[:] = [newer[-1]]
            return True
        return False

    await eventually(check, 15, f"a leader newer than epoch {after_epoch} that ticks")
    return found[0]


C = TypeVar("C", bound="Candidate")


async def leader_and_follower(rlog: RawLog, candidates: list[C]) -> tuple[Entry, C, C]:
    """The first leader that ticks, its candidate and the other one (of two)."""
    first = await leader_with_ticks(rlog)
    leader = next(c for c in candidates if c.name == first.data["candidate"])
    return first, leader, next(c for c in candidates if c is not leader)


async def resumed_leader_stays_fenced(rlog: RawLog, old: Candidate, first: Entry, second: Entry,
                                      within: float) -> None:
    """A leader that was stopped past its lease and resumed steps down, its successor keeps
    leading, and nothing of the old epoch lands after the successor's LeaderElected."""

    async def old_stepped_down() -> bool:
        return any(line["event"] == "stepdown" and line["epoch"] == first.epoch for line in old.lines())

    await eventually(old_stepped_down, within, "the resumed leader to step down")
    seen = len(rlog.ticks(second.epoch))

    async def more_ticks() -> bool:
        await rlog.refresh()
        return len(rlog.ticks(second.epoch)) >= seen + 5

    await eventually(more_ticks, within, "the new leader to keep ticking")
    late = [t for t in rlog.ticks(first.epoch) if t.seq > second.seq]
    assert late == [], f"the old epoch wrote after its successor's LeaderElected: {late}"
    # A follower now: it never claimed the lease again.
    assert [line["epoch"] for line in old.lines() if line["event"] == "leader"] == [first.epoch]


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
