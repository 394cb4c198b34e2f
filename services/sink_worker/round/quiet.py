"""Quiet spans: an idle span follows its source's resolved ts without asking its consumer.

A round visits every span: it reads the span's stored checkpoint (to see an operator's
rewind), asks its consumer how much is pending, plans and advances it. For a span with nothing
to read that is two requests and a plan a round, about 0.15 % of a core a span at one round a
second, which at thousands of tables is most of an idle worker (``bench_tables``).

A span whose last full visit found it had read everything and applied everything while mark M
was its source's newest (``QuietSpan``) has nothing new to read while the stream holds no data
message of its source after M: the round asks the stream once per source for the sequence of
the source's newest data message L (``pull.last_data_seq``, a get by the wildcard subject of
every table's rows and DDL), after reading the marks. While L <= M the span only moves its
checkpoint's ts to the newest mark's (under the changefeed's syncpoint cap), as a full visit
would. The stream is asked, not capture: a message any publisher stored (a stale capture
session, an operator's replay) has a sequence above M and ends the shortcut; one stored after
the get has a sequence above the mark the span follows, so its ts is above that mark's if
capture published it (a mark covers what was stored before it) and the span's next full visit
reads it as new. The check is per source, so a write to any table of a source sends all its
spans to a full visit that round.

Every ``recheck_s`` (``SLUICE_SINK_QUIET_RECHECK_S``; 0 turns the shortcut off) a quiet span's
stored checkpoint is read and the followed one stored (``recheck_quietly``): a compare-and-set at
the revision the worker last saw, so an operator's rewind or another writer is found then, as a
full visit would find it. While the stream holds no data after its mark that is all the recheck
does; a visit of its consumer would only find again that there is nothing to read. (Its consumer
may then expire on the server, and the next full visit makes a new one from the checkpoint.)
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.syncpoints import capped
from services.sink_worker.round.pull import ResolvedMark
from services.sink_worker.span.checkpoints import Checkpoint


@dataclass(frozen=True)
class QuietSpan:
    """What a full visit established: everything of the span published up to the mark at
    ``mark_seq`` is read and applied, and the span's checkpoint was then ``checkpoint``."""

    mark_seq: int
    checkpoint: Checkpoint
    visited_at: float


def quiet_after_visit(*, replicating: bool, fresh: int, head: bool, reached: bool, ghosts: int,
                      mark: ResolvedMark | None, checkpoint: Checkpoint | None,
                      now: float) -> QuietSpan | None:
    """The quiet record of a span whose round just ended, or None when it is not quiet: it is
    replicating (no incident, no DDL at its head), pulled nothing past its checkpoint, and read
    as far as the mark (``reached``) with nothing left to read again (``ghosts``)."""
    if (not replicating or fresh or head or not reached or ghosts or mark is None
            or checkpoint is None):
        return None
    return QuietSpan(mark.stream_seq, checkpoint, now)


def follow_quietly(quiet: QuietSpan | None, checkpoint: Checkpoint | None, mark: ResolvedMark | None,
                   last_data: int | None, cap: int | None, now: float, recheck_s: float) -> Checkpoint | None:
    """The checkpoint a quiet span moves to without a visit, or None when it needs a full one:
    not quiet, its checkpoint changed since (a reload, a rewind), the stream holds a data
    message of its source after the span's mark (``last_data``, read after ``mark``; None when
    the stream could not say), or its recheck is due (``recheck_quietly``)."""
    if quiet is None or recheck_s <= 0 or now - quiet.visited_at >= recheck_s:
        return None
    return _followed(quiet, checkpoint, mark, last_data, cap)


def recheck_quietly(quiet: QuietSpan | None, checkpoint: Checkpoint | None, mark: ResolvedMark | None,
                    last_data: int | None, cap: int | None, now: float,
                    recheck_s: float) -> Checkpoint | None:
    """The checkpoint a quiet span whose recheck is due moves to and stores (the store's
    compare-and-set is the recheck), or None when it is not due or the span needs a full visit
    for any of ``follow_quietly``'s other reasons."""
    if quiet is None or recheck_s <= 0 or now - quiet.visited_at < recheck_s:
        return None
    return _followed(quiet, checkpoint, mark, last_data, cap)


def _followed(quiet: QuietSpan, checkpoint: Checkpoint | None, mark: ResolvedMark | None,
              last_data: int | None, cap: int | None) -> Checkpoint | None:
    if (checkpoint is None or mark is None or last_data is None or checkpoint != quiet.checkpoint
            or last_data > quiet.mark_seq):
        return None
    ts = capped(max(mark.ts, checkpoint.ts), cap, checkpoint.ts)
    return Checkpoint(stream_seq=checkpoint.stream_seq, ts=max(ts, checkpoint.ts))
