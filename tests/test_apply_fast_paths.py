"""Unit tests: the apply path's fast paths give exactly what the general code they stand for gives.

- ``apply_job.explode_collapse`` (one loop) equals ``collapse(explode_events(...))``, with key
  changes, deletes, two shards of one target, an operator's skips and an origin column; a
  message of several transaction parts (``picks``) collapses exactly as its parts apart;
- ``mysql._row_literal`` spells values exactly as pymysql's own interpolation does;
- ``sql_common._key_order`` orders changes as ``sort_key`` does;
- ``RowDecoder``'s no-call path for values already of their column's type equals ``decode_value``.
"""

from __future__ import annotations

import json
import random
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pymysql.connections

from contracts import REGISTRY
from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV2, TableMetaV1
from libs.codec.decode import RowDecoder, decode_value
from services.sink_worker.round.apply_job import ApplyPlan, collapse, explode_collapse, explode_events
from services.sink_worker.sinks.base import Delete, Upsert
from services.sink_worker.sinks.mysql import _row_literal
from services.sink_worker.sinks.sql_common import _key_order, sort_key

META = TableMetaV1.model_validate({
    "columns": [{"name": "id", "kind": "int", "sql_type": "int", "nullable": False},
                {"name": "k", "kind": "string", "sql_type": "varchar(8)", "nullable": False},
                {"name": "v", "kind": "int", "sql_type": "int"}],
    "primary_key": ["id", "k"]})


def _event(ts: int, seq: int, rows: list[RowImageV2]) -> bytes:
    return REGISTRY.encode(RowsChangedV2.model_validate({
        "source": "s", "database": "d", "table": "t", "ts": ts, "seq": seq,
        "position": {"binlog_file": "b.1", "binlog_pos": 4}, "meta": META.model_dump(),
        "rows": [r.model_dump() for r in rows]}), producer="test")


Event = tuple[str, int, int, int, bytes, list[int]]


def _random_events(rnd: random.Random, span: str, n: int) -> list[Event]:
    rows: dict[tuple[int, str], int] = {}
    events = []
    for i in range(n):
        images = []
        for _ in range(rnd.randint(1, 6)):
            key = (rnd.randint(1, 12), rnd.choice("ab"))
            image = {"id": key[0], "k": key[1], "v": rnd.randint(0, 9)}
            if key not in rows:
                images.append(RowImageV2(op="insert", after=image))
                rows[key] = image["v"]
            elif rnd.random() < 0.3:
                images.append(RowImageV2(op="delete", before={"id": key[0], "k": key[1], "v": rows.pop(key)}))
            else:
                new = (rnd.randint(1, 12), rnd.choice("ab")) if rnd.random() < 0.3 else key
                if new != key and new in rows:
                    continue
                before = {"id": key[0], "k": key[1], "v": rows.pop(key)}
                after = {**image, "id": new[0], "k": new[1]}
                images.append(RowImageV2(op="update", before=before, after=after))
                rows[new] = image["v"]
        if images:
            # Two shards interleave in ts: the collapse must order across spans, not by position.
            ts = 10 * i + (3 if span.endswith("2") else 0)
            events.append((span, ts, i, 0, _event(ts, i, images), []))
    return events


def test_explode_collapse_equals_explode_then_collapse() -> None:
    rnd = random.Random(5)
    events = _random_events(rnd, "s1", 60) + _random_events(rnd, "s2", 60)
    span_targets: dict[str, tuple[int, tuple[str, ...], tuple[str, str] | None]] = {
        "s1": (0, ("id", "k"), None), "s2": (0, ("id", "k"), None)}
    plans: list[ApplyPlan] = [
        ApplyPlan(span_targets=span_targets, plans=[]),
        ApplyPlan(span_targets=span_targets, plans=[], skips={"s2": {'[3,"a"]': 10**9, '[4,"b"]': 200}}),
        ApplyPlan(span_targets={"s1": (0, ("_o", "id", "k"), ("_o", "x")), "s2": (0, ("id", "k"), None)},
                  plans=[]),
    ]
    for plan in plans:
        expected = list(collapse(explode_events(plan, events, buckets=False)))
        got = list(explode_collapse(plan, events))
        assert got == expected
        assert {op for _, _, op, *_ in got} == {"upsert", "delete"}
        assert {shard for *_, shard, _ in got} == {0, 1}


def _as_messages(rnd: random.Random, events: list[Event]) -> list[Event]:
    """The same events, runs of up to 5 of one span as ``rows.changed`` v4 messages of several
    parts (what capture publishes under many small transactions), each batch event taking all
    of its message's parts or, for some, only a later run of them (a checkpoint inside it)."""
    out: list[Event] = []
    i = 0
    while i < len(events):
        run = [events[i]]
        while (len(run) < 5 and i + len(run) < len(events) and events[i + len(run)][0] == run[0][0]):
            run.append(events[i + len(run)])
        i += len(run)
        obj = json.loads(run[0][4])
        data = obj["data"]
        data["event_id"] = f"{obj['id']}-0"
        data["more"] = [{"event_id": f"{obj['id']}-{k}", "ts": e[1], "seq": e[2], "part": 0,
                         "last_part": True, "position": data["position"],
                         "rows": json.loads(e[4])["data"]["rows"]} for k, e in enumerate(run[1:], 1)]
        obj["version"] = 4
        body = json.dumps(obj).encode()
        out.append((run[0][0], run[0][1], run[0][2], 0, body, list(range(len(run)))))
    return out


