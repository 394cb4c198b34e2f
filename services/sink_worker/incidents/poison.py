"""Finding the row a downstream refuses for good (the "poison" row) and describing it.

When a partition's write fails with a permanent error (``sinks.error_class``), the partition is
bisected: each half is written in its own transaction, a half that succeeds stays written
(final images are idempotent and commute, so writing part of a batch early is harmless: the
next attempt writes it again), and the failing half is split again until one change fails on
its own. That change's key and statement, with the database's error, is the table's incident.

This runs on an executor, like the write itself: the driver only gets the description back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from services.sink_worker.sinks.error_class import ErrorClass, error_code

Statement = Literal["upsert", "delete", "batch"]
IncidentAction = Literal["skip", "retry", "resume"]


@dataclass(frozen=True)
class RowFailure:
    """A downstream's permanent refusal of one change (or of a batch no single row reproduces)."""

    statement: Statement
    key: str | None
    """The row's key as the contract's JSON values (``["p1", 2]``); None for ``batch``."""
    key_columns: tuple[str, ...]
    error: str
    code: int | str | None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str) -> RowFailure:
        raw = json.loads(text)
        return cls(statement=raw["statement"], key=raw["key"], key_columns=tuple(raw["key_columns"]),
                   error=raw["error"], code=raw["code"])

    def describe(self) -> str:
        if self.key is None and self.statement != "batch":
            return f"the {self.statement} of a row was refused: {self.error}"
        if self.key is None:
            return f"the downstream refused the batch (no single row reproduces it): {self.error}"
        return f"the downstream refused the {self.statement} of key {self.key}: {self.error}"


def locate_poison(apply: Callable[[Sequence[Any]], object], changes: Sequence[Any],
                  classify: Callable[[BaseException], ErrorClass],
                  first_error: BaseException) -> tuple[int | None, BaseException]:
    """The index of a change that ``apply`` refuses on its own, and its error.

    ``changes`` as a whole failed with ``first_error`` (permanent). A transient error met while
    bisecting is raised: the partition is then retried as a whole, like any transient failure.
    Returns ``(None, first_error)`` when no single change fails alone (e.g. two rows that only
    conflict with each other)."""
    lo, hi = 0, len(changes)
    error = first_error
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            apply(changes[lo:mid])
        except Exception as exc:
            if classify(exc) != "permanent":
                raise
            hi, error = mid, exc
            continue
        lo = mid  # the first half is written; the refusal is in the second
    if hi - lo == 1:
        try:
            apply(changes[lo:hi])
        except Exception as exc:
            if classify(exc) != "permanent":
                raise
            return lo, exc
    return None, error


def describe_error(exc: BaseException) -> tuple[str, int | str | None]:
    """The database's message and code of ``exc`` (one line)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}", error_code(exc)


@dataclass(frozen=True)
class Unreplicable:
    """The table cannot be replicated as the changefeed says (no usable key under its key
    policy, table rules that do not fit, a DDL that leaves it without a key): no row or
    statement is refused, the table as a whole is. Read like a ``RowFailure``."""

    error: str
    statement: None = None
    key: None = None
    key_columns: tuple[str, ...] = ()
    code: None = None

    def describe(self) -> str:
        return f"the table cannot be replicated: {self.error}"


@dataclass(frozen=True)
class TableIncident:
    """A span stopped until an operator acts on it: by a downstream's permanent refusal
    (``RowFailure``) or because it cannot be replicated (``Unreplicable``).

    ``upto_ts`` is the end of the batch the refused change was in: a ``skip`` leaves out that
    key's changes up to it, never a later change of the same row (for ``Unreplicable``: the
    ts the span stopped at)."""

    id: str
    target: str
    """``schema.table`` downstream (without the sink URL, which may hold a password); empty
    when the table has none."""
    failure: RowFailure | Unreplicable
    upto_ts: int

    @property
    def kind(self) -> Literal["refused", "unreplicable"]:
        return "unreplicable" if isinstance(self.failure, Unreplicable) else "refused"

    def status(self) -> dict[str, Any]:
        return {"incident": self.id, "kind": self.kind, "target": self.target,
                "statement": self.failure.statement, "key": self.failure.key,
                "key_columns": list(self.failure.key_columns), "error": self.failure.error,
                "code": self.failure.code, "upto_ts": self.upto_ts}
