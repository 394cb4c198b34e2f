"""Span checkpoints in a JetStream KV bucket: ``{stream_seq, ts}``, never moving backwards.

``ts``: every change of the span with a commit ts <= ``ts`` is applied downstream.
``stream_seq``: every message of the span's subjects with a ROWS-stream sequence <= ``stream_seq``
is handled (applied, a duplicate of an applied one, or dead-lettered); the span's pipeline
resumes reading at ``stream_seq + 1``. Events read again after it whose ts <= ``ts`` are known
to be applied and are dropped.

Writes use ``update(last=revision)`` (or ``create`` for a new span), so two writers cannot
interleave a read-check-write; a write that would lower either field is refused with
``CheckpointRegression``: a checkpoint going backwards would make the replication-manager
report progress that was later taken back. Rewinding on purpose (an operator replaying a span)
is ``reset``.

The store remembers the revision of every checkpoint it read or wrote, so a compare-and-set
from the checkpoint it last saw is one request (the ``update`` at that revision) instead of a
read and an update: the update succeeds only while the stored entry is still that revision, so
the read would have found what we remember. Any other write (a reset, another process) bumps the
revision, the update is refused, and the store reads and checks as before.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from libs.scheduling.model import Span, kv_parts
from libs.streams import CHECKPOINT_BUCKET

log = logging.getLogger(__name__)


_UPDATE_ATTEMPTS = 10


@dataclass(frozen=True, order=True)
class Checkpoint:
    stream_seq: int = 0
    ts: int = 0

    def to_json(self) -> bytes:
        return json.dumps({"stream_seq": self.stream_seq, "ts": self.ts}).encode()

    @classmethod
    def from_json(cls, raw: bytes | None) -> Checkpoint:
        obj = json.loads(raw or b"{}")
        return cls(stream_seq=int(obj.get("stream_seq", 0)), ts=int(obj.get("ts", 0)))

    def covers(self, other: Checkpoint) -> bool:
        """True when ``self`` is at or past ``other`` in both fields."""
        return self.stream_seq >= other.stream_seq and self.ts >= other.ts


class CheckpointRegression(ValueError):
    """A write would move a checkpoint backwards; it was refused."""

    def __init__(self, span: Span, current: Checkpoint, proposed: Checkpoint) -> None:
        super().__init__(f"checkpoint of {span.name} would go backwards: stored {current}, "
                         f"proposed {proposed}")
        self.span = span
        self.current = current
        self.proposed = proposed


class CheckpointMoved(RuntimeError):
    """The stored checkpoint is not the one the caller started from (a reset, another writer)."""

    def __init__(self, span: Span, expected: Checkpoint | None, found: Checkpoint | None) -> None:
        super().__init__(f"checkpoint of {span.name} moved: expected {expected}, found {found}")
        self.span = span
        self.expected = expected
        self.found = found


class CheckpointStore:
    def __init__(self, js: JetStreamContext, bucket: str = CHECKPOINT_BUCKET, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket
        self.replicas = replicas
        self._kv: KeyValue | None = None
        # kv key -> (checkpoint, revision) as this store last read or wrote it.
        self._known: dict[str, tuple[Checkpoint | None, int]] = {}

    async def open(self) -> CheckpointStore:
        try:
            self._kv = await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            # history 5: the last few positions help an operator see how a span moved.
            self._kv = await self.js.create_key_value(bucket=self.bucket, history=5,
                                                      replicas=self.replicas,
                                                      description="Sluice span checkpoints")
        return self

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("CheckpointStore.open() first")
        return self._kv

    async def _read(self, span: Span) -> tuple[Checkpoint | None, int]:
        """The stored checkpoint and its revision; (None, revision or 0) when absent/deleted."""
        found: tuple[Checkpoint | None, int]
        try:
            entry = await self.kv.get(span.kv_key)
        except KeyDeletedError as exc:
            found = None, int(exc.entry.revision or 0) if exc.entry is not None else 0
        except KeyNotFoundError:
            found = None, 0
        else:
            found = Checkpoint.from_json(entry.value), int(entry.revision or 0)
        self._known[span.kv_key] = found
        return found

    async def _write(self, span: Span, proposed: Checkpoint, current: Checkpoint | None,
                     revision: int) -> None:
        """Store ``proposed`` over ``current`` at ``revision``; KeyWrongLastSequenceError when
        the stored entry is not that revision any more."""
        if current is None and revision == 0:
            written = await self.kv.create(span.kv_key, proposed.to_json())
        else:
            written = await self.kv.update(span.kv_key, proposed.to_json(), last=revision)
        self._known[span.kv_key] = proposed, int(written)

    async def group_spans(self, changefeed: str, source: str) -> list[Span]:
        """The table-group spans of ``changefeed`` on ``source`` (a token) that hold a
        checkpoint: a span new to some tables inherits from them (``span_start``). One listing
        of the changefeed's keys on the source; only a span without a checkpoint asks."""
        prefix = Span(changefeed, source, "-", "-").kv_key.rsplit(".", 2)[0]
        try:
            keys = await self.kv.keys(filters=[f"{prefix}.*.*"])
        except NoKeysError:
            return []
        spans = [Span(*kv_parts(key)) for key in keys if len(kv_parts(key)) == 4]
        return [s for s in spans if s.members is not None]

    async def get(self, span: Span) -> Checkpoint | None:
        cp, _ = await self._read(span)
        return cp

    async def advance(self, span: Span, proposed: Checkpoint, *,
                      expected: Checkpoint | Literal["any"] | None = "any") -> Checkpoint:
        """Store ``proposed``; refuse it when it is behind the stored one in either field.

        With ``expected`` (the checkpoint the caller's batch started from; None for "no
        checkpoint yet") the write is a compare-and-set: if somebody else moved the checkpoint
        meanwhile (an operator ``reset``), ``CheckpointMoved`` is raised instead of silently
        overwriting their rewind.
        """
        known = self._known.get(span.kv_key)
        if expected != "any" and known is not None and known[0] == expected:
            # The entry we last saw is the one the caller started from: the update at its
            # revision is the compare-and-set (see the module's docstring).
            if expected is not None and not proposed.covers(expected):
                raise CheckpointRegression(span, expected, proposed)
            if proposed == expected:
                return proposed
            try:
                await self._write(span, proposed, expected, known[1])
                return proposed
            except KeyWrongLastSequenceError:
                pass  # somebody else wrote: read it and check against what they wrote
        for _ in range(_UPDATE_ATTEMPTS):
            current, revision = await self._read(span)
            if expected != "any" and current != expected:
                raise CheckpointMoved(span, expected, current)
            if current is not None:
                if not proposed.covers(current):
                    raise CheckpointRegression(span, current, proposed)
                if proposed == current:
                    return current
            try:
                await self._write(span, proposed, current, revision)
            except KeyWrongLastSequenceError:
                # Someone wrote in between: read again and re-check against what they wrote.
                continue
            return proposed
        raise RuntimeError(f"checkpoint of {span.name}: too many concurrent writers")

    def forget(self, span: Span) -> None:
        """Drop what this store remembers of the span's entry (it ran elsewhere now); the next
        compare-and-set reads the entry first."""
        self._known.pop(span.kv_key, None)

    async def reset(self, span: Span, checkpoint: Checkpoint | None = None) -> None:
        """Operator rewind: set the span back (or delete it) on purpose, bypassing the guard.

        The worker running the span must re-read it (``Pipeline`` does at the next round)."""
        self.forget(span)
        if checkpoint is None:
            try:
                await self.kv.delete(span.kv_key)
            except (KeyNotFoundError, KeyDeletedError):
                pass
            return
        await self.kv.put(span.kv_key, checkpoint.to_json())
        log.warning("checkpoint reset", extra={"span": span.name, "stream_seq": checkpoint.stream_seq,
                                               "ts": checkpoint.ts})