def test_a_message_of_several_parts_collapses_as_its_parts_apart() -> None:
    rnd = random.Random(11)
    events = _random_events(rnd, "s1", 80) + _random_events(rnd, "s2", 80)
    messages = _as_messages(rnd, events)
    assert any(len(m[5]) > 1 for m in messages) and len(messages) < len(events)
    span_targets: dict[str, tuple[int, tuple[str, ...], tuple[str, str] | None]] = {
        "s1": (0, ("id", "k"), None), "s2": (0, ("id", "k"), None)}
    for plan in (ApplyPlan(span_targets=span_targets, plans=[]),
                 ApplyPlan(span_targets=span_targets, plans=[], skips={"s1": {'[3,"a"]': 10**9}}),
                 ApplyPlan(span_targets={"s1": (0, ("_o", "id", "k"), ("_o", "x")),
                                         "s2": (0, ("id", "k"), None)}, plans=[])):
        apart = sorted(explode_collapse(plan, events), key=repr)
        assert sorted(explode_collapse(plan, messages), key=repr) == apart
        assert sorted(collapse(explode_events(plan, messages, buckets=False)), key=repr) == apart
    # Only later parts of each message (as after a checkpoint inside it): the same as those alone.
    tails = [(m[0], m[1], m[2], m[3], m[4], m[5][1:]) for m in messages if len(m[5]) > 1]
    tail_places = {(m[0], part["seq"]) for m in tails for part in json.loads(m[4])["data"]["more"]}
    alone = [e for e in events if (e[0], e[2]) in tail_places]
    assert len(alone) == sum(len(m[5]) for m in tails)
    plan = ApplyPlan(span_targets=span_targets, plans=[])
    assert sorted(explode_collapse(plan, tails), key=repr) == sorted(explode_collapse(plan, alone), key=repr)


def test_row_literal_equals_pymysql_interpolation() -> None:
    conn = pymysql.connections.Connection(defer_connect=True, charset="utf8mb4", binary_prefix=True)
    conn.server_status = 0  # backslash escapes on, as the sink's session has them
    values: list[Any] = [
        1, -5, 2**64 - 1, True, False, 1.5, 1e300, -0.0, "a'b\\c\n\r\x00\x1a\"é😀", b"\x00'\\\xff",
        bytearray(b"ab"), None, Decimal("12.30"), Decimal("-1E+5"), date(2024, 1, 2),
        datetime(2024, 1, 2, 3, 4, 5), datetime(2024, 1, 2, 3, 4, 5, 6), timedelta(hours=-1, seconds=3),
        "-01:00:00.5", "x\udcff"]
    render = _row_literal(conn)
    cur = conn.cursor()
    for value in values:
        assert render([value]) == "(" + cur.mogrify("%s", (value,)) + ")", value
    assert render(values) == "(" + cur.mogrify(",".join(["%s"] * len(values)), values) + ")"


def test_key_order_sorts_as_sort_key() -> None:
    def changes(keys: list[tuple[Any, ...]]) -> list[Delete | Upsert]:
        return [Delete(key=k) if i % 2 else Upsert(key=k, row={}) for i, k in enumerate(keys)]

    cases: list[list[tuple[Any, ...]]] = [
        [(3, "b"), (1, "z"), (3, "a"), (2, "c")],  # one type per column: the plain key
        [(3,), (None,), (1,)],  # a NULL sorts first
        [(2,), (1.5,), (1,)],  # mixed types: by type name first
        [],
    ]
    for keys in cases:
        items = changes(keys)
        assert [c.key for c in sorted(items, key=_key_order(keys))] == \
            [c.key for c in sorted(items, key=lambda c: sort_key(c.key))]


def test_row_decoder_native_values_equal_decode_value() -> None:
    columns = [ColumnV1(name=n, kind=k, sql_type=t) for n, k, t in [  # type: ignore[arg-type]
        ("i", "int", "int"), ("b", "bit", "bit(3)"), ("s", "string", "varchar(9)"), ("e", "set", "set('a')"),
        ("j", "json", "json"), ("d", "decimal", "decimal(5,2)"), ("t", "datetime", "datetime(6)")]]
    decoder = RowDecoder(TableMetaV1(columns=columns, primary_key=["i"]))
    images: list[dict[str, Any]] = [
        {"i": 3, "b": 5, "s": "x", "e": "a", "j": '{"a":1}', "d": "1.50", "t": "2024-01-02T03:04:05.000006"},
        {"i": True, "b": "6", "s": 7, "j": {"a": [1]}, "d": 2.5, "t": None},
        {"i": None},
    ]
    for image in images:
        decoded = decoder(image)
        assert decoded == {c.name: decode_value(c.kind, c.sql_type, image[c.name])
                           for c in columns if c.name in image}
        assert all(type(decoded[k]) is type(decode_value(c.kind, c.sql_type, image[k]))
                   for c in columns for k in [c.name] if k in image)
        assert list(decoded) == [c.name for c in columns if c.name in image]
