"""ReplicationSet transition table (every state x every member input, incl. death), scheduler
inputs per state, rebuild from reports, conflicts, the manager's rebuild and report handling,
and the member agent's side of the dispatch protocol (epoch fencing, one task per span)."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable

import pytest

from libs.scheduling import (
    AddTable,
    AgentVerdict,
    Dispatch,
    DispatchAction,
    InconsistentSetError,
    InvalidTaskError,
    MemberAgentState,
    MemberReport,
    MoveTable,
    MultiplePrimaryError,
    RemoveTable,
    ReplicationManager,
    ReplicationSet,
    Role,
    SetState,
    Span,
    TableState,
    TableStatus,
)

EPOCH = 3
SPAN = Span("cf", "src", "db", "t")
T = TableState
ROLE_LETTER = {"primary": "P", "secondary": "S", "undetermined": "U"}
DEATH = "death"


def describe(rs: ReplicationSet, msgs: list[Dispatch]) -> str:
    """Compact picture of a set after an input: ``state roles | dispatches``."""
    if rs.removed:
        state = "removed"
    elif rs.error is not None:
        state = "CONFLICT " + ",".join(rs.error.members)
    else:
        state = str(rs.state)
    roles = " ".join(f"{m}={ROLE_LETTER[str(r)]}" for m, r in sorted(rs.members.items()))
    sent = ", ".join(f"{d.action}->{d.member}" for d in msgs) or "-"
    return f"{state} [{roles}] | {sent}"


def status(rs: ReplicationSet, member: str, state: TableState, checkpoint: int = 0) -> list[Dispatch]:
    return rs.handle_member_status(member, state, checkpoint or None, checkpoint or None)


# -- fixtures: one set per state/role configuration, reached through the public inputs --------

def f_absent() -> ReplicationSet:
    return ReplicationSet(SPAN, epoch=EPOCH, checkpoint_ts=100)


def f_absent_undetermined() -> ReplicationSet:
    return ReplicationSet.from_reports(SPAN, {"c": TableStatus(SPAN, T.STOPPING, 100, 100)}, epoch=EPOCH)


def f_prepare_add() -> ReplicationSet:
    rs = f_absent()
    rs.handle_add_table("b", 100)
    return rs


def f_replicating() -> ReplicationSet:
    rs = f_absent()
    rs.handle_add_table("a", 100)
    status(rs, "a", T.PREPARED)
    status(rs, "a", T.REPLICATING, 100)
    assert rs.state is SetState.REPLICATING
    return rs


def f_prepare_move() -> ReplicationSet:
    rs = f_replicating()
    rs.handle_move_table("b")
    return rs


def f_commit_move() -> ReplicationSet:
    rs = f_prepare_move()
    status(rs, "b", T.PREPARED)
    assert rs.state is SetState.COMMIT
    return rs


def f_commit_waiting() -> ReplicationSet:
    return ReplicationSet.from_reports(SPAN, {
        "b": TableStatus(SPAN, T.PREPARED, 100, 100),
        "c": TableStatus(SPAN, T.STOPPING, 100, 100),
    }, epoch=EPOCH)


def f_commit_promoted() -> ReplicationSet:
    rs = f_prepare_add()
    status(rs, "b", T.PREPARED)
    assert rs.state is SetState.COMMIT and rs.primary == "b"
    return rs


def f_removing() -> ReplicationSet:
    rs = f_replicating()
    rs.handle_remove_table()
    return rs


def f_conflict() -> ReplicationSet:
    return ReplicationSet.from_reports(SPAN, {
        "a": TableStatus(SPAN, T.REPLICATING, 100, 100),
        "b": TableStatus(SPAN, T.REPLICATING, 100, 100),
    }, epoch=EPOCH)


FIXTURES: dict[str, Callable[[], ReplicationSet]] = {
    "absent": f_absent,
    "absent+undetermined": f_absent_undetermined,
    "prepare(add)": f_prepare_add,
    "prepare(move)": f_prepare_move,
    "commit(move)": f_commit_move,
    "commit(waiting)": f_commit_waiting,
    "commit(promoted)": f_commit_promoted,
    "replicating": f_replicating,
    "removing": f_removing,
    "conflict": f_conflict,
}

INITIAL = {
    "absent": "absent [] | -",
    "absent+undetermined": "absent [c=U] | -",
    "prepare(add)": "prepare [b=S] | -",
    "prepare(move)": "prepare [a=P b=S] | -",
    "commit(move)": "commit [a=P b=S] | -",
    "commit(waiting)": "commit [b=S c=U] | -",
    "commit(promoted)": "commit [b=P] | -",
    "replicating": "replicating [a=P] | -",
    "removing": "removing [a=P] | -",
    "conflict": "CONFLICT a,b [a=U b=U] | -",
}

INPUTS = [T.ABSENT, T.PREPARING, T.PREPARED, T.REPLICATING, T.STOPPING, T.STOPPED, DEATH]

# The transition table. Members a, b, c hold the roles the fixture gives them; x holds none.
# Any (fixture, member, input) not listed must leave the set unchanged and send nothing.
TABLE: dict[str, dict[tuple[str, str], str]] = {
    "absent": {
        ("x", T.PREPARING): "absent [x=U] | remove->x",
        ("x", T.PREPARED): "absent [x=U] | remove->x",
        ("x", T.STOPPING): "absent [x=U] | -",
        ("x", T.REPLICATING): "replicating [x=P] | -",  # the only possible writer: adopted
    },
    "absent+undetermined": {
        ("c", T.ABSENT): "absent [] | -",
        ("c", T.STOPPED): "absent [] | -",
        ("c", DEATH): "absent [] | -",
        ("c", T.PREPARING): "absent [c=U] | remove->c",
        ("c", T.PREPARED): "absent [c=U] | remove->c",
        ("c", T.REPLICATING): "replicating [c=P] | -",
        ("x", T.PREPARING): "absent [c=U x=U] | remove->x",
        ("x", T.PREPARED): "absent [c=U x=U] | remove->x",
        ("x", T.STOPPING): "absent [c=U x=U] | -",
        ("x", T.REPLICATING): "CONFLICT c,x [c=U x=U] | -",  # c may still be writing
    },
    "prepare(add)": {
        ("b", T.ABSENT): "prepare [b=S] | add-prepare->b",  # lost dispatch: resend
        ("b", T.PREPARED): "commit [b=P] | add-commit->b",  # nobody else: promote at once
        ("b", T.REPLICATING): "replicating [b=P] | -",
        ("b", T.STOPPING): "absent [b=U] | -",
        ("b", T.STOPPED): "absent [] | -",
        ("b", DEATH): "absent [] | -",
        ("x", T.PREPARING): "prepare [b=S x=U] | remove->x",
        ("x", T.PREPARED): "prepare [b=S x=U] | remove->x",
        ("x", T.STOPPING): "prepare [b=S x=U] | -",
        ("x", T.REPLICATING): "prepare [b=S x=P] | -",  # adopted; b's add becomes a move
    },
    "prepare(move)": {
        ("a", T.ABSENT): "prepare [b=S] | -",  # primary lost: b goes on preparing
        ("a", T.STOPPED): "prepare [b=S] | -",
        ("a", DEATH): "prepare [b=S] | -",
        ("a", T.STOPPING): "prepare [a=U b=S] | -",  # may still flush: undetermined
        ("b", T.ABSENT): "prepare [a=P b=S] | add-prepare->b",
        ("b", T.PREPARED): "commit [a=P b=S] | remove->a",  # old primary stops first
        ("b", T.REPLICATING): "CONFLICT a,b [a=U b=U] | -",
        ("b", T.STOPPING): "replicating [a=P b=U] | -",
        ("b", T.STOPPED): "replicating [a=P] | -",
        ("b", DEATH): "replicating [a=P] | -",
        ("x", T.PREPARING): "prepare [a=P b=S x=U] | remove->x",
        ("x", T.PREPARED): "prepare [a=P b=S x=U] | remove->x",
        ("x", T.STOPPING): "prepare [a=P b=S x=U] | -",
        ("x", T.REPLICATING): "CONFLICT a,x [a=U b=U x=U] | -",
    },
    "commit(move)": {
        ("a", T.REPLICATING): "commit [a=P b=S] | remove->a",  # remove not acted on yet: resend
        ("a", T.ABSENT): "commit [b=P] | add-commit->b",
        ("a", T.STOPPED): "commit [b=P] | add-commit->b",
        ("a", DEATH): "commit [b=P] | add-commit->b",
        ("b", T.PREPARED): "commit [a=P b=S] | remove->a",
        ("b", T.ABSENT): "replicating [a=P] | -",  # secondary lost: back to the old primary
        ("b", T.STOPPED): "replicating [a=P] | -",
        ("b", DEATH): "replicating [a=P] | -",
        ("b", T.STOPPING): "replicating [a=P b=U] | -",
        ("b", T.REPLICATING): "CONFLICT a,b [a=U b=U] | -",
        ("x", T.PREPARING): "commit [a=P b=S x=U] | remove->x",
        ("x", T.PREPARED): "commit [a=P b=S x=U] | remove->x",
        ("x", T.STOPPING): "commit [a=P b=S x=U] | -",
        ("x", T.REPLICATING): "CONFLICT a,x [a=U b=U x=U] | -",
    },
    "commit(waiting)": {
        ("b", T.ABSENT): "absent [c=U] | -",
        ("b", T.STOPPED): "absent [c=U] | -",
        ("b", DEATH): "absent [c=U] | -",
        ("b", T.STOPPING): "absent [b=U c=U] | -",
        ("b", T.REPLICATING): "CONFLICT b,c [b=U c=U] | -",
        ("c", T.ABSENT): "commit [b=P] | add-commit->b",  # last possible writer gone: promote
        ("c", T.STOPPED): "commit [b=P] | add-commit->b",
        ("c", DEATH): "commit [b=P] | add-commit->b",
        ("c", T.PREPARING): "commit [b=S c=U] | remove->c",
        ("c", T.PREPARED): "commit [b=S c=U] | remove->c",
        ("c", T.REPLICATING): "commit [b=S c=P] | remove->c",  # adopted, and the move goes on
        ("x", T.PREPARING): "commit [b=S c=U x=U] | remove->x",
        ("x", T.PREPARED): "commit [b=S c=U x=U] | remove->x",
        ("x", T.STOPPING): "commit [b=S c=U x=U] | -",
        ("x", T.REPLICATING): "CONFLICT c,x [b=U c=U x=U] | -",
    },
    "commit(promoted)": {
        ("b", T.PREPARING): "commit [b=P] | add-commit->b",
        ("b", T.PREPARED): "commit [b=P] | add-commit->b",
        ("b", T.REPLICATING): "replicating [b=P] | -",
        ("b", T.ABSENT): "absent [] | -",
        ("b", T.STOPPED): "absent [] | -",
        ("b", DEATH): "absent [] | -",
        ("x", T.PREPARING): "commit [b=P x=U] | remove->x",
        ("x", T.PREPARED): "commit [b=P x=U] | remove->x",
        ("x", T.STOPPING): "commit [b=P x=U] | -",
        ("x", T.REPLICATING): "CONFLICT b,x [b=U x=U] | -",
    },
    "replicating": {
        ("a", T.ABSENT): "absent [] | -",  # re-added by the basic scheduler
        ("a", T.STOPPED): "absent [] | -",
        ("a", DEATH): "absent [] | -",
        ("x", T.PREPARING): "replicating [a=P x=U] | remove->x",
        ("x", T.PREPARED): "replicating [a=P x=U] | remove->x",
        ("x", T.STOPPING): "replicating [a=P x=U] | -",
        ("x", T.REPLICATING): "CONFLICT a,x [a=U x=U] | -",
    },
    "removing": {
        ("a", T.PREPARING): "removing [a=P] | remove->a",
        ("a", T.PREPARED): "removing [a=P] | remove->a",
        ("a", T.REPLICATING): "removing [a=P] | remove->a",
        ("a", T.ABSENT): "removed [] | -",
        ("a", T.STOPPED): "removed [] | -",
        ("a", DEATH): "removed [] | -",
        ("x", T.PREPARING): "removing [a=P x=U] | remove->x",
        ("x", T.PREPARED): "removing [a=P x=U] | remove->x",
        ("x", T.STOPPING): "removing [a=P x=U] | -",
        ("x", T.REPLICATING): "CONFLICT a,x [a=U x=U] | -",
    },
    "conflict": {
        # Resolved only by the members' own reports showing a single writer.
        ("a", T.ABSENT): "replicating [b=P] | -",
        ("a", T.STOPPED): "replicating [b=P] | -",
        ("a", DEATH): "replicating [b=P] | -",
        ("a", T.STOPPING): "replicating [a=U b=P] | -",
        ("a", T.PREPARING): "prepare [a=S b=P] | -",
        ("a", T.PREPARED): "commit [a=S b=P] | remove->b",
        ("b", T.ABSENT): "replicating [a=P] | -",
        ("b", T.STOPPED): "replicating [a=P] | -",
        ("b", DEATH): "replicating [a=P] | -",
        ("b", T.STOPPING): "replicating [a=P b=U] | -",
        ("b", T.PREPARING): "prepare [a=P b=S] | -",
        ("b", T.PREPARED): "commit [a=P b=S] | remove->a",
        ("x", T.PREPARING): "CONFLICT a,b [a=U b=U x=U] | -",
        ("x", T.PREPARED): "CONFLICT a,b [a=U b=U x=U] | -",
        ("x", T.STOPPING): "CONFLICT a,b [a=U b=U x=U] | -",
        ("x", T.REPLICATING): "CONFLICT a,b [a=U b=U x=U] | -",
    },
}

ROLE_MEMBERS = {
    "absent": ["x"],
    "absent+undetermined": ["c", "x"],
    "prepare(add)": ["b", "x"],
    "prepare(move)": ["a", "b", "x"],
    "commit(move)": ["a", "b", "x"],
    "commit(waiting)": ["b", "c", "x"],
    "commit(promoted)": ["b", "x"],
    "replicating": ["a", "x"],
    "removing": ["a", "x"],
    "conflict": ["a", "b", "x"],
}

CASES = [(f, m, i) for f, members in ROLE_MEMBERS.items() for m in members for i in INPUTS]


def test_fixtures_are_what_the_table_assumes() -> None:
    for name, make in FIXTURES.items():
        assert describe(make(), []) == INITIAL[name], name


def test_table_only_names_real_cases() -> None:
    for fixture, rows in TABLE.items():
        for member, given in rows:
            assert (fixture, member, given) in CASES


@pytest.mark.parametrize(("fixture", "member", "given"), CASES,
                         ids=[f"{f}-{m}-{i}" for f, m, i in CASES])
def test_transition(fixture: str, member: str, given: TableState | str) -> None:
    rs = FIXTURES[fixture]()
    if given == DEATH:
        msgs = rs.handle_member_shutdown(member)
    else:
        assert isinstance(given, TableState)
        msgs = status(rs, member, given)
    expected = TABLE[fixture].get((member, given), INITIAL[fixture])
    assert describe(rs, msgs) == expected
    rs.check_invariants()
    assert all(d.epoch == EPOCH and d.span == SPAN for d in msgs)


# Scheduler inputs and tick, per state.
SCHEDULER_TABLE: dict[str, dict[str, str]] = {
    "absent": {
        "add x": "prepare [x=S] | add-prepare->x",
        "add c": "prepare [c=S] | add-prepare->c",
        "remove": "removed [] | -",
    },
    "absent+undetermined": {
        "add x": "prepare [c=U x=S] | add-prepare->x",
        "add c": "absent [c=U] | -",  # c may still hold it
        "remove": "removing [c=U] | -",  # already stopping; wait for Stopped
    },
    "prepare(add)": {
        "remove": "removing [b=S] | remove->b",
        "tick": "prepare [b=S] | add-prepare->b",
    },
    "prepare(move)": {
        "remove": "removing [a=P b=S] | remove->a, remove->b",
        "tick": "prepare [a=P b=S] | add-prepare->b",
    },
    "commit(move)": {
        "remove": "removing [a=P b=S] | remove->a, remove->b",
        "tick": "commit [a=P b=S] | remove->a",
    },
    "commit(waiting)": {"remove": "removing [b=S c=U] | remove->b"},
    "commit(promoted)": {
        "remove": "removing [b=P] | remove->b",
        "tick": "commit [b=P] | add-commit->b",
    },
    "replicating": {
        "move x": "prepare [a=P x=S] | add-prepare->x",
        "remove": "removing [a=P] | remove->a",
    },
    "removing": {"tick": "removing [a=P] | remove->a", "remove": "removing [a=P] | remove->a"},
    "conflict": {},
}
SCHEDULER_INPUTS = ["add x", "add c", "move x", "move a", "remove", "tick"]
SCHEDULER_CASES = [(f, i) for f in FIXTURES for i in SCHEDULER_INPUTS]


@pytest.mark.parametrize(("fixture", "given"), SCHEDULER_CASES,
                         ids=[f"{f}-{i}" for f, i in SCHEDULER_CASES])
def test_scheduler_input(fixture: str, given: str) -> None:
    rs = FIXTURES[fixture]()
    verb, _, who = given.partition(" ")
    if verb == "add":
        msgs = rs.handle_add_table(who, 50)
    elif verb == "move":
        msgs = rs.handle_move_table(who)
    elif verb == "remove":
        msgs = rs.handle_remove_table()
    else:
        msgs = rs.tick()
    assert describe(rs, msgs) == SCHEDULER_TABLE[fixture].get(given, INITIAL[fixture])
    rs.check_invariants()


# -- whole flows with checkpoints ---------------------------------------------------------------

def test_add_flow_carries_checkpoint_and_epoch() -> None:
    rs = ReplicationSet(SPAN, epoch=9)
    [d] = rs.handle_add_table("a", 500)
    assert d == Dispatch("a", SPAN, DispatchAction.ADD_PREPARE, 500, 9)
    assert status(rs, "a", T.PREPARING) == []
    [d] = status(rs, "a", T.PREPARED)
    assert (d.action, d.member, d.checkpoint_ts) == (DispatchAction.ADD_COMMIT, "a", 500)
    assert status(rs, "a", T.REPLICATING, 510) == []
    assert (rs.state, rs.primary, rs.checkpoint_ts) == (SetState.REPLICATING, "a", 510)


def test_move_promotes_with_the_old_primarys_final_checkpoint() -> None:
    rs = f_replicating()
    status(rs, "a", T.REPLICATING, 150)
    rs.handle_move_table("b")
    status(rs, "b", T.PREPARED, 120)  # a secondary's checkpoint is not the span's progress
    assert rs.checkpoint_ts == 150
    status(rs, "a", T.STOPPING, 160)
    [d] = status(rs, "a", T.STOPPED, 170)
    assert (d.action, d.member, d.checkpoint_ts) == (DispatchAction.ADD_COMMIT, "b", 170)
    status(rs, "b", T.REPLICATING, 175)
    assert describe(rs, []) == "replicating [b=P] | -"
    assert rs.checkpoint_ts == 175


def test_only_the_primarys_progress_counts() -> None:
    rs = f_prepare_move()
    status(rs, "b", T.PREPARING, 999)  # a secondary writes nothing downstream
    status(rs, "b", T.PREPARED, 999)
    assert rs.checkpoint_ts == 100
    status(rs, "a", T.REPLICATING, 130)
    assert rs.checkpoint_ts == 130


def test_secondary_lost_while_old_primary_already_stops() -> None:
    rs = f_commit_move()
    status(rs, "a", T.STOPPING)  # the remove reached a
    assert rs.handle_member_shutdown("b") == []  # and then b died: nothing to promote
    assert describe(rs, rs.tick()) == "commit [a=P] | -"
    status(rs, "a", T.STOPPED, 140)
    assert describe(rs, []) == "absent [] | -" and rs.checkpoint_ts == 140


def test_checkpoint_never_goes_backwards() -> None:
    rs = f_replicating()
    status(rs, "a", T.REPLICATING, 300)
    status(rs, "a", T.REPLICATING, 200)
    assert (rs.checkpoint_ts, rs.resolved_ts) == (300, 300)
    rs.handle_member_status("a", T.REPLICATING, 310, 305)  # resolved below checkpoint is clamped
    assert (rs.checkpoint_ts, rs.resolved_ts) == (310, 310)
    rs.handle_add_table("z", 10)  # ignored (not Absent) and must not lower anything
    assert rs.checkpoint_ts == 310


def test_move_and_add_rejections_are_explained() -> None:
    rs = f_replicating()
    assert rs.why_not_move("a") == "span cf/src/db/t already replicates on a"
    assert rs.why_not_add("b") == "span cf/src/db/t is replicating, only an Absent span can be added"
    rs.handle_move_table("b")
    assert rs.why_not_move("c") == "span cf/src/db/t is prepare, only a Replicating span can be moved"
    assert f_absent_undetermined().why_not_add("c") == "member c still holds span cf/src/db/t (undetermined)"


# -- rebuild ------------------------------------------------------------------------------------

def rebuilt(**states: TableState) -> ReplicationSet:
    return ReplicationSet.from_reports(
        SPAN, {m: TableStatus(SPAN, s, 100 + i, 100 + i) for i, (m, s) in enumerate(states.items())},
        epoch=EPOCH, checkpoint_ts=90)


@pytest.mark.parametrize(("states", "expected", "tick"), [
    ({}, "absent [] | -", "-"),
    ({"a": T.REPLICATING}, "replicating [a=P] | -", "-"),
    ({"a": T.REPLICATING, "b": T.PREPARING}, "prepare [a=P b=S] | -", "-"),
    ({"a": T.REPLICATING, "b": T.PREPARED}, "commit [a=P b=S] | -", "remove->a"),
    ({"b": T.PREPARED}, "commit [b=S] | -", "add-commit->b"),
    ({"b": T.PREPARING}, "prepare [b=S] | -", "-"),
    ({"b": T.PREPARED, "c": T.STOPPING}, "commit [b=S c=U] | -", "-"),
    ({"c": T.STOPPING}, "absent [c=U] | -", "-"),
    ({"a": T.STOPPED, "b": T.ABSENT}, "absent [] | -", "-"),
    # An extra secondary is undetermined: told to remove, and d waits for it to stop.
    ({"b": T.PREPARING, "d": T.PREPARED}, "commit [b=U d=S] | -", "remove->b"),
    ({"a": T.REPLICATING, "b": T.REPLICATING}, "CONFLICT a,b [a=U b=U] | -", "-"),
    ({"a": T.REPLICATING, "b": T.REPLICATING, "c": T.STOPPING}, "CONFLICT a,b [a=U b=U c=U] | -", "-"),
])
def test_rebuild_from_reports(states: dict[str, TableState], expected: str, tick: str) -> None:
    rs = rebuilt(**states)
    assert describe(rs, []) == expected
    rs.check_invariants()
    sent = ", ".join(f"{d.action}->{d.member}" for d in rs.tick()) or "-"
    assert sent == tick


def test_rebuild_takes_the_highest_reported_checkpoint_over_the_floor() -> None:
    assert rebuilt(a=T.REPLICATING, b=T.PREPARING).checkpoint_ts == 101
    assert rebuilt().checkpoint_ts == 90


def test_rebuild_two_replicating_is_an_error_never_a_promotion() -> None:
    rs = rebuilt(a=T.REPLICATING, b=T.REPLICATING)
    assert isinstance(rs.error, MultiplePrimaryError)
    assert rs.error.members == ("a", "b")
    assert "more than one member reports Replicating" in str(rs.error)
    assert rs.primary is None
    # Nothing the scheduler asks changes that.
    assert rs.handle_move_table("c") == [] and rs.handle_add_table("c", 1) == []
    assert rs.handle_remove_table() == [] and rs.tick() == []
    assert status(rs, "a", T.REPLICATING) == [] and rs.error is not None


def test_stopping_member_blocks_promotion_until_it_stops() -> None:
    rs = rebuilt(c=T.STOPPING)
    rs.handle_add_table("b", 100)
    assert status(rs, "b", T.PREPARED) == []  # prepared, but c may still write
    assert describe(rs, []) == "commit [b=S c=U] | -"
    assert status(rs, "c", T.STOPPING) == []
    assert rs.tick() == []
    [d] = status(rs, "c", T.STOPPED)
    assert (d.action, d.member) == (DispatchAction.ADD_COMMIT, "b")


def test_old_primary_stopping_during_move_blocks_promotion() -> None:
    rs = f_prepare_move()
    status(rs, "a", T.STOPPING)  # e.g. a restarts its pipeline while b prepares
    assert status(rs, "b", T.PREPARED) == []
    assert describe(rs, []) == "commit [a=U b=S] | -"
    [d] = rs.handle_member_shutdown("a")
    assert (d.action, d.member) == (DispatchAction.ADD_COMMIT, "b")


def test_operator_resolves_a_conflict() -> None:
    rs = f_conflict()
    with pytest.raises(InvalidTaskError, match="not one of the writers"):
        rs.resolve_conflict("z")
    with pytest.raises(InvalidTaskError, match="not in conflict"):
        f_replicating().resolve_conflict("a")
    [d] = rs.resolve_conflict("a")
    assert (d.action, d.member) == (DispatchAction.REMOVE, "b")
    assert [(d.action, d.member) for d in rs.tick()] == [(DispatchAction.REMOVE, "b")]
    [d] = status(rs, "b", T.REPLICATING)  # has not acted yet: remind it
    assert d.member == "b"
    status(rs, "b", T.STOPPING)
    assert describe(rs, []) == "replicating [a=P b=U] | -"
    status(rs, "b", T.STOPPED)
    assert describe(rs, []) == "replicating [a=P] | -"


def test_invariant_checker_catches_a_broken_set() -> None:
    rs = f_replicating()
    rs.secondary = "zz"
    with pytest.raises(Exception, match="secondary zz"):
        rs.check_invariants()


# -- manager: rebuild gate, reports, tasks -----------------------------------------------------

def report(member: str, *tables: tuple[Span, TableState, int], epoch: int = EPOCH,
           complete: bool = True, seq: int | None = None) -> MemberReport:
    return MemberReport(member, epoch, tuple(TableStatus(s, st, c, c) for s, st, c in tables),
                        complete=complete, seq=seq)


S1, S2 = Span("cf", "src", "db", "t1"), Span("cf", "src", "db", "t2")


def test_manager_waits_for_every_live_member_before_dispatching() -> None:
    m = ReplicationManager(EPOCH, live_members=["a", "b"], known_spans={S1: (100, 100), S2: (80, 80)})
    assert not m.ready and m.awaiting == {"a", "b"}
    assert m.handle_report(report("a", (S1, T.PREPARED, 100))) == []
    out = m.handle_tasks([AddTable(S2, "a", 80)])
    assert out.rejected[0].reason == "rebuilding after a leader change: waiting for reports from b"
    assert m.tick() == []
    # b was replicating S1 all along: promoting a without hearing from b would double-write.
    dispatches = m.handle_report(report("b", (S1, T.REPLICATING, 105)))
    assert m.ready
    assert [(d.action, d.member, d.span) for d in dispatches] == [(DispatchAction.REMOVE, "b", S1)]
    assert describe(m.sets[S1], []) == "commit [a=S b=P] | -"
    assert describe(m.sets[S2], []) == "absent [] | -"
    assert m.sets[S2].checkpoint_ts == 80


def test_manager_rebuild_finishes_when_the_missing_member_dies() -> None:
    m = ReplicationManager(EPOCH, live_members=["a", "b"])
    m.handle_report(report("a", (S1, T.PREPARED, 100)))
    [d] = m.handle_member_shutdown("b")
    assert m.ready and (d.action, d.member) == (DispatchAction.ADD_COMMIT, "a")


def test_manager_epoch_fencing_of_reports() -> None:
    m = ReplicationManager(EPOCH, live_members=["a"])
    assert m.handle_report(report("a", epoch=EPOCH - 1)) == [] and not m.ready
    assert m.stale_reports == 1
    m.handle_report(report("a", epoch=EPOCH + 1))
    assert m.deposed


def test_manager_drops_overtaken_reports_and_unknown_members() -> None:
    m = ReplicationManager(EPOCH, live_members=["a"])
    m.handle_report(report("a", seq=5))
    m.handle_tasks([AddTable(S1, "a", 10)])
    m.handle_report(report("a", (S1, T.PREPARED, 10), complete=False, seq=7))
    assert m.sets[S1].primary == "a"
    m.handle_report(report("a", seq=6))  # older heartbeat: would say Absent
    assert m.sets[S1].primary == "a" and m.stale_reports == 1
    m.handle_report(report("ghost", (S2, T.REPLICATING, 1)))
    assert S2 not in m.sets and m.unknown_member_reports == 1


def test_complete_report_without_a_span_means_absent() -> None:
    m = ReplicationManager(EPOCH, live_members=["a"])
    m.handle_report(report("a"))
    m.handle_tasks([AddTable(S1, "a", 10)])
    m.handle_report(report("a", (S1, T.PREPARED, 10), complete=False))
    m.handle_report(report("a", (S1, T.REPLICATING, 12), complete=False))
    assert m.sets[S1].state is SetState.REPLICATING and not m.running
    m.handle_report(report("a"))  # a restarted and lost it
    assert m.sets[S1].state is SetState.ABSENT and m.sets[S1].checkpoint_ts == 12


def test_report_of_an_unknown_span_is_tracked_not_ignored() -> None:
    m = ReplicationManager(EPOCH, live_members=["a"])
    m.handle_report(report("a"))
    [d] = m.handle_report(report("a", (S1, T.PREPARING, 5), complete=False))
    assert (d.action, d.member) == (DispatchAction.REMOVE, "a")
    m.handle_report(report("a", (S2, T.REPLICATING, 5), complete=False))
    assert describe(m.sets[S2], []) == "replicating [a=P] | -"


def test_manager_task_rules() -> None:
    m = ReplicationManager(EPOCH, live_members=["a", "b"], max_task_concurrency=1)
    m.handle_report(report("a"))
    m.handle_report(report("b"))
    m.handle_member_joined("c")
    out = m.handle_tasks([AddTable(S1, "a", 10), AddTable(S1, "b", 10), AddTable(S2, "c", 10),
                          MoveTable(S2, "a"), RemoveTable(Span("cf", "x", "y", "z"))])
    assert out.accepted == [AddTable(S1, "a", 10)]
    assert [r.reason for r in out.rejected] == [
        "span cf/src/db/t1 already has a task in flight: AddTable(span=Span(changefeed='cf', "
        "source='src', database='db', table='t1'), member='a', checkpoint_ts=10)",
        "member c has not reported its tables yet",
        "span cf/src/db/t2 is unknown",
        "span cf/x/y/z is unknown",
    ]
    for msg in [report("a", (S1, T.PREPARED, 10), complete=False),
                report("a", (S1, T.REPLICATING, 10), complete=False)]:
        m.handle_report(msg)
    assert m.handle_tasks([MoveTable(S1, "b")]).accepted
    m.handle_tasks([AddTable(S2, "b", 10)])
    m.handle_report(report("b", (S2, T.PREPARED, 10), complete=False))
    m.handle_report(report("b", (S2, T.REPLICATING, 10), complete=False))
    assert m.handle_tasks([MoveTable(S2, "a")]).rejected[0].reason == "1 moves already in flight (max 1)"
    assert m.handle_tasks([MoveTable(S1, "a")]).rejected[0].reason.startswith("span cf/src/db/t1 already")


def test_manager_surfaces_conflicts_as_errors() -> None:
    m = ReplicationManager(EPOCH, live_members=["a", "b"])
    m.handle_report(report("a", (S1, T.REPLICATING, 5)))
    m.handle_report(report("b", (S1, T.REPLICATING, 6)))
    [err] = m.errors
    assert err.span == S1 and err.members == ("a", "b")
    assert m.handle_tasks([RemoveTable(S1)]).rejected[0].reason.startswith("span cf/src/db/t1 is blocked")
    [d] = m.resolve_conflict(S1, "b")
    assert d.member == "a"
    m.handle_member_shutdown("a")
    assert m.errors == [] and m.sets[S1].primary == "b"


# -- member agent --------------------------------------------------------------------------------

def dispatch(action: DispatchAction, epoch: int = EPOCH, member: str = "a", checkpoint: int = 10) -> Dispatch:
    return Dispatch(member, SPAN, action, checkpoint, epoch)


def path(agent: MemberAgentState, *steps: object) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for step in steps:
        if isinstance(step, Dispatch):
            transitions = list(agent.handle_dispatch(step).transitions)
        elif step == "prepared":
            transitions = agent.prepared(SPAN)
        else:
            transitions = agent.stopped(SPAN)
        seen.extend((str(t.old), str(t.new)) for t in transitions)
    return seen


ADD_PREPARE, ADD_COMMIT, REMOVE = DispatchAction.ADD_PREPARE, DispatchAction.ADD_COMMIT, DispatchAction.REMOVE


def test_agent_add_then_remove_transitions() -> None:
    agent = MemberAgentState("a")
    assert path(agent, dispatch(ADD_PREPARE), "prepared", dispatch(ADD_COMMIT, checkpoint=20),
                dispatch(REMOVE), "stopped") == [
        ("absent", "preparing"), ("preparing", "prepared"), ("prepared", "replicating"),
        ("replicating", "stopping"), ("stopping", "stopped")]
    assert agent.tables[SPAN].checkpoint_ts == 20
    rep = agent.collect_report()
    assert [s.state for s in rep.tables] == [T.STOPPED] and rep.complete
    assert agent.collect_report().tables == ()  # Stopped is reported once, then forgotten


def test_agent_commit_before_prepared_finishes_goes_straight_on() -> None:
    agent = MemberAgentState("a")
    assert path(agent, dispatch(ADD_COMMIT), "prepared") == [
        ("absent", "preparing"), ("preparing", "prepared"), ("prepared", "replicating")]


def test_agent_rejects_older_epochs_and_counts_them() -> None:
    agent = MemberAgentState("a")
    assert agent.handle_dispatch(dispatch(ADD_PREPARE, epoch=5)).verdict is AgentVerdict.ACCEPTED
    out = agent.handle_dispatch(dispatch(ADD_COMMIT, epoch=4))
    assert out.verdict is AgentVerdict.STALE_EPOCH and out.status.state is T.PREPARING
    assert not agent.observe_epoch(3)
    assert agent.rejected_stale == 2
    assert agent.observe_epoch(6) and agent.newest_epoch == 6
    assert agent.handle_dispatch(dispatch(REMOVE, epoch=5)).verdict is AgentVerdict.STALE_EPOCH


def test_agent_deposed_leaders_commit_does_not_promote() -> None:
    agent = MemberAgentState("a")
    agent.handle_dispatch(dispatch(ADD_COMMIT, epoch=5))
    agent.observe_epoch(6)
    assert path(agent, "prepared") == [("preparing", "prepared")]
    assert agent.state_of(SPAN) is T.PREPARED


def test_agent_one_task_per_span() -> None:
    agent = MemberAgentState("a")
    agent.handle_dispatch(dispatch(ADD_PREPARE))
    assert agent.handle_dispatch(dispatch(ADD_PREPARE)).verdict is AgentVerdict.DUPLICATE
    assert agent.handle_dispatch(dispatch(ADD_COMMIT)).verdict is AgentVerdict.BUSY
    assert agent.rejected_busy == 1
    # A newer leader's dispatch replaces the deposed leader's task.
    assert agent.handle_dispatch(dispatch(REMOVE, epoch=EPOCH + 1)).verdict is AgentVerdict.ACCEPTED
    assert agent.state_of(SPAN) is T.STOPPING
    assert agent.handle_dispatch(dispatch(ADD_PREPARE, epoch=EPOCH + 1)).verdict is AgentVerdict.BUSY


def test_agent_remove_cuts_a_prepare_short() -> None:
    """A span that only prepares writes nothing: the leader's remove (a prepare given up after
    its deadline) is carried out at once, not refused as busy."""
    agent = MemberAgentState("a")
    agent.handle_dispatch(dispatch(ADD_PREPARE))
    out = agent.handle_dispatch(dispatch(REMOVE))
    assert out.verdict is AgentVerdict.ACCEPTED and out.status.state is T.STOPPING
    assert agent.rejected_busy == 0
    agent.stopped(SPAN)
    assert agent.state_of(SPAN) is T.STOPPED


def test_a_prepare_past_its_deadline_is_rolled_back() -> None:
    """A move whose destination never becomes Prepared goes back to Replicating on the primary
    (which never stopped writing); an add goes back to Absent; the task finishes either way."""
    manager = ReplicationManager(EPOCH, live_members=["a", "b", "c"], prepare_timeout_s=10.0)
    for m in ("a", "b", "c"):
        manager.handle_report(MemberReport(m, EPOCH, (), True, 1))
    other = Span("cf", "src", "db", "u")
    manager.handle_tasks([AddTable(SPAN, "a", 10)])
    manager.handle_report(MemberReport("a", EPOCH, (TableStatus(SPAN, T.REPLICATING, 10, 10),), False, 2))
    assert manager.sets[SPAN].state is SetState.REPLICATING
    manager.handle_tasks([MoveTable(SPAN, "b"), AddTable(other, "c", 5)])
    manager.handle_report(MemberReport("b", EPOCH, (TableStatus(SPAN, T.PREPARING, 10, 10),), False, 2))
    manager.handle_report(MemberReport("c", EPOCH, (TableStatus(other, T.PREPARING, 5, 5),), False, 2))
    assert manager.tick(100.0) == []  # the deadline starts at the first tick that sees it
    assert manager.prepare_deadlines(105.0) == {SPAN: ("b", 5.0), other: ("c", 5.0)}
    assert manager.tick(109.9) == []
    sent = manager.tick(110.0)
    assert sorted((d.member, d.action) for d in sent) == [("b", REMOVE), ("c", REMOVE)]
    moved, added = manager.sets[SPAN], manager.sets[other]
    assert describe(moved, []) == "replicating [a=P b=U] | -"
    assert describe(added, []) == "absent [c=U] | -"
    assert manager.running == {} and manager.prepare_timeouts == 2
    assert manager.prepare_deadlines(110.0) == {}
    # The members let go of the spans: nothing of either prepare remains.
    manager.handle_report(MemberReport("b", EPOCH, (TableStatus(SPAN, T.STOPPED),), False, 3))
    manager.handle_report(MemberReport("c", EPOCH, (TableStatus(other, T.STOPPED),), False, 3))
    assert describe(moved, []) == "replicating [a=P] | -"
    assert describe(added, []) == "absent [] | -"


def test_a_late_prepared_after_the_deadline_is_not_promoted() -> None:
    rs = ReplicationSet(SPAN, epoch=EPOCH, checkpoint_ts=10)
    rs.handle_add_table("a", 10)
    status(rs, "a", T.REPLICATING, 10)
    rs.handle_move_table("b")
    assert describe(rs, rs.abandon_prepare()) == "replicating [a=P b=U] | remove->b"
    assert describe(rs, status(rs, "b", T.PREPARED)) == "replicating [a=P b=U] | remove->b"
    assert rs.abandon_prepare() == []  # only a Prepare is given up


def test_agent_misc_verdicts() -> None:
    agent = MemberAgentState("a")
    assert agent.handle_dispatch(dispatch(ADD_PREPARE, member="b")).verdict is AgentVerdict.WRONG_MEMBER
    out = agent.handle_dispatch(dispatch(REMOVE))
    assert out.verdict is AgentVerdict.DUPLICATE and out.status.state is T.ABSENT
    assert SPAN not in agent.tables
    path(agent, dispatch(ADD_PREPARE), "prepared", dispatch(REMOVE))
    assert agent.handle_dispatch(dispatch(ADD_PREPARE, epoch=EPOCH + 1)).verdict is AgentVerdict.IGNORED
    agent.stopped(SPAN, 33)
    assert agent.status(SPAN) == TableStatus(SPAN, T.STOPPED, 33, 10)
    # Stopped has released everything: a new add starts afresh.
    assert path(agent, dispatch(ADD_PREPARE, epoch=EPOCH + 1)) == [("stopped", "preparing")]


def test_agent_progress_and_may_write() -> None:
    agent = MemberAgentState("a")
    path(agent, dispatch(ADD_COMMIT), "prepared")
    agent.update_progress(SPAN, 50, 60)
    agent.update_progress(SPAN, 40)
    table = agent.tables[SPAN]
    assert (table.checkpoint_ts, table.resolved_ts, table.may_write) == (50, 60, True)
    agent.handle_dispatch(dispatch(REMOVE))
    assert agent.tables[SPAN].may_write  # stopping after writing: may still flush
    agent.stopped(SPAN)
    assert not agent.tables[SPAN].may_write
    prep = MemberAgentState("b")
    prep.handle_dispatch(dispatch(ADD_PREPARE, member="b"))
    prep.handle_dispatch(dispatch(REMOVE, member="b", epoch=EPOCH + 1))
    assert not prep.tables[SPAN].may_write  # stopping a table that never wrote


def test_span_key_is_stable_and_reversible() -> None:
    span = Span("cf/1", "src 1", "db%", "t.x")
    assert span.key == "cf%2F1/src%201/db%25/t.x" == str(span)
    assert Span.parse(span.key) == span
    with pytest.raises(ValueError, match="4 '/'-separated parts"):
        Span.parse("a/b")


def test_leader_deposed_mid_rebuild_hands_on_what_it_replayed() -> None:
    m = ReplicationManager(EPOCH, live_members=["a"], known_spans={S1: (70, 75)})
    assert m.span_checkpoints() == {S1: (70, 75)}
    m.handle_report(report("a", (S1, T.REPLICATING, 90)))
    assert m.span_checkpoints() == {S1: (90, 90)}


def test_check_invariants_raises_exactly_when_a_problem_is_found() -> None:
    """The one-pass check (run after every step) and the itemised problems agree on every
    combination of fields, consistent or not."""
    rng = random.Random(5)
    span = Span("cf", "src", "db", "t")
    roles = [None, Role.PRIMARY, Role.SECONDARY, Role.UNDETERMINED]
    error = MultiplePrimaryError(span, ("a", "b"), "two writers")
    checked = raised = 0
    for state, primary, secondary, role_a, role_b, err, removed in itertools.product(
            SetState, [None, "a", "b"], [None, "a", "b"], roles, roles, [None, error], [False, True]):
        rs = ReplicationSet(span, epoch=1, checkpoint_ts=10, resolved_ts=10)
        rs.state, rs.primary, rs.secondary, rs.error, rs.removed = state, primary, secondary, err, removed
        rs.members = {m: r for m, r in (("a", role_a), ("b", role_b)) if r is not None}
        if rng.random() < 0.1:
            rs.resolved_ts = 5
        problems = rs._problems()
        if problems:
            with pytest.raises(InconsistentSetError, match=re.escape("; ".join(problems))):
                rs.check_invariants()
            raised += 1
        else:
            rs.check_invariants()
        checked += 1
    assert 0 < raised < checked


@pytest.mark.parametrize("other", [T.ABSENT, T.STOPPED])
def test_rebuild_of_one_replicating_member_equals_the_general_path(other: TableState) -> None:
    # One report of Replicating takes a shortcut; a second member that holds nothing goes the
    # general way: the two sets must be the same.
    short, general = rebuilt(a=T.REPLICATING), rebuilt(a=T.REPLICATING, b=other)
    for name in ("state", "primary", "secondary", "members", "reported", "error", "_resolve_keep"):
        assert getattr(short, name) == getattr(general, name), name
    assert short.tick() == general.tick() == []
