"""The table filter through span discovery: the same patterns (globs, ``~regex``) select the
same tables in discovery as in ``routing.TableFilter``, which the api validates a filter with."""

from __future__ import annotations

from uuid import uuid4

import pytest
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from libs.changefeeds import discover_spans
from libs.eventstore import EventStore
from libs.routing import TableFilter
from libs.streams import ROWS_STREAM, ROWS_SUBJECTS, rows_subject

pytestmark = pytest.mark.integration

TABLES = [("shop_1", "orders"), ("shop_2", "orders"), ("shop_10", "orders"), ("shopx", "orders"),
          ("shop_1", "secret"), ("crm", "orders_2024"), ("crm", "orders")]


@pytest.mark.parametrize(("include", "exclude", "expected"), [
    ([r"~shop_\d\.orders"], [], {("shop_1", "orders"), ("shop_2", "orders")}),
    ([r"~shop_\d+\..*"], ["*.secret"], {("shop_1", "orders"), ("shop_2", "orders"),
                                         ("shop_10", "orders")}),
    (["shop*.*"], [r"~shop_1\d*\..*"], {("shop_2", "orders"), ("shopx", "orders")}),
    ([r"~crm\.orders_\d{4}", "crm.orders"], [], {("crm", "orders_2024"), ("crm", "orders")}),
    # A regex matches the whole name, never a part of it.
    ([r"~orders"], [], set()),
    (["*.*"], [r"~.*_\d+\.orders"], {("shopx", "orders"), ("shop_1", "secret"),
                                       ("crm", "orders_2024"), ("crm", "orders")}),
])
async def test_discovery_selects_what_the_filter_selects(
        js: JetStreamContext, include: list[str], exclude: list[str],
        expected: set[tuple[str, str]]) -> None:
    await EventStore(js, ROWS_STREAM, "test").ensure(ROWS_SUBJECTS, allow_rollup_hdrs=True)
    source = f"flt{uuid4().hex[:8]}"
    for database, table in TABLES:
        await js.publish(rows_subject(source, database, table), b"{}", stream=ROWS_STREAM)
    flt = TableFilterV1(include=include, exclude=exclude)
    spec = ChangefeedSpecV2(id="cf1", sources=[SourceRefV1(id=source, url="mysql://u@h:1/")],
                            filter=flt, sink_url="sqlite:///unused.db", initial_load="binlog-only")
    found = await discover_spans(js, [spec])
    selected = {(db, table) for (_cf, _src, db, table) in found.spans}
    assert selected == expected, f"discovery with include={include} exclude={exclude}"
    in_filter = {(db, t) for db, t in TABLES if TableFilter.from_contract(flt).selected(db, t)}
    assert selected == in_filter


async def test_an_unreadable_regex_selects_nothing_and_other_changefeeds_go_on(js: JetStreamContext) -> None:
    await EventStore(js, ROWS_STREAM, "test").ensure(ROWS_SUBJECTS, allow_rollup_hdrs=True)
    source = f"flt{uuid4().hex[:8]}"
    await js.publish(rows_subject(source, "shop", "orders"), b"{}", stream=ROWS_STREAM)
    ref = [SourceRefV1(id=source, url="mysql://u@h:1/")]
    bad = ChangefeedSpecV2(id="bad", sources=ref, filter=TableFilterV1(include=["~shop_("]),
                           sink_url="sqlite:///unused.db", initial_load="binlog-only")
    good = ChangefeedSpecV2(id="good", sources=ref, sink_url="sqlite:///unused.db",
                            initial_load="binlog-only")
    found = await discover_spans(js, [bad, good])
    assert set(found.spans) == {("good", source, "shop", "orders")}
