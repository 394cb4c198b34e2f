"""Leader election on a JetStream KV bucket, and the leader loop every leader service runs.

The lease is one key per service in ``LEADER_BUCKET`` (history 1, TTL = the lease TTL, so a key
nobody renews disappears on its own). ``create`` wins; the winner renews with
``update(last=revision)`` every TTL/3; the revision it won at is its epoch, and a later win
always gets a higher one. Followers poll every TTL/4 and try ``create`` once the key is gone.

Safety does not rest on the TTL alone (Zeppelin's "simple lock" trusts timing; we do not):
- The leader trusts its lease only until ``last successful renew *sent* + 0.8 * TTL`` on its own
  monotonic clock. The server stamped that renew later than we sent it, so the key outlives our
  deadline: a leader that cannot renew, or was stopped past its lease, stops acting before
  anybody else can win.
- Every append to the domain log is fenced on the last sequence (``DomainLog``), so even a
  leader that acts late cannot write after its successor's ``LeaderElected``.

A follower that finds the lease held also probes the holder (``liveness_subject``: only the
leader of that epoch listens, for the length of its term). "No responders", twice
``PROBE_CONFIRM_S`` apart, means the server holds no subscription of that term any more: the
process is gone (``kill -9`` closes its connection at once) or cut off from the server. The
follower then deletes the lease at the revision it saw (compare-and-delete: a renew in between
keeps it) and campaigns at once instead of waiting for the TTL. A slow or stopped leader keeps
its connection and its subscription, so a probe times out and changes nothing: it is only ever
replaced by the TTL. Either way the fences above hold, because they never relied on the lease
being exclusive in time: the successor's epoch is higher, its ``LeaderElected`` moves the
domain log's last sequence, and members refuse the older epoch once they saw the newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from contracts.events.leadership import LeaderResignedV1
from libs.eventstore.domain_log import DomainLog, Fenced
from libs.gc_pause import gc_paused
from libs.nats_client import flush_within
from libs.streams import LEADER_BUCKET, leader_command_subject, token
from libs.telemetry.metrics import IS_LEADER, LEADER_EPOCH, LEADER_STEPDOWNS

log = logging.getLogger(__name__)

# Fraction of the TTL a leader trusts its last renew for. The remaining 20% absorbs the time a
# renew spends in flight and the difference between our clock's rate and the server's.
TRUST_FRACTION = 0.8
_STREAM_IN_USE = 10058
# A second "no responders" this long after the first confirms that a holder is gone (and does
# not only subscribe a moment late at the start of its term).
PROBE_CONFIRM_S = 0.2
# Longest wait for the holder's answer, as a fraction of the TTL; silence counts as alive.
PROBE_TIMEOUT_FRACTION = 0.1


def liveness_subject(bucket: str, key: str, epoch: int) -> str:
    """Answered by the holder of ``key``'s lease at ``epoch`` while its term lasts."""
    return f"sluice.leader.alive.{token(bucket)}.{token(key)}.{epoch}"


async def probe(nc: Client, subject: str, wait_s: float) -> str:
    """``"gone"`` when nobody subscribes ``subject`` (the server says so at once), ``"alive"``
    when somebody answers, ``"silent"`` when nobody answers in time (slow or stopped: alive for
    every decision here) or the probe itself failed."""
    try:
        await nc.request(subject, b"", timeout=wait_s)
    except NoRespondersError:
        return "gone"
    except (TimeoutError, NatsTimeoutError, NatsError, OSError):
        return "silent"
    return "alive"


def holder_gone(verdicts: list[str], confirmations: int = 2) -> bool:
    """Take a lease over early only when every one of at least ``confirmations`` probes of the
    same term found nobody: any answer or silence means the holder may still be acting."""
    return len(verdicts) >= confirmations and all(v == "gone" for v in verdicts)


@dataclass(frozen=True)
class LeaderInfo:
    """The lease holder as a follower sees it."""

    candidate: str
    epoch: int
    revision: int


