"""What the table shape costs per ``rows.changed`` message: its bytes, and the sink's one-pass
decode (``pull._rows_fast``) of a one-row sysbench update with and without the shape, same run,
best of 15 rounds of 3,000 decodes each (the machine is shared: the best round is the one
least disturbed).

Run: ``.venv/bin/python -m benchmarks.bench_shape_decode``
"""

from __future__ import annotations

import os
import time

from contracts.events.rows import (
    ColumnShapeV1,
    ColumnV1,
    IndexPartV1,
    IndexV1,
    RowImageV2,
    RowsChangedV4,
    SourcePositionV1,
    TableMetaV1,
    TableMetaV2,
    TableShapeV1,
)
from services.capture.rows_encode import encode_rows
from services.sink_worker.round.pull import _rows_fast

COLUMNS = [ColumnV1(name="id", kind="int", sql_type="int(11)", nullable=False),
           ColumnV1(name="k", kind="int", sql_type="int(11)", nullable=False),
           ColumnV1(name="c", kind="string", sql_type="char(120)", nullable=False),
           ColumnV1(name="pad", kind="string", sql_type="char(60)", nullable=False)]
SHAPE = TableShapeV1(
    columns=[ColumnShapeV1(name="id", auto_increment=True), ColumnShapeV1(name="k", default="0"),
             *(ColumnShapeV1(name=n, default="", charset="utf8mb4", collation="utf8mb4_general_ci")
               for n in ("c", "pad"))],
    indexes=[IndexV1(name="k_1", parts=[IndexPartV1(column="k")])],
    charset="utf8mb4", collation="utf8mb4_general_ci")


def _message(meta: TableMetaV1) -> bytes:
    image = {"id": 1, "k": 2, "c": "x" * 120, "pad": "y" * 60}
    event = RowsChangedV4.model_construct(
        source="s", database="sb", table="sbtest1", ts=1 << 40, seq=1, part=0, last_part=True,
        position=SourcePositionV1(binlog_file="b.000001", binlog_pos=4), meta=meta,
        rows=[RowImageV2.model_construct(op="update", before=image, after={**image, "k": 3}, ordinal=0)])
    return encode_rows(event, producer="capture/s", epoch=0, event_id="e")


def main() -> None:
    messages = {"without shape": _message(TableMetaV1(columns=COLUMNS, primary_key=["id"])),
                "with shape": _message(TableMetaV2(columns=COLUMNS, primary_key=["id"], shape=SHAPE))}
    best = dict.fromkeys(messages, float("inf"))
    load = os.getloadavg()
    for _ in range(15):
        for name, raw in messages.items():
            start = time.perf_counter()
            for _ in range(3000):
                _rows_fast(raw)
            best[name] = min(best[name], (time.perf_counter() - start) / 3000 * 1e6)
    print(f"load average at start {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    for name, raw in messages.items():
        print(f"{name}: {len(raw)} bytes, sink decode {best[name]:.1f} us (best of 15)")


if __name__ == "__main__":
    main()
