"""Cross-shard unique conflicts in a merged target without an origin column.

The apply's conflict delete (``SqlSink._apply`` step 3) removes a row that holds an upserted
row's unique value under another key. Within one upstream table that is always right (the TDSQL
"lucy" reorder): the source enforces the unique key, so the row that held the value released it
earlier, and since a batch ends at a consistent point, the holder's own change is *in the same
batch* (an earlier batch would have been applied and committed already, so the holder would no
longer hold the value downstream).

Shards do not enforce uniqueness across each other. So a conflict delete is the lucy case only
when the removed row's key has its final image in this batch from the *same* span as the upserted
row, or is deleted in this batch. Any other holder was written by another shard: in this batch by
another span, or in an earlier batch (the sink cannot tell which shard then: the report says so).
The changefeed's ``on_unique_conflict`` says what happens: ``error`` refuses the change (the
target's spans stop with the report, as any refused change does), ``overwrite`` removes the
other shard's row as before and reports each removed row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

UniqueConflictPolicy = Literal["error", "overwrite"]

DELETED = -1
"""Owner of a key whose final image in the batch is a delete: whoever holds its values may go."""

ORIGIN_ADVICE = ("set the changefeed's origin_column so each shard's rows are told apart and "
                 "unique keys include it")


@dataclass(frozen=True)
class ConflictGuard:
    """What one partition's write needs to tell a lucy reorder from a cross-shard conflict."""

    policy: UniqueConflictPolicy
    owners: Mapping[tuple[Any, ...], int]
    """Decoded key -> index of the span whose change is the key's final image in this batch
    (``DELETED`` for a delete); keys not in the batch are absent."""
    shard_names: Sequence[str]
    """Span index -> span name (``cf/source/db.table``)."""
    target: str

    def removable(self, upserted_by: int, holder_key: tuple[Any, ...]) -> bool:
        owner = self.owners.get(holder_key)
        return owner is not None and (owner == DELETED or owner == upserted_by)

    def shard_name(self, index: int | None) -> str:
        if index is None or index < 0 or index >= len(self.shard_names):
            return "another shard (written before this batch)"
        return self.shard_names[index]


@dataclass(frozen=True)
class UniqueConflict:
    """One row another shard holds a unique value of (the report the operator sees)."""

    target: str
    unique_key: tuple[str, ...]
    value: tuple[Any, ...]
    shard: str
    key: tuple[Any, ...]
    other_shard: str
    other_key: tuple[Any, ...]
    action: Literal["refused", "overwritten"] = "refused"
    advice: str = field(default=ORIGIN_ADVICE)

    def describe(self) -> str:
        cols = ", ".join(self.unique_key)
        verb = "refused" if self.action == "refused" else "removed the other row"
        return (f"cross-shard unique conflict on {self.target} unique ({cols}) = {list(self.value)!r}: "
                f"{self.shard} key {list(self.key)!r} vs {self.other_shard} key {list(self.other_key)!r} "
                f"({verb}; {self.advice})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, separators=(",", ":"))


class UniqueConflictError(Exception):
    """A change refused because its unique value is held by another shard's row (policy error)."""

    def __init__(self, conflict: UniqueConflict) -> None:
        super().__init__(conflict.describe())
        self.conflict = conflict
