"""Large values stay out of the JVM: a round's side store of the values above a size.

The sort and apply jobs only need a row change's key, its order and, at the very end, its
final image. A multi-MB value (LONGBLOB, LONGTEXT, JSON) carried through them would cross the
JVM several times (Arrow, the broadcast join, the pickled records of the collapse) and make the
driver's heap, not the data, decide how large a row may be. So before the round's DataFrame is
made, every value of a rows event whose contract encoding is longer than the threshold is
replaced by a small reference, and the jobs run on the small rows:

- ``LargeValues.strip`` gives an event's body with references (the event's own decoded values
  stay where they are, in the driver's pulled event: the store holds a reference to them, not
  a copy);
- a partition of the write (on an executor) does not write an upsert whose image holds a
  reference: it hands the small image back (``apply_job.write_partition``);
- the driver writes those upserts after the partitions, one row per statement, each with its
  real values put back by ``LargeValues.resolve`` just before it is decoded and written, so a
  worker holds one decoded large row at a time beyond what it pulled.

Keys are never large: a key value above the threshold is refused (``LargeKeyError``), the
table stops with an incident that says so, and nothing of it is written.

A reference is a one-member JSON object whose member name carries the round's random token,
so no value a source can hold is taken for one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from contracts import REGISTRY
from contracts.events.rows import RowsChangedV2

if TYPE_CHECKING:
    from services.sink_worker.round.pull import PulledEvent

REF_FIELD = "$sluice.large_value"


class LargeKeyError(ValueError):
    """A key column's value is larger than the large-value threshold."""

    def __init__(self, column: str, size: int, threshold: int) -> None:
        super().__init__(
            f"key column {column!r} holds a value of {size} bytes (contract encoding), above "
            f"SLUICE_SINK_LARGE_VALUE_BYTES ({threshold}): a key must be small; give the table a "
            "primary key of small columns (or choose such a key in the changefeed's key policy)")
        self.column = column
        self.size = size


def _size(value: Any) -> int:
    # Large values are text in the contract (base64 for binary, the document for JSON, the
    # text itself): the length is the size. Numbers, temporals and None are never large.
    return len(value) if isinstance(value, str | bytes) else 0


@dataclass
class LargeValues:
    """One round's large values, by reference id (see the module docstring)."""

    threshold: int
    token: str = field(default_factory=lambda: uuid4().hex)
    values: dict[str, Any] = field(default_factory=dict)
    bytes_held: int = 0

    def __len__(self) -> int:
        return len(self.values)

    def _ref(self, value: Any) -> dict[str, str]:
        ref = f"{self.token}:{len(self.values)}"
        self.values[ref] = value
        self.bytes_held += _size(value)
        return {REF_FIELD: ref}

    def _strip_image(self, image: Mapping[str, Any] | None, key: Iterable[str]) -> dict[str, Any] | None:
        if image is None:
            return None
        out = dict(image)
        keys = set(key)
        for column, value in image.items():
            size = _size(value)
            if size > self.threshold:
                if column in keys:
                    raise LargeKeyError(column, size, self.threshold)
                out[column] = self._ref(value)
        return out

    def needs_strip(self, event: PulledEvent) -> bool:
        """Whether ``event``'s body may hold a large value (only then is it looked into)."""
        return (not event.dead and isinstance(event.event, RowsChangedV2)
                and len(event.data) > self.threshold)

    def strip(self, event: PulledEvent, key: Iterable[str]) -> bytes:
        """``event``'s body with each value above the threshold as a reference.

        The body is the ``rows.changed`` envelope in its newest version (the pulled event is
        decoded to it), holding what ``apply_job.event_rows`` reads: type, version, id and the
        rows; the body itself when no value is large. Raises ``LargeKeyError`` for a large
        value in a ``key`` column."""
        assert isinstance(event.event, RowsChangedV2)
        key = tuple(key)
        type_, version = REGISTRY.key_of(type(event.event))
        held = len(self.values)
        rows = [{"op": row.op, "before": self._strip_image(row.before, key),
                 "after": self._strip_image(row.after, key), "ordinal": row.ordinal}
                for row in event.event.rows]
        if len(self.values) == held:
            return event.data  # many small values: the body as it is
        return json.dumps({"type": type_, "version": version, "id": event.event_id,
                           "data": {"rows": rows}}, separators=(",", ":")).encode()

    def is_ref(self, value: Any) -> bool:
        return type(value) is dict and len(value) == 1 and value.get(REF_FIELD, "").startswith(
            self.token + ":")

    def resolve(self, image: Mapping[str, Any]) -> dict[str, Any]:
        """``image`` with its references replaced by the values they stand for."""
        return {c: self.values[v[REF_FIELD]] if self.is_ref(v) else v for c, v in image.items()}


def holds_ref(image: Mapping[str, Any]) -> bool:
    """Whether a final image (as the apply job carries it) holds a large-value reference: any
    one-member object named ``REF_FIELD`` (an executor does not know the round's token; the
    driver checks it when it resolves)."""
    return any(type(v) is dict and len(v) == 1 and REF_FIELD in v for v in image.values())
