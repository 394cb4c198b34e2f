"""Early takeover of a gone leader's lease (``libs.election`` probes): the decision rule, the
probe against the real nats-server, and candidate processes killed or stopped.

A killed leader's connection closes, its liveness subscription goes with it and a follower
takes over well inside the TTL; a stopped (SIGSTOP) leader keeps its connection, so it is only
replaced after the TTL and, resumed, is still fenced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from uuid import uuid4

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.election import Election, LeaderInfo, holder_gone, liveness_subject, probe
from libs.localservers.nats_server import NatsServer
from libs.streams import domain_stream
from tests.helpers.election import (
    CANDIDATE,
    REPO,
    Candidate,
    RawLog,
    leader_and_follower,
    leader_with_ticks,
    resumed_leader_stays_fenced,
)

# Long enough that a takeover by the TTL and one by the probe cannot be mistaken for each other.
TTL = 5.0


def test_holder_gone_needs_every_probe_to_find_nobody() -> None:
    assert holder_gone(["gone", "gone"])
    assert not holder_gone(["gone"])  # one probe could race the holder's own subscribe
    assert not holder_gone(["gone", "silent"])  # slow or stopped: may still act
    assert not holder_gone(["gone", "alive"])
    assert not holder_gone(["silent", "silent"])
    assert not holder_gone([])


async def test_probe_tells_gone_from_silent_and_alive(nc: Client) -> None:
    subject = liveness_subject("lb", f"svc{uuid4().hex[:8]}", 7)
    assert await probe(nc, subject, 0.5) == "gone"

    async def answer(msg: Msg) -> None:
        await msg.respond(b"7")

    sub = await nc.subscribe(subject, cb=answer)
    await nc.flush()
    assert await probe(nc, subject, 2.0) == "alive"
    await sub.unsubscribe()

    async def ignore(msg: Msg) -> None:
        return None  # subscribed but never answering: a stopped process looks like this

    sub = await nc.subscribe(subject, cb=ignore)
    await nc.flush()
    started = time.monotonic()
    assert await probe(nc, subject, 0.3) == "silent"
    assert time.monotonic() - started >= 0.25
    await sub.unsubscribe()


async def test_a_live_holder_keeps_its_lease_and_a_gone_one_loses_it(js: JetStreamContext,
                                                                     nc: Client) -> None:
    bucket = f"lb{uuid4().hex[:10]}"
    holder = Election(js, "svc", "a", TTL, bucket=bucket)
    won = await holder.try_acquire()
    assert won is not None
    follower = Election(js, "svc", "b", TTL, bucket=bucket, nc=nc)

    async def answer(msg: Msg) -> None:
        await msg.respond(b"1")

    sub = await nc.subscribe(holder.liveness_subject(won.epoch), cb=answer)
    await nc.flush()
    assert await follower.try_acquire() is None  # it answers: alive
    await sub.unsubscribe()
    await nc.flush()
    # Nobody listens any more, but the lease was renewed after the follower looked: the
    # compare-and-delete at the revision it saw must fail.
    seen = await follower.current()
    assert seen is not None
    await (await holder.setup()).update("svc", b'{"candidate": "a", "epoch": %d, "token": "t"}' % won.epoch,
                                        last=seen.revision)
    assert not await follower.take_over(seen)
    taken = await follower.try_acquire()  # now it probes the current revision
    assert taken is not None and taken.epoch > won.epoch
    info = await follower.current()
    assert info == LeaderInfo("b", taken.epoch, taken.revision)


class ProbingCandidate(Candidate):
    """A candidate process that probes the holder like the services do."""

    def __init__(self, name: str, url: str, bucket: str, domain: str, out_dir: Path) -> None:
        self.name = name
        self.out = out_dir / f"{name}.out"
        self.err = out_dir / f"{name}.err"
        env = {**os.environ, "SLUICE_NATS_URL": url}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CANDIDATE), "--url", url, "--bucket", bucket, "--domain", domain,
                 "--service", "svc", "--candidate", name, "--ttl", str(TTL), "--probe"],
                stdout=out, stderr=err, env=env, cwd=REPO)


@pytest.fixture
def pair(nats_server: NatsServer, tmp_path: Path) -> Iterator[tuple[list[ProbingCandidate], str]]:
    bucket, domain = f"lb{uuid4().hex[:10]}", f"probe{uuid4().hex[:10]}"
    procs = [ProbingCandidate(n, nats_server.url, bucket, domain, tmp_path) for n in ("a", "b")]
    yield procs, domain
    for c in procs:
        c.signal(signal.SIGCONT)
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


@pytest.mark.integration
async def test_killed_leader_is_replaced_before_its_lease_expires(js: JetStreamContext,
        pair: tuple[list[ProbingCandidate], str]) -> None:
    procs, domain = pair
    rlog = RawLog(js, domain_stream(domain))
    try:
        first, old, other = await leader_and_follower(rlog, procs)
        old.signal(signal.SIGKILL)
        killed_at = datetime.now().astimezone()
        old.proc.wait()
        second = await leader_with_ticks(rlog, after_epoch=first.epoch)
        takeover = (second.time - killed_at).total_seconds()
        print(f"takeover after SIGKILL with probes: {takeover:.2f}s (ttl {TTL})")
        assert second.data["candidate"] == other.name
        assert takeover < 0.6 * TTL, f"took {takeover:.2f}s: the probe did not shorten the TTL path"
        assert not [t for t in rlog.ticks(first.epoch) if t.seq > second.seq]
    except BaseException:
        for c in procs:
            print(c.diagnostics())
        raise


@pytest.mark.integration
async def test_stopped_leader_waits_for_the_ttl_and_stays_fenced(js: JetStreamContext,
        pair: tuple[list[ProbingCandidate], str]) -> None:
    procs, domain = pair
    rlog = RawLog(js, domain_stream(domain))
    try:
        first, old, new = await leader_and_follower(rlog, procs)
        old.signal(signal.SIGSTOP)
        stopped_at = datetime.now().astimezone()
        try:
            second = await leader_with_ticks(rlog, after_epoch=first.epoch)
        finally:
            old.signal(signal.SIGCONT)
        takeover = (second.time - stopped_at).total_seconds()
        print(f"takeover after SIGSTOP with probes: {takeover:.2f}s (ttl {TTL})")
        assert second.data["candidate"] == new.name
        # The lease was renewed at most TTL/3 before the stop: expiry needs at least 2/3 TTL.
        assert takeover >= 0.5 * TTL, f"a stopped leader was replaced after {takeover:.2f}s, before its TTL"

        await resumed_leader_stays_fenced(rlog, old, first, second, 20)
    except BaseException:
        for c in procs:
            print(c.diagnostics())
        raise
