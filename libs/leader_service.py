"""The shell every leader service shares: ``leader_main`` wires a service's leader side to the
election and the service runtime; ``LeaderLoop`` is one term of it.

A leader service supplies only its handlers (what an input does, what a tick does) and its
functional core (``services/*/core.py`` or ``libs/``); the loop owns the rest, the same way in
all four: the followers of other domains (loaded before the term starts, then followed), the
NATS subscriptions, a typed inbox whose requests carry an answer future, the wake-up (an
input, a ``wake()`` or the tick's timeout), the service's entry in ``/healthz`` and, when the
term ends, the drain that answers every request still waiting with the service's "stepped
down, try again" (503) answer instead of leaving its caller to time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from nats.aio.msg import Msg

from libs.control.follow import DomainFollower, OnEvent
from libs.election import Leadership, run_leader_loop
from libs.eventstore import DomainLog
from libs.eventstore.snapshots import Fold, Restore
from libs.gc_pause import gc_paused
from libs.service import ServiceRuntime

log = logging.getLogger(__name__)

ServiceMain = Callable[[ServiceRuntime], Coroutine[Any, Any, None]]

S = TypeVar("S")
T = TypeVar("T")
A = TypeVar("A")
S_co = TypeVar("S_co", covariant=True)


class Followed(Protocol[S_co]):
    """What handlers read of a followed domain (a ``DomainFollower``, or a fixed state in tests)."""

    @property
    def state(self) -> S_co: ...


class LeaderDomain(Protocol):
    """A service's leader side: the work of one term, and the domain log it works on (a log
    with the domain's fold, so the term starts from the replayed state)."""

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None: ...

    def make_log(self) -> DomainLog[Any]: ...


def leader_main(domain: str, service: Callable[[ServiceRuntime], LeaderDomain]) -> ServiceMain:
    """A service main that campaigns for the service's lease and, while leader, owns ``domain``
    with the leader side ``service`` builds from the runtime."""

    async def main(runtime: ServiceRuntime) -> None:
        settings = runtime.settings
        leader = service(runtime)
        await run_leader_loop(
            runtime.nc.jetstream(), service=runtime.name, candidate=settings.instance_id,
            domain=domain, producer=runtime.producer, ttl=settings.lease_ttl_s,
            work=leader.lead, stopping=runtime.stopping, status=runtime.status,
            log_factory=leader.make_log, replicas=settings.stream_replicas, nc=runtime.nc,
        )

    return main


@dataclass
class Entry(Generic[T, A]):
    """One input; ``answer`` is set when its sender waits for one (request/reply)."""

    item: T
    answer: asyncio.Future[A] | None = None

    def reply(self, value: A) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(value)


class Inbox(Generic[T, A]):
    """The term's inputs in arrival order, and a wake-up without an input."""

    def __init__(self) -> None:
        self._entries: deque[Entry[T, A]] = deque()
        self._ready = asyncio.Event()

    def put(self, item: T) -> None:
        self._entries.append(Entry(item))
        self._ready.set()

    async def ask(self, item: T) -> A:
        """Put ``item`` and wait for the handler's answer (or the step-down answer)."""
        answer: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        self._entries.append(Entry(item, answer))
        self._ready.set()
        return await answer

    def wake(self) -> None:
        """Run a turn now (something the handlers read changed)."""
        self._ready.set()

    def __len__(self) -> int:
        return len(self._entries)

    async def wait(self, seconds: float) -> None:
        if not self._entries and not self._ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout=seconds)
        self._ready.clear()

    def take(self, n: int | None) -> list[Entry[T, A]]:
        """The oldest ``n`` entries (all of them with None)."""
        count = len(self._entries) if n is None else min(n, len(self._entries))
        return [self._entries.popleft() for _ in range(count)]


Handle = Callable[[Entry[T, A]], Awaitable[None]]
Tick = Callable[[], Awaitable[None]]


class LeaderLoop(Generic[T, A]):
    """One term of a leader service: ``async with LeaderLoop(...) as loop``, declare followers
    (``follow``), ``await loop.load()``, build the core from the followers' state, subscribe,
    then ``await loop.run(handle, tick, wait_s)`` until the term is cancelled.

    A turn waits for an input, a ``wake()`` or ``wait_s()`` seconds, hands the inputs to
    ``handle`` one at a time (only the oldest one per turn unless ``batch``: then all of them,
    or the oldest ``max_batch``), then runs ``tick`` once. Leaving the ``async with`` stops the
    followers and background tasks, unsubscribes, answers the requests still waiting with
    ``refuse(item)`` and removes the service's ``/healthz`` entry.
    """

    def __init__(self, runtime: ServiceRuntime, *, status_key: str,
                 refuse: Callable[[T], A] | None = None, batch: bool = False,
                 max_batch: int | None = None) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.nc = runtime.nc
        self.js = runtime.nc.jetstream()
        self.status_key = status_key
        self.inbox: Inbox[T, A] = Inbox()
        self._refuse = refuse
        self._batch = batch
        self._max_batch = max_batch
        self._followers: list[DomainFollower[Any]] = []
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()

    def follow(self, domain: str, fold: Fold[S], initial: Callable[[], S], *, name: str,
               restore: Restore[S] | None = None, on_event: OnEvent | None = None) -> DomainFollower[S]:
        follower = DomainFollower(self.js, domain, fold, initial, restore=restore, on_event=on_event,
                                  name=name, settings=self.settings)
        self._followers.append(follower)
        return follower

    async def load(self) -> None:
        """Load every follower (newest snapshot + events up to now), in the order declared.
        They follow from there once ``run`` starts, so ``on_event`` may be set until then."""
        with gc_paused():  # a replay builds the state: see ``run``
            for follower in self._followers:
                await follower.load()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """A background task of this term, cancelled when the term ends."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> None:
        self._subs.append(await self.nc.subscribe(subject, cb=cb))

    def publish_status(self, body: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """The leader's part of /healthz; a function is called when /healthz asks."""
        self.runtime.status[self.status_key] = body

    async def run(self, handle: Handle[T, A], tick: Tick, wait_s: Callable[[], float]) -> None:
        for follower in self._followers:
            self.spawn(follower.run(self._stop), name=f"follow-{follower.name}")
        while True:
            await self.inbox.wait(wait_s())
            # A leader's state is tens of thousands of long-lived objects at 10,000 spans; with
            # the collector on, every quarter of growth cost a full walk of all of them (1-3 s
            # with the GIL held on a loaded machine: a replication-manager missed its lease
            # renewals and lost its term). Paused per turn, the survivors are frozen at its end
            # (``libs.gc_pause``), which collections skip.
            with gc_paused():
                for entry in self.inbox.take(self._max_batch if self._batch else 1):
                    await handle(entry)
                    # A handler may not wait for anything (its records go out at the tick): the
                    # lease renewal and the subscriptions get the loop between two inputs.
                    await asyncio.sleep(0)
                await tick()

    async def __aenter__(self) -> LeaderLoop[T, A]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._stop.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for entry in self.inbox.take(None):
            if self._refuse is not None:
                entry.reply(self._refuse(entry.item))
        self.runtime.status.pop(self.status_key, None)
