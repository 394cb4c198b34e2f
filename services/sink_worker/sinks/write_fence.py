"""Write fencing in the downstream: a span's writes land only while its owner holds the span's
newest token there.

The self-fence (``services/sink_worker/fence.py``) stops a worker from *starting* a write once
it cannot confirm its heartbeats, but a write already handed to Spark does not stop with the
worker. With a Spark Connect server (``SLUICE_SPARK_MASTER=sc://``) the whole apply or copy job
of a killed worker runs on in the server, its Python tasks writing partition after partition;
with local Spark a task whose input is read finishes its partition's transaction after the JVM
is gone. A new owner that starts writing meanwhile could have newer images overwritten by the
dead owner's older ones, and nothing would ever repair them (the dead worker's checkpoint never
moved, but the new owner's later rounds do not touch keys that stopped changing).

So each downstream schema a span writes into holds a row ``(span, token)`` in
``sluice_write_fence``. The worker that takes a span bumps the token once, before its first
write (``take``; an ``UPDATE`` of the row, so it waits for the transactions that hold the row
shared), and every write transaction of the span first reads the row under a shared lock and
goes on only if the token is still its own (``SqlSink._check_write_fence``). A dead owner's
transaction that was in flight at the bump commits before it; every later one finds a newer
token and fails with ``WriteFenceLost``, which leaves the downstream as it was. Only the span's
current owner takes its token (the replication-manager's two-phase scheduling gives a span one
owner at a time, and a stale leader's dispatches are fenced), so the newest token is always the
current owner's.

Per worker, ``WriteFences`` takes a span's token once per sink, schema and span and hands it to
every writer of the span (its stream rounds and its initial-load copy share it); a span that
leaves the worker is forgotten, so a span that comes back takes a fresh token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

FENCE_TABLE = "sluice_write_fence"


@dataclass(frozen=True)
class WriteFence:
    """The tokens a write must still hold: ``(span key, token)`` in ``schema``'s fence table."""

    schema: str | None
    tokens: tuple[tuple[str, int], ...]


class WriteFenceLost(Exception):
    """A write of a span whose token another owner has bumped since (or that has no row)."""

    def __init__(self, span: str, held: int, found: int | None) -> None:
        self.span = span
        self.held = held
        self.found = found
        now = "no fence row" if found is None else f"token {found}"
        super().__init__(f"span {span!r} was taken over: this writer holds token {held}, the "
                         f"downstream has {now}; the write is refused and changes nothing")


class FencingSink(Protocol):
    def take_write_fences(self, schema: str | None, spans: Sequence[str],
                          owner: str) -> dict[str, int] | None: ...


class WriteFences:
    """One worker's tokens, by (sink URL, schema, span key)."""

    def __init__(self, owner: str = "") -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str | None, str], int] = {}

    def take(self, sink: FencingSink, sink_url: str, schema: str | None,
             spans: list[str]) -> WriteFence | None:
        """The fence for a write of ``spans`` into ``schema``; the spans without a token yet take
        theirs (one downstream transaction, in the calling thread). None: the sink has no fencing."""
        wanted = sorted(set(spans))
        with self._lock:
            held = {span: token for span in wanted
                    if (token := self._tokens.get((sink_url, schema, span))) is not None}
        missing = [span for span in wanted if span not in held]
        if missing:
            taken = sink.take_write_fences(schema, missing, self.owner)
            if taken is None:
                return None
            with self._lock:
                for span, token in taken.items():
                    held[span] = self._tokens.setdefault((sink_url, schema, span), token)
        return WriteFence(schema, tuple((span, held[span]) for span in wanted))

    def forget(self, span: str) -> None:
        """``span`` left this worker: a later write of it takes a new token."""
        with self._lock:
            for key in [k for k in self._tokens if k[2] == span]:
                del self._tokens[key]
