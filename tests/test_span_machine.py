"""The span state machine (``services.sink_worker.span.machine``), without servers.

Property tests walk a span through random rounds over a simulated stream: pulls that fail,
tables that cannot be replicated (an incident), heads that wait, fail, re-copy or are carried
out, writes that fail, stop at a refused change (an incident), block, stop at a DDL that leaves
the table keyless (an incident) or succeed, and operator actions with the
right and wrong incident ids. After every step (besides the invariants the machine checks
itself):

- the checkpoint never goes backwards, in ts and in stream sequence;
- it moves only past batches written in full (or, with nothing fresh, to the horizon), and
  never past the stream position of an event above its ts (nothing unapplied is skipped);
- a span stopped by an incident stays stopped, whatever the rounds bring, until an operator
  acts on exactly that incident;
- the state after a round is the one its head and outcome call for (a reference table).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.sink_worker.incidents.poison import RowFailure, TableIncident
from services.sink_worker.incidents.table_errors import DdlFailure
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.machine import (
    CarriedOut,
    Head,
    HeadFailed,
    Recopying,
    Refused,
    RoundFacts,
    SpanInvariantError,
    SpanMachine,
    SpanOutcome,
    SpanState,
    WaitsAtHead,
)


@dataclass
class Pulled:
    """A pull: ``(stream_seq, ts)`` of the events read after the checkpoint."""

    events: list[tuple[int, int]]
    read_upto: int

    def first_seq_after(self, ts: int) -> int | None:
        seqs = [seq for seq, e_ts in self.events if e_ts > ts]
        return min(seqs) if seqs else None


def incident(n: int, key: str | None = '["k"]') -> TableIncident:
    return TableIncident(id=f"i{n}", target="db.t", upto_ts=1000 + n,
                         failure=RowFailure("upsert", key, ("id",), "IntegrityError: refused", 1062))


FAILURE = DdlFailure("ALTER TABLE t ADD x INT", "no such column", 50, 7)


def facts(start: Checkpoint, pulled: Pulled, horizon: int, head: Head | None = None,
          cut: SpanCut | None = None, outcome: SpanOutcome | None = None) -> RoundFacts:
    return RoundFacts(start=start, horizon=horizon, pulled=pulled, head=head, cut=cut, outcome=outcome)


# -- examples: the checkpoint arithmetic ----------------------------------------------------------

def test_a_written_batch_moves_to_its_limit_and_before_the_first_pending_event() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    pulled = Pulled([(11, 100), (12, 110), (13, 130)], read_upto=13)
    cut = SpanCut("k", limit_ts=110, batch_events=2, batch_max_ts=110, ddl_ts=None, ddl_id=None)
    decided = span.written(facts(Checkpoint(10, 90), pulled, 120, cut=cut,
                                 outcome=SpanOutcome(written=True, rows=2)))
    assert decided.checkpoint == Checkpoint(12, 110) and decided.moved and decided.store_now
    assert (decided.batch_events, decided.rows, decided.validate_upto) == (2, 2, 110)
    assert span.state is SpanState.REPLICATING and span.error is None


def test_an_applied_ddl_moves_to_the_ddl_and_an_unwritten_batch_nowhere() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    pulled = Pulled([(11, 100), (12, 110), (13, 130)], read_upto=13)
    cut = SpanCut("k", limit_ts=130, batch_events=1, batch_max_ts=100, ddl_ts=110, ddl_id="d")
    applied = span.written(facts(Checkpoint(10, 90), pulled, 140, cut=cut,
                                 outcome=SpanOutcome(written=True, ddl_applied=True)))
    assert applied.checkpoint == Checkpoint(12, 110) and applied.ddl_applied
    unwritten = span.written(facts(Checkpoint(10, 90), pulled, 140, cut=cut, outcome=SpanOutcome()))
    assert unwritten.checkpoint is None and not unwritten.moved


def test_nothing_fresh_follows_the_horizon_and_reads_past_it() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    decided = span.written(facts(Checkpoint(10, 90), Pulled([], read_upto=15), 200))
    assert decided.checkpoint == Checkpoint(15, 200) and not decided.store_now


def test_a_carried_out_head_moves_past_its_ddl_and_names_the_recopy_record() -> None:
    span = SpanMachine(state=SpanState.SNAPSHOT)
    cut = SpanCut("k", limit_ts=300, batch_events=0, batch_max_ts=None, ddl_ts=300, ddl_id="d")
    decided = span.written(facts(Checkpoint(10, 90), Pulled([(11, 120), (12, 400)], 12), 150,
                                 head=CarriedOut(cut, "recopy-11")))
    assert decided.checkpoint == Checkpoint(11, 300) and decided.ddl_applied and decided.store_now
    assert decided.recopy_key == "recopy-11" and span.state is SpanState.REPLICATING


def test_an_unreplicable_table_stops_with_one_incident_until_it_is_resumed() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    start = Checkpoint(10, 90)
    no_key = Refused("no key", unreplicable=True)
    decided = span.written(facts(start, Pulled([(11, 100)], 11), 100, head=no_key))
    stop = decided.incident
    assert stop is not None and stop.kind == "unreplicable" and stop.upto_ts == 90  # stopped where it stood
    assert decided.checkpoint is None and stop.failure.key is None
    assert (span.state, span.error) == (SpanState.ERROR, "stopped: the table cannot be replicated: no key")
    # The next rounds (had any run) record, and so log, nothing more.
    again = span.written(facts(start, Pulled([(11, 100)], 11), 100, head=no_key))
    assert again.incident is None and span.incident is stop
    assert span.operator_action(stop.id, "skip") is None  # no row to skip
    assert span.operator_action(stop.id, "resume") is not None and span.state is SpanState.REPLICATING
    # Resumed without a fix: stopped again, as a new incident.
    third = span.written(facts(start, Pulled([(11, 100)], 11), 100, head=no_key))
    assert third.incident is not None and third.incident.id != stop.id


def test_a_refused_copy_stops_the_span_before_any_checkpoint() -> None:
    span = SpanMachine()
    span.started("copying")
    stop = span.refused_before_start("columns of types capture does not carry: ['g']")
    assert stop is not None and stop.kind == "unreplicable" and stop.upto_ts == 0
    assert span.state is SpanState.ERROR and span.refused_before_start("again") is None  # recorded once
    span.started("copying")
    assert span.incident is stop  # stays stopped until its operator action
    assert span.operator_action(stop.id, "resume") is not None and span.incident is None


def test_a_source_that_cannot_tell_stops_nothing() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    span.source_failed("cannot read the source's foreign keys")
    decided = span.written(facts(Checkpoint(10, 90), Pulled([], 10), 100, head=Refused("fks unreadable")))
    assert decided.incident is None and decided.checkpoint is None and span.incident is None
    assert span.state is SpanState.ERROR


def test_a_ddl_that_leaves_the_table_keyless_stops_it_after_the_rows_before_it() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    cut = SpanCut("k", limit_ts=120, batch_events=1, batch_max_ts=120, ddl_ts=150, ddl_id="d")
    decided = span.written(facts(Checkpoint(10, 90), Pulled([(11, 120), (12, 150)], 12), 200, cut=cut,
                                 outcome=SpanOutcome(written=True, rows=1, refused="no key after it")))
    assert decided.checkpoint == Checkpoint(11, 120) and decided.store_now  # the DDL stays ahead
    assert decided.incident is not None and decided.incident.kind == "unreplicable"
    assert span.incident is decided.incident and span.state is SpanState.ERROR


def test_an_incident_stops_the_span_until_its_own_operator_action() -> None:
    span = SpanMachine(state=SpanState.REPLICATING)
    stop = incident(1)
    decided = span.written(facts(Checkpoint(10, 90), Pulled([(11, 100)], 11), 100,
                                 cut=SpanCut("k", 100, 1, 100, None, None),
                                 outcome=SpanOutcome(incident=stop)))
    assert decided.incident == stop and decided.checkpoint is None
    assert span.state is SpanState.ERROR and span.error is not None and span.error.startswith("stopped: ")
    assert span.operator_action("i2", "resume") is None and span.incident == stop
    assert span.operator_action("i1", "skip") is not None
    assert span.incident is None and span.state is SpanState.REPLICATING
    assert span.skips == {'["k"]': 1001} and span.skip_reasons == {'["k"]': stop}


def test_a_batch_incident_cannot_be_skipped() -> None:
    span = SpanMachine(state=SpanState.ERROR, error="stopped: x", incident=incident(3, key=None))
    assert span.operator_action("i3", "skip") is None and span.incident is not None
    assert span.operator_action("i3", "retry") is not None and span.state is SpanState.REPLICATING


def test_a_state_without_its_error_is_refused_at_once() -> None:
    with pytest.raises(SpanInvariantError):
        SpanMachine(state=SpanState.ERROR)
    with pytest.raises(SpanInvariantError):
        SpanMachine(state=SpanState.REPLICATING, incident=incident(1))
    with pytest.raises(SpanInvariantError):
        SpanMachine(state=SpanState.REPLICATING, ddl_error=FAILURE)


# -- properties: random rounds ----------------------------------------------------------------------

HEADS = ["none", "refused", "unreplicable", "waits", "failed", "recopying", "carried_out"]
OUTCOMES = ["written", "ddl_applied", "unwritten", "error", "ddl_error", "incident", "blocked", "refused"]

round_strategy = st.tuples(
    st.sampled_from(["round", "round", "round", "pull_failed", "operator_right", "operator_wrong",
                     "started"]),
    st.sampled_from(HEADS), st.sampled_from(OUTCOMES),
    st.integers(0, 4),  # events pulled
    st.integers(0, 3),  # how many of them the batch takes
    st.booleans(),      # the batch stops at a DDL
    st.integers(0, 60),  # how far the resolved ts runs ahead
)


def expected_state(before: SpanState, head: str, outcome: str, fresh: bool) -> SpanState | None:
    """The state a round leaves (None: unchanged)."""
    if head == "refused":
        return None
    table = {"unreplicable": SpanState.ERROR, "waits": SpanState.BLOCKED, "failed": SpanState.ERROR,
             "recopying": SpanState.SNAPSHOT}
    if head in table:
        return table[head]
    if head == "carried_out" or not fresh:
        return SpanState.REPLICATING
    return {"incident": SpanState.ERROR, "error": SpanState.ERROR, "ddl_error": SpanState.ERROR,
            "unwritten": None, "blocked": SpanState.BLOCKED, "refused": SpanState.ERROR,
            }.get(outcome, SpanState.REPLICATING)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(round_strategy, min_size=5, max_size=60))
def test_random_rounds_keep_the_span_consistent(
        steps: list[tuple[str, str, str, int, int, bool, int]]) -> None:
    span = SpanMachine()
    span.started("stream")
    checkpoint = Checkpoint(0, 0)
    seq, ts = 0, 0
    incidents = 0
    for kind, head_kind, outcome_kind, n_events, n_batch, stops_at_ddl, ahead in steps:
        if kind == "started":
            stopped = span.incident
            span.started("stream")
            assert span.incident is stopped
            assert span.state is (SpanState.ERROR if stopped is not None else SpanState.REPLICATING)
            continue
        if kind == "pull_failed":
            span.pull_failed("pull failed: boom")
            assert span.state is SpanState.ERROR
            assert span.error == ("pull failed: boom" if span.incident is None
                                  else f"stopped: {span.incident.failure.describe()}")
            continue
        if kind in ("operator_right", "operator_wrong"):
            stopped = span.incident
            target = stopped.id if stopped is not None and kind == "operator_right" else "nobody"
            decided = span.operator_action(target, "resume")
            if stopped is not None and kind == "operator_right":
                assert decided is not None and span.incident is None
                assert span.state is SpanState.REPLICATING
            else:
                assert decided is None and span.incident is stopped
            continue
        if span.incident is not None:
            # The pipeline runs no round for a stopped span (``Pipeline._pull_all``).
            assert span.state is SpanState.ERROR and span.error is not None
            assert span.error.startswith("stopped: ")
            continue
        # A round: n_events fresh events after the checkpoint, the first n_batch form the batch.
        events = [(seq + i + 1, ts + 10 * (i + 1)) for i in range(n_events)]
        pulled = Pulled(events, read_upto=seq + n_events)
        horizon = ts + 10 * n_events + ahead
        fresh = bool(events)
        head: Head | None = None
        cut = outcome = None
        if head_kind == "refused":
            head = Refused("the source's foreign keys cannot be read")
        elif head_kind == "unreplicable":
            head = Refused("no usable key", unreplicable=True)
        elif head_kind == "waits":
            head = WaitsAtHead("waits for its shard DDL operation")
        elif head_kind == "failed":
            head = HeadFailed(FAILURE)
        elif head_kind == "recopying":
            head = Recopying()
        elif head_kind == "carried_out":
            ddl_ts = events[0][1] if events else horizon
            head = CarriedOut(SpanCut("k", ddl_ts, 0, None, ddl_ts, "ddl"))
        elif fresh:
            taken = events[:max(1, min(n_batch, n_events))]
            limit = taken[-1][1]
            ddl = stops_at_ddl and len(taken) < n_events
            ddl_ts = events[len(taken)][1] if ddl else None
            cut = SpanCut("k", limit_ts=ddl_ts if ddl_ts is not None else limit, batch_events=len(taken),
                          batch_max_ts=limit, ddl_ts=ddl_ts, ddl_id="ddl" if ddl else None)
            if outcome_kind == "incident":
                incidents += 1
                outcome = SpanOutcome(incident=incident(incidents))
            elif outcome_kind == "error":
                outcome = SpanOutcome(error="apply job failed")
            elif outcome_kind == "ddl_error":
                outcome = SpanOutcome(error=FAILURE.message(), ddl_failure=FAILURE)
            elif outcome_kind == "unwritten":
                outcome = SpanOutcome()
            else:
                outcome = SpanOutcome(written=True, rows=len(taken),
                                      ddl_applied=outcome_kind == "ddl_applied" and ddl,
                                      blocked="waits" if outcome_kind == "blocked" else None,
                                      refused="no key after it" if outcome_kind == "refused" else None)
        before = span.state
        decided = span.written(facts(checkpoint, pulled, horizon, head=head, cut=cut, outcome=outcome))
        want = expected_state(before, head_kind, outcome_kind, fresh)
        assert span.state is (want if want is not None else before), (head_kind, outcome_kind)
        # A new incident is decided exactly when the span stops now, and it is the span's.
        assert (decided.incident is not None) == (span.incident is not None)
        assert decided.incident is None or decided.incident is span.incident
        if decided.checkpoint is None:
            continue
        new = decided.checkpoint
        assert new.ts >= checkpoint.ts and new.stream_seq >= checkpoint.stream_seq
        # Nothing unapplied is passed: every event above the new ts sits after its sequence.
        assert all(e_seq > new.stream_seq for e_seq, e_ts in events if e_ts > new.ts)
        if cut is not None and (cut.batch_events or cut.ddl_id):
            assert outcome is not None and outcome.written
            assert new.ts <= (cut.ddl_ts if outcome.ddl_applied and cut.ddl_ts is not None else cut.limit_ts)
        assert decided.moved == (new != checkpoint)
        if decided.moved:
            checkpoint = new
            seq = max(seq, new.stream_seq)
            ts = max(ts, new.ts)
