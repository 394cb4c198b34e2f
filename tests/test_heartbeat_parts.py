"""A heartbeat larger than the server's max_payload goes in parts (``member.heartbeat`` v3).

Pure logic first (cutting, collecting, joining, the liveness read, the contract), then the
worker's own heartbeat through a real nats-server: ~8,000 spans, a report of about 1.4 MB
against the server's 1 MiB, confirmed by the self-fence and taken whole by the
replication-manager's ``LatestHeartbeats``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import REGISTRY, ContractError
from contracts.events.scheduling import MemberHeartbeatV3, SpanRefV1, TableStatusV1
from libs.control.heartbeat_parts import (
    ENVELOPE_MARGIN,
    ReportTooLarge,
    heartbeat_messages,
    joined,
    parse_part_header,
)
from libs.scheduling import Span
from libs.scheduling.tasks import Dispatch, DispatchAction
from libs.streams import (
    HEARTBEAT_PART_HEADER,
    HEARTBEAT_PARTIAL_HEADER,
    HEARTBEAT_UNCHANGED_HEADER,
    heartbeat_subject,
)
from services.member.liveness import decode_liveness
from services.replication_manager.service import LatestHeartbeats
from services.sink_worker.agent import SinkAgent

SUBJECT = heartbeat_subject("w1")


def _statuses(n: int, *, table: str = "t") -> list[TableStatusV1]:
    return [TableStatusV1(span=SpanRefV1(changefeed="cf", source="s1", database=f"db{i // 100}",
                                         table=f"{table}{i}"),
                          state="replicating", checkpoint_ts=400_000_000_000 + i,
                          resolved_ts=400_000_001_000 + i)
            for i in range(n)]


def _hb(n: int, *, complete: bool = True, seq: int = 7, **kw: object) -> MemberHeartbeatV3:
    return MemberHeartbeatV3(member_id="w1", incarnation="inc", epoch=3, seq=seq, complete=complete,
                             tables=_statuses(n), **kw)  # type: ignore[arg-type]


def _offer_all(latest: LatestHeartbeats, messages: list[tuple[bytes, dict[str, str] | None]]) -> list[bool]:
    return [latest.offer_message(SUBJECT, data, headers) for data, headers in messages]


@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("spans,max_payload", [(10, 1 << 20), (600, 32 << 10), (3000, 64 << 10),
                                               (3000, 1 << 20), (7, ENVELOPE_MARGIN + 700)])
def test_cut_and_joined_again_is_the_report(spans: int, max_payload: int, complete: bool) -> None:
    hb = _hb(spans, complete=complete)
    messages = heartbeat_messages(hb, max_payload=max_payload, producer="sink-worker/w1")
    assert all(len(data) <= max_payload - ENVELOPE_MARGIN for data, _ in messages)
    whole = len(REGISTRY.encode(hb, producer="p")) <= max_payload - ENVELOPE_MARGIN
    assert (len(messages) == 1) == whole
    for data, headers in messages:
        assert bool(headers and headers.get(HEARTBEAT_PARTIAL_HEADER)) == (not complete)
        # One message is v2, as older readers read it; parts are v3.
        assert json.loads(data)["version"] == (2 if whole else 3)
    latest = LatestHeartbeats()
    queued = _offer_all(latest, messages)
    assert queued == [False] * (len(messages) - 1) + [True]  # waits once, when whole
    [taken] = latest.take(SUBJECT)
    assert taken.tables == hb.tables and taken.complete == complete and (taken.part, taken.parts) == (0, 1)
    assert (taken.member_id, taken.seq, taken.epoch) == ("w1", 7, 3)


def test_a_report_with_a_part_lost_is_dropped_and_the_next_one_taken() -> None:
    latest = LatestHeartbeats()
    first = heartbeat_messages(_hb(600, seq=1), max_payload=32 << 10, producer="p")
    second = heartbeat_messages(_hb(600, seq=2), max_payload=32 << 10, producer="p")
    assert len(first) >= 3
    assert not any(_offer_all(latest, first[:-1]))  # the last part lost on the way
    assert latest.take(SUBJECT) == []
    assert _offer_all(latest, second)[-1]
    [taken] = latest.take(SUBJECT)
    assert taken.seq == 2 and len(taken.tables) == 600
    assert latest.parts.dropped == 1
    # A report of one message after an incomplete one: the incomplete one is given up too.
    _offer_all(latest, first[:1])
    assert _offer_all(latest, heartbeat_messages(_hb(3, seq=3), max_payload=1 << 20, producer="p")) == [True]
    assert [hb.seq for hb in latest.take(SUBJECT)] == [3] and latest.parts.dropped == 2


def test_a_complete_report_in_parts_supersedes_and_a_partial_one_never_replaces_it() -> None:
    latest = LatestHeartbeats()
    complete = heartbeat_messages(_hb(600, seq=5), max_payload=32 << 10, producer="p")
    partial = heartbeat_messages(_hb(600, seq=6, complete=False), max_payload=32 << 10, producer="p")
    _offer_all(latest, heartbeat_messages(_hb(2, seq=4, complete=False), max_payload=1 << 20, producer="p"))
    _offer_all(latest, complete)
    _offer_all(latest, partial)
    taken = latest.take(SUBJECT)
    assert [(hb.seq, hb.complete, len(hb.tables)) for hb in taken] == [(5, True, 600), (6, False, 600)]


@pytest.mark.parametrize("header", ["", "1", "1/2", "x/0/2", "1/2/2", "1/-1/2", "-1/0/2", "1/0/0",
                                    "1/0/100000", "1/0/2/3"])
def test_a_garbage_part_header_waits_for_nothing(header: str) -> None:
    assert parse_part_header(header) is None
    latest = LatestHeartbeats()
    assert latest.offer(SUBJECT, b"{}", False, header) is False
    assert latest.take(SUBJECT) == []


def test_parts_that_do_not_belong_together_are_left_out() -> None:
    a = heartbeat_messages(_hb(600, seq=9), max_payload=32 << 10, producer="p")
    events = [REGISTRY.decode(data).event for data, _ in a]
    assert all(isinstance(e, MemberHeartbeatV3) for e in events)
    assert joined(events) is not None  # type: ignore[arg-type]
    other = REGISTRY.decode(heartbeat_messages(_hb(600, seq=9), max_payload=32 << 10,
                                               producer="p")[1][0]).event
    swapped = [events[1], events[0], *events[2:]]
    forged = [events[0], other.model_copy(update={"incarnation": "other"}), *events[2:]]  # type: ignore[union-attr]
    assert joined(swapped) is None and joined(forged) is None  # type: ignore[arg-type]
    # In LatestHeartbeats: a header that claims a part of a report the data is not.
    latest = LatestHeartbeats()
    for data, headers in a[:-1]:
        latest.offer(SUBJECT, data, False, (headers or {})[HEARTBEAT_PART_HEADER])
    latest.offer(SUBJECT, a[0][0], False, a[-1][1][HEARTBEAT_PART_HEADER])  # type: ignore[index]
    assert latest.take(SUBJECT) == []
    # And an undecodable part drops its report whole.
    for data, headers in a[:-1]:
        latest.offer(SUBJECT, data, False, (headers or {})[HEARTBEAT_PART_HEADER])
    latest.offer(SUBJECT, b"not json", False, a[-1][1][HEARTBEAT_PART_HEADER])  # type: ignore[index]
    assert latest.take(SUBJECT) == []


def test_a_single_span_larger_than_the_limit_is_said_not_cut() -> None:
    huge = MemberHeartbeatV3(member_id="w1", incarnation="inc", seq=1,
                             tables=_statuses(1, table="x" * 3000))
    with pytest.raises(ReportTooLarge, match="max_payload"):
        heartbeat_messages(huge, max_payload=ENVELOPE_MARGIN + 1000, producer="p")
    many = MemberHeartbeatV3(member_id="w1", incarnation="inc", seq=1, tables=_statuses(3, table="x" * 3000))
    with pytest.raises(ReportTooLarge, match="a span's status alone"):
        heartbeat_messages(many, max_payload=ENVELOPE_MARGIN + 2000, producer="p")


def test_the_member_service_reads_liveness_from_every_part_and_from_v2() -> None:
    messages = heartbeat_messages(_hb(600, seq=11, draining=True), max_payload=32 << 10, producer="p")
    for data, _ in messages:
        light = decode_liveness(data)
        assert (light.member_id, light.seq, light.draining, light.tables) == ("w1", 11, True, [])
    [(v2, _)] = heartbeat_messages(_hb(3, seq=12), max_payload=1 << 20, producer="p")
    light = decode_liveness(v2)
    assert (light.seq, light.parts, light.tables) == (12, 1, [])


def test_a_part_out_of_range_is_refused_by_the_contract_and_the_liveness_read() -> None:
    data = REGISTRY.encode(_hb(2).model_copy(update={"part": 2, "parts": 2}), producer="p")
    with pytest.raises(ContractError):
        REGISTRY.decode(data)
    with pytest.raises(ContractError):
        decode_liveness(data)


async def test_a_worker_with_8000_spans_heartbeats_past_max_payload(nc: Client) -> None:
    """The worker's own heartbeat through the server: before the cut, the publish raised
    ``MaxPayloadError`` above ~6,000 spans and the self-fence never confirmed a heartbeat."""
    agent = SinkAgent(nc, member_id="w-big", address="", heartbeat_interval_s=0.2, fence_s=1.0)
    for i in range(8000):
        span = Span("changefeed-with-a-long-name", "source-1", f"schema_{i // 100:03d}", f"table_{i:05d}")
        agent.state.handle_dispatch(Dispatch("w-big", span, DispatchAction.ADD_PREPARE,
                                             400_000_000_000 + i, 1))
    latest = LatestHeartbeats()
    sizes: list[int] = []
    whole = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        sizes.append(len(msg.data))
        if latest.offer_message(msg.subject, msg.data, msg.headers):
            whole.set()

    sub = await nc.subscribe(heartbeat_subject("w-big"), cb=on_msg)
    try:
        await nc.flush()
        sent_at = time.monotonic()
        await agent._send_heartbeat()  # raised MaxPayloadError before the cut
        fence = agent.fence
        assert fence is not None and not fence.broken
        assert fence.deadline is not None and fence.deadline >= sent_at + fence.bound_s
        await asyncio.wait_for(whole.wait(), 10)
        taken = latest.take(heartbeat_subject("w-big"))
    finally:
        await sub.unsubscribe()
    assert len(sizes) >= 2 and sum(sizes) > nc.max_payload and max(sizes) <= nc.max_payload
    [hb] = taken
    assert hb.complete and len(hb.tables) == 8000
    assert {t.span.table for t in hb.tables} == {f"table_{i:05d}" for i in range(8000)}
    assert all(t.state == "preparing" for t in hb.tables)


def test_an_unchanged_heartbeat_is_liveness_only() -> None:
    """The member's last partial report again: one v3 message, not a report for the
    replication-manager (it must not replace a partial report still waiting there)."""
    latest = LatestHeartbeats()
    partial = heartbeat_messages(_hb(3, seq=20, complete=False), max_payload=1 << 20, producer="p")
    same = MemberHeartbeatV3(member_id="w1", incarnation="inc", epoch=3, seq=21, complete=False,
                             unchanged=True)
    [(data, headers)] = heartbeat_messages(same, max_payload=1 << 20, producer="p")
    assert json.loads(data)["version"] == 3 and headers is not None
    assert headers[HEARTBEAT_UNCHANGED_HEADER] == "1" and headers[HEARTBEAT_PARTIAL_HEADER] == "1"
    assert _offer_all(latest, partial) == [True]
    assert latest.offer_message(SUBJECT, data, headers) is False
    assert [(hb.seq, len(hb.tables)) for hb in latest.take(SUBJECT)] == [(20, 3)]
    assert latest.offer_message(SUBJECT, data, headers) is False and latest.take(SUBJECT) == []
    light = decode_liveness(data)
    assert (light.seq, light.unchanged) == (21, True)
    # Even offered as a report (no header), it is left out.
    assert latest.offer(SUBJECT, data, True) and latest.take(SUBJECT) == []


@pytest.mark.parametrize("update", [{"complete": True}, {"parts": 2}, {"tables": _statuses(1)}])
def test_an_unchanged_heartbeat_that_says_more_is_refused(update: dict[str, object]) -> None:
    same = MemberHeartbeatV3(member_id="w1", incarnation="inc", seq=1, complete=False, unchanged=True)
    raw = json.loads(heartbeat_messages(same, max_payload=1 << 20, producer="p")[0][0])
    raw["data"].update({k: [t.model_dump() for t in v] if k == "tables" else v  # type: ignore[attr-defined]
                        for k, v in update.items()})
    data = json.dumps(raw).encode()
    with pytest.raises(ContractError):
        REGISTRY.decode(data)
    if "tables" not in update:  # the liveness read leaves the tables unread
        with pytest.raises(ContractError):
            decode_liveness(data)


def _v2_body(hb: MemberHeartbeatV3) -> bytes:
    [(data, _)] = heartbeat_messages(hb, max_payload=1 << 20, producer="p")
    assert json.loads(data)["version"] == 2
    return data


@pytest.mark.parametrize("complete", [True, False])
def test_the_leader_decodes_v2_and_v3_in_one_pass_as_the_registry_does(
        complete: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report in one message is v2: the registry validates it, upcasts it and validates it
    again, three passes over every span. ``decode_heartbeat`` reads v2 and v3 in one, to the
    same heartbeat; anything else still goes the registry's way and fails as it does."""
    from libs.control import heartbeat_parts

    hb = _hb(300, complete=complete)
    bodies = [_v2_body(hb)] + [data for data, _ in heartbeat_messages(hb, max_payload=16 << 10, producer="p")]
    want = [REGISTRY.decode(b).event for b in bodies]
    calls: list[bytes] = []
    monkeypatch.setattr(heartbeat_parts.REGISTRY, "decode", lambda raw: calls.append(raw))
    assert [heartbeat_parts.decode_heartbeat(b) for b in bodies] == want
    assert calls == []  # every one in one pass


@pytest.mark.parametrize("change", ["v2 with a part", "v1", "not a heartbeat", "a bad table", "garbage"])
def test_what_the_one_pass_does_not_take_is_the_registrys(change: str) -> None:
    from libs.control.heartbeat_parts import decode_heartbeat

    raw = json.loads(_v2_body(_hb(2)))
    if change == "v2 with a part":
        raw["data"]["part"] = 0
    elif change == "v1":
        raw["version"] = 1
        raw["data"].pop("complete")
    elif change == "not a heartbeat":
        raw["type"] = "member.joined"
        raw["version"] = 2
        raw["data"] = {"member_id": "w1", "incarnation": "i", "address": ""}
    elif change == "a bad table":
        raw["data"]["tables"][0]["state"] = "flying"
    data = b"{not json" if change == "garbage" else json.dumps(raw).encode()
    try:
        want: object = REGISTRY.decode(data).event
    except ContractError as exc:
        want = exc
    if isinstance(want, MemberHeartbeatV3):
        assert decode_heartbeat(data) == want  # v1: upcast by the registry
    else:
        with pytest.raises(ContractError):
            decode_heartbeat(data)
