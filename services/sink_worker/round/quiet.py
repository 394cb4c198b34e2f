"""Quiet spans: an idle span follows its source's resolved ts without asking NATS anything.

A round visits every span: it reads the span's stored checkpoint (to see an operator's
rewind), asks its consumer how much is pending, plans and advances it. For a span with nothing
to read that is two requests and a plan a round, about 0.15 % of a core a span at one round a
second, which at thousands of tables is most of an idle worker (``bench_tables``).

Capture says on each resolved mark since which earlier mark of its session it has published
nothing but marks (``QUIET_SINCE_HEADER``). A span whose last full visit found it had read
everything and applied everything while mark M was the newest (``QuietSpan``), and whose
source's newest mark says "quiet since Q" with Q <= M, has nothing new to read: no message of
its source was published after M. Such a span only moves its checkpoint's ts to the mark's
(under the changefeed's syncpoint cap), as a full visit would, and is visited in full again
every ``recheck_s`` (``SLUICE_SINK_QUIET_RECHECK_S``), which also stores its checkpoint and
reads the stored one, so an operator's rewind is found then (a checkpoint store compares and
sets, too).

Off by default (``recheck_s`` 0): a message published on the span's subject by anything but
this capture session is not covered by the header, and by the recheck the followed checkpoint
ts has passed that message's ts, so the full visit drops it as applied. The worker must check
the stream itself before this can be on by default.
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
                   cap: int | None, now: float, recheck_s: float) -> Checkpoint | None:
    """The checkpoint a quiet span moves to without a visit, or None when it needs a full one:
    not quiet, its checkpoint changed since (a reload, a rewind), its source published after
    the span's mark, or its recheck is due."""
    if (quiet is None or checkpoint is None or mark is None or mark.quiet_since is None
            or recheck_s <= 0 or checkpoint != quiet.checkpoint or mark.quiet_since > quiet.mark_seq
            or now - quiet.visited_at >= recheck_s):
        return None
    ts = capped(max(mark.ts, checkpoint.ts), cap, checkpoint.ts)
    return Checkpoint(stream_seq=checkpoint.stream_seq, ts=max(ts, checkpoint.ts))