class Leadership:
    """One term of leadership. ``lost`` is set once, when this term is over for any reason."""

    def __init__(self, service: str, candidate: str, epoch: int, revision: int, token: str,
                 ttl: float, trusted_from: float) -> None:
        self.service = service
        self.candidate = candidate
        self.epoch = epoch
        self.revision = revision
        self.token = token
        self.ttl = ttl
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self.resign_requested = asyncio.Event()
        """Set by an operator's resign request; the leader loop then hands the lease over."""
        self.resign_reason = ""
        self._deadline = trusted_from + ttl * TRUST_FRACTION

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` after which this process must not act as leader."""
        return self._deadline

    def renewed(self, sent_at: float, revision: int) -> None:
        self.revision = revision
        self._deadline = max(self._deadline, sent_at + self.ttl * TRUST_FRACTION)

    def valid(self) -> bool:
        """True while the lease can be trusted; checked before every leader action."""
        if self.lost.is_set():
            return False
        if time.monotonic() >= self._deadline:
            self.lose("lease-expired")
            return False
        return True

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
            # A resignation is planned; anything else is worth an operator's attention.
            level = logging.INFO if reason == "resigned" else logging.WARNING
            log.log(level, "leadership lost", extra={"service": self.service, "epoch": self.epoch,
                                                     "reason": reason})


class Election:
    """Campaign for, hold and resign one service's lease."""

    def __init__(self, js: JetStreamContext, service: str, candidate: str, ttl: float, *,
                 bucket: str = LEADER_BUCKET, key: str | None = None, replicas: int = 1,
                 nc: Client | None = None) -> None:
        self.js = js
        self.nc = nc
        """With a client, a held lease is probed and taken over when its holder is gone."""
        self.service = service
        self.candidate = candidate
        self.ttl = ttl
        self.bucket = bucket
        self.key = key or service
        self.replicas = replicas
        self.observed: LeaderInfo | None = None
        self._kv: KeyValue | None = None

    @property
    def renew_interval(self) -> float:
        return self.ttl / 3

    @property
    def poll_interval(self) -> float:
        return self.ttl / 4

    async def setup(self) -> KeyValue:
        """Create the bucket, or bind to it and adopt its TTL when it exists with another one.

        The key expires after the *bucket's* TTL whatever we were configured with, so our
        timing must follow the bucket or a leader could trust a lease that already expired.
        """
        if self._kv is not None:
            return self._kv
        try:
            kv = await self.js.create_key_value(api.KeyValueConfig(
                bucket=self.bucket, history=1, ttl=self.ttl, storage=api.StorageType.FILE,
                replicas=self.replicas, description="Sluice leader leases"))
        except BadRequestError as exc:
            if exc.err_code != _STREAM_IN_USE:
                raise
            kv = await self.js.key_value(self.bucket)
            bucket_ttl = (await kv.status()).ttl
            if not bucket_ttl:
                raise RuntimeError(f"KV bucket {self.bucket} has no TTL: a dead leader's lease would "
                                   "never expire") from None
            if abs(bucket_ttl - self.ttl) > 1e-3:
                log.warning("lease bucket has another TTL; using the bucket's",
                            extra={"bucket": self.bucket, "configured_ttl": self.ttl,
                                   "bucket_ttl": bucket_ttl})
                self.ttl = bucket_ttl
        self._kv = kv
        return kv

    async def current(self) -> LeaderInfo | None:
        """The live lease holder, or None when the key is absent, deleted or expired."""
        kv = await self.setup()
        try:
            entry = await kv.get(self.key)
        except KeyNotFoundError:  # also raised for a deleted key
            self.observed = None
            return None
        info = self._decode(entry.value or b"{}", int(entry.revision or 0))
        self.observed = info
        return info

    @staticmethod
    def _decode(value: bytes, revision: int) -> LeaderInfo:
        try:
            body: dict[str, Any] = json.loads(value)
        except ValueError:
            body = {}
        # A lease written by `create` cannot know its own revision: epoch 0 means "this one".
        epoch = int(body.get("epoch") or 0) or revision
        return LeaderInfo(candidate=str(body.get("candidate", "?")), epoch=epoch, revision=revision)

    def _value(self, token: str, epoch: int) -> bytes:
        return json.dumps({"candidate": self.candidate, "epoch": epoch, "token": token}).encode()

    def liveness_subject(self, epoch: int) -> str:
        return liveness_subject(self.bucket, self.key, epoch)

    async def holder_gone(self, holder: LeaderInfo) -> bool:
        """True when the holder's term has no subscriber on two probes in a row."""
        if self.nc is None:
            return False
        subject = self.liveness_subject(holder.epoch)
        wait_s = max(0.05, self.ttl * PROBE_TIMEOUT_FRACTION)
        verdicts = [await probe(self.nc, subject, wait_s)]
        if verdicts[0] == "gone":
            await asyncio.sleep(PROBE_CONFIRM_S)
            verdicts.append(await probe(self.nc, subject, wait_s))
        return holder_gone(verdicts)

    async def take_over(self, holder: LeaderInfo) -> bool:
        """Delete a gone holder's lease at the revision we saw; a renew since keeps it."""
        kv = await self.setup()
        try:
            await kv.delete(self.key, last=holder.revision)
        except (BadRequestError, KeyWrongLastSequenceError):
            return False
        log.warning("lease holder gone (no responders); lease released early",
                    extra={"service": self.service, "holder": holder.candidate, "epoch": holder.epoch})
        return True

    async def try_acquire(self) -> Leadership | None:
        """One attempt: returns a running Leadership when this candidate won, else None."""
        holder = await self.current()
        if holder is not None:
            if not (await self.holder_gone(holder) and await self.take_over(holder)):
                return None
        kv = await self.setup()
        token = uuid4().hex
        sent_at = time.monotonic()
        try:
            revision = await kv.create(self.key, self._value(token, 0))
        except KeyWrongLastSequenceError:
            return None  # somebody else won this round
        # A create whose ack is lost (timeout) is not adopted: the key then expires after one
        # TTL and the election starts over, which is slower but never yields two leaders.
        leadership = Leadership(self.service, self.candidate, epoch=revision, revision=revision,
                                token=token, ttl=self.ttl, trusted_from=sent_at)
        self.observed = LeaderInfo(self.candidate, revision, revision)
        log.info("won the lease", extra={"service": self.service, "epoch": revision})
        return leadership

    async def campaign(self, stopping: asyncio.Event,
                       on_poll: Callable[[], None] | None = None) -> Leadership | None:
        """Poll until this candidate wins (returns the Leadership) or ``stopping`` is set (None)."""
        while not stopping.is_set():
            try:
                won = await self.try_acquire()
            except (NatsError, OSError) as exc:
                log.warning("election poll failed: %s", exc)
                won = None
            if won is not None:
                return won
            if on_poll is not None:
                on_poll()
            await _wait_event(stopping, self.poll_interval)
        return None

    async def keep(self, leadership: Leadership) -> None:
        """Renew the lease until it is lost; sets ``leadership.lost`` with the reason."""
        kv = await self.setup()
        value = self._value(leadership.token, leadership.epoch)
        next_renew = time.monotonic() + self.renew_interval
        while not leadership.lost.is_set():
            now = time.monotonic()
            await asyncio.sleep(max(0.0, min(next_renew, leadership.deadline) - now))
            if not leadership.valid():
                return
            sent_at = time.monotonic()
            try:
                # Never wait for a renew past the deadline: by then the answer no longer matters.
                revision = await asyncio.wait_for(
                    kv.update(self.key, value, last=leadership.revision),
                    timeout=max(0.01, leadership.deadline - sent_at))
            except KeyWrongLastSequenceError:
                try:
                    ours = await self._still_ours(leadership)
                except (TimeoutError, NatsError, OSError) as exc:
                    log.warning("lease check failed: %s", exc, extra={"service": self.service})
                    next_renew = time.monotonic() + self.ttl / 10
                    continue
                if ours:
                    next_renew = time.monotonic()
                    continue
                leadership.lose("lease-taken")
                return
            except (TimeoutError, NatsError, OSError) as exc:
                log.warning("lease renew failed: %s", exc, extra={"service": self.service})
                next_renew = time.monotonic() + self.ttl / 10
                continue
            leadership.renewed(sent_at, revision)
            next_renew = sent_at + self.renew_interval

    async def _still_ours(self, leadership: Leadership) -> bool:
        """After a refused renew: did an earlier renew whose answer we missed land after all?"""
        kv = await self.setup()
        try:
            entry = await kv.get(self.key)
        except KeyNotFoundError:
            return False
        try:
            token = json.loads(entry.value or b"{}").get("token")
        except ValueError:
            return False
        if token != leadership.token:
            return False
        # Adopt the revision but not a later deadline: we do not know when that renew was sent.
        leadership.revision = int(entry.revision or 0)
        return True

    async def resign(self, leadership: Leadership) -> bool:
        """Delete the key if it is still ours, so a follower takes over without waiting a TTL."""
        leadership.lose("resigned")
        kv = await self.setup()
        try:
            await kv.delete(self.key, last=leadership.revision)
        except (BadRequestError, KeyWrongLastSequenceError):
            return False  # not ours any more: nothing to hand over
        except (TimeoutError, NatsError, OSError) as exc:
            log.warning("resign failed; the lease will expire instead: %s", exc)
            return False
        log.info("resigned the lease", extra={"service": self.service, "epoch": leadership.epoch})
        return True


async def _wait_event(event: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


Work = Callable[[Leadership, DomainLog[Any]], Awaitable[None]]
LogFactory = Callable[[], DomainLog[Any]]


async def run_leader_loop(js: JetStreamContext, *, service: str, candidate: str, domain: str,
                          producer: str, ttl: float, work: Work, stopping: asyncio.Event,
                          status: dict[str, Any] | None = None, bucket: str = LEADER_BUCKET,
                          log_factory: LogFactory | None = None, replicas: int = 1,
                          nc: Client | None = None) -> None:
    """Campaign; while leader, open the domain log and run ``work``; repeat until ``stopping``.

    ``work(leadership, domain_log)`` is cancelled the moment the lease is lost, the log is
    fenced or the process stops. On stop the leader appends ``LeaderResigned`` and deletes its
    key, so a follower takes over within one poll instead of one TTL. ``status`` (the service's
    /healthz dict) gets ``leader``, ``epoch`` and ``leader_id``: for a follower the epoch and id
    of the leader it last saw. With ``nc``, the leader answers resign requests on
    ``leader_command_subject(service)`` during its term and then steps down like on shutdown,
    sitting out one TTL so that another replica wins the next election.
    """
    election = Election(js, service, candidate, ttl, bucket=bucket, replicas=replicas, nc=nc)

    def show(leader: bool, info: LeaderInfo | None) -> None:
        if status is not None:
            status.update({"leader": leader, "epoch": info.epoch if info else 0,
                           "leader_id": info.candidate if info else None})

    def make_log() -> DomainLog[Any]:
        if log_factory is not None:
            return log_factory()
        return DomainLog(js, domain, producer=producer)

    IS_LEADER.labels(service).set(0)
    LEADER_EPOCH.labels(service).set(0)
    show(False, None)
    while not stopping.is_set():
        try:
            await election.setup()
        except (NatsError, OSError) as exc:
            log.warning("lease bucket not available yet: %s", exc)
            await _wait_event(stopping, election.poll_interval)
            continue
        leadership = await election.campaign(stopping, on_poll=lambda: show(False, election.observed))
        if leadership is None:
            break
        reason = await _lead(election, leadership, make_log(), work, stopping, show, nc)
        show(False, None)
        if reason != "shutdown":
            LEADER_STEPDOWNS.labels(service, reason).inc()
        if reason in ("error", "resigned"):
            # Whatever broke may break again: give another replica the first chance.
            await _wait_event(stopping, election.ttl)
        elif reason == "fenced":
            # Do not race straight back into a log somebody else is writing to.
            await _wait_event(stopping, election.poll_interval)


async def _lead(election: Election, leadership: Leadership, domain_log: DomainLog[Any], work: Work,
                stopping: asyncio.Event, show: Callable[[bool, LeaderInfo | None], None],
                nc: Client | None = None) -> str:
    """One term. Returns why it ended: shutdown, resigned, lease-expired, lease-taken, fenced or
    error."""
    service = election.service
    commands = alive = None
    if nc is not None:
        try:
            alive = await serve_liveness(nc, election, leadership)
        except (NatsError, OSError) as failure:  # followers then wait for the TTL
            log.warning("cannot answer liveness probes: %s", failure, extra={"service": service})
        try:
            commands = await _serve_leader_commands(nc, leadership)
        except (NatsError, OSError) as failure:  # leading matters more than being resignable
            log.warning("cannot listen for leader commands: %s", failure, extra={"service": service})
    keeper = asyncio.create_task(election.keep(leadership), name=f"{service}-lease")
    body = asyncio.create_task(_open_and_work(leadership, domain_log, work), name=f"{service}-leader")
    IS_LEADER.labels(service).set(1)
    LEADER_EPOCH.labels(service).set(leadership.epoch)
    show(True, LeaderInfo(election.candidate, leadership.epoch, leadership.revision))
    lost_wait = asyncio.create_task(leadership.lost.wait())
    stop_wait = asyncio.create_task(stopping.wait())
    resign_wait = asyncio.create_task(leadership.resign_requested.wait())
    reason = "shutdown"
    try:
        while True:
            # Wake at the deadline too: being late to notice an expired lease is acting on it.
            timeout = max(0.0, leadership.deadline - time.monotonic())
            await asyncio.wait({body, lost_wait, stop_wait, resign_wait}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if not leadership.valid():
                reason = leadership.lost_reason or "lease-expired"
                break
            if stopping.is_set():
                reason = "shutdown"
                break
            if leadership.resign_requested.is_set():
                reason = "resigned"
                break
            if body.done():
                exc = body.exception() if not body.cancelled() else None
                if isinstance(exc, Fenced):
                    log.warning("fenced: another writer appended to the domain log; stepping down",
                                extra={"service": service, "epoch": leadership.epoch})
                    reason = "fenced"
                    break
                if exc is not None:
                    log.error("leader work failed; stepping down", exc_info=exc,
                              extra={"service": service, "epoch": leadership.epoch})
                    reason = "error"
                    break
                body = asyncio.create_task(_until_lost(leadership))  # work finished: keep the lease
    finally:
        for sub in (commands, alive):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        for task in (body, lost_wait, stop_wait, resign_wait):
            task.cancel()
        # return_exceptions: the tasks' own cancellation is expected; ours still propagates.
        await asyncio.gather(body, lost_wait, stop_wait, resign_wait, return_exceptions=True)
        IS_LEADER.labels(service).set(0)
        LEADER_EPOCH.labels(service).set(0)
        if reason in ("shutdown", "resigned", "fenced", "error") and leadership.valid():
            if reason in ("shutdown", "resigned"):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(domain_log.append(LeaderResignedV1(
                        service=service, candidate=election.candidate, epoch=leadership.epoch,
                        reason=leadership.resign_reason or reason)),
                        timeout=max(0.01, leadership.deadline - time.monotonic()))
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await election.resign(leadership)
        else:
            leadership.lose(reason)
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    log.info("leader term ended", extra={"service": service, "epoch": leadership.epoch, "reason": reason})
    return reason


async def serve_liveness(nc: Client, election: Election, leadership: Leadership) -> Any:
    """Answer the followers' probes of this term. Flushed, so the server knows the subscription
    before the term does anything a follower could notice."""

    async def on_probe(msg: Msg) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(str(leadership.epoch).encode())

    sub = await nc.subscribe(election.liveness_subject(leadership.epoch), cb=on_probe)
    try:
        # Not nc.flush(timeout=...): on a timeout it cancels its PING's future, and the late PONG
        # then stops nats-py's read loop for good (libs.nats_client.flush_within).
        await flush_within(nc, max(1, round(election.ttl)))
    except TimeoutError:
        # The subscription is on its way to the server all the same; until it is there,
        # followers' probes go unanswered and they wait for the TTL, as without it.
        log.warning("liveness subscription not confirmed within the TTL", extra={"service": election.service})
    return sub


async def _serve_leader_commands(nc: Client, leadership: Leadership) -> Any:
    """Answer ``{"action": "resign", "epoch"?, "requested_by"?, "reason"?}`` for this term.

    Replies ``{"ok": true, "service", "leader", "epoch"}`` and then steps down; a request naming
    another epoch gets ``{"ok": false, "code": 409}`` (it was meant for an earlier or later term),
    a malformed one ``{"ok": false, "code": 422}``."""

    async def on_command(msg: Msg) -> None:
        try:
            body = json.loads(msg.data or b"{}")
            if not isinstance(body, dict) or body.get("action") != "resign":
                raise ValueError('expected {"action": "resign", ...}')
            epoch = body.get("epoch")
            if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
                raise ValueError("epoch must be an integer")
        except ValueError as exc:
            answer: dict[str, Any] = {"ok": False, "code": 422, "error": str(exc)}
        else:
            if epoch is not None and epoch != leadership.epoch:
                answer = {"ok": False, "code": 409,
                          "error": f"the {leadership.service} leader is at epoch {leadership.epoch}, "
                                   f"not {epoch}"}
            else:
                answer = {"ok": True, "service": leadership.service, "leader": leadership.candidate,
                          "epoch": leadership.epoch}
                leadership.resign_reason = (f"operator: {body.get('requested_by') or '?'}: "
                                            f"{body.get('reason') or 'resign requested'}")[:500]
                log.info("resign requested", extra={"service": leadership.service,
                                                    "epoch": leadership.epoch})
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(json.dumps(answer).encode())
        if answer["ok"]:
            leadership.resign_requested.set()

    return await nc.subscribe(leader_command_subject(leadership.service), cb=on_command)


async def _until_lost(leadership: Leadership) -> None:
    await leadership.lost.wait()


async def _open_and_work(leadership: Leadership, domain_log: DomainLog[Any], work: Work) -> None:
    with gc_paused():  # the replay builds the leader's state (see ``LeaderLoop.run``)
        await domain_log.open(leadership.service, leadership.candidate, leadership.epoch, leadership)
    await work(leadership, domain_log)
