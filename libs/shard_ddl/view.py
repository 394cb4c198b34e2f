"""How an operator sees a lock (the ddl-lock command interface's ``LockView``), and the span
names operators use. Plain functions over ``libs.shard_ddl.lock``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from libs.routing import TableRef, Target
from libs.shard_ddl.lock import Lock

__all__ = ["lock_view", "parse_span", "parse_target", "span_name"]


def span_name(changefeed: str, ref: TableRef) -> str:
    """The sink-worker's span name: ``changefeed/source/database.table``."""
    return f"{changefeed}/{ref.source}/{ref.schema}.{ref.table}"


def parse_span(changefeed: str, text: str) -> TableRef:
    """A shard from ``changefeed/source/db.table``, ``source/db.table`` or ``source:db.table``."""
    body = text.strip()
    if body.startswith(f"{changefeed}/"):
        body = body[len(changefeed) + 1:]
    sep = "/" if "/" in body else ":"
    source, _, rest = body.partition(sep)
    schema, dot, table = rest.partition(".")
    if not source or not dot or not schema or not table or "/" in rest:
        raise ValueError(f"{text!r} is not a span name (changefeed/source/database.table)")
    return TableRef(source, schema, table)


def parse_target(text: str) -> Target:
    schema, dot, table = text.strip().partition(".")
    if not dot or not schema or not table:
        raise ValueError(f"{text!r} is not a target (database.table)")
    return Target(schema, table)


def _iso(at: float | None) -> str | None:
    return datetime.fromtimestamp(at, UTC).isoformat() if at is not None else None


def _shard_state(lock: Lock, ref: TableRef) -> str:
    if ref in lock.left:
        return "left"
    if ref in lock.done:
        return "done"
    op = lock.ops.get(ref)
    if op is not None:
        return f"{op.kind}_sent"
    if ref in lock.infos:
        return "blocked"
    return "waiting_info"


def lock_view(lock: Lock) -> dict[str, Any]:
    cf = lock.changefeed
    refs = sorted(lock.expected | set(lock.infos) | set(lock.left))
    shards = []
    for ref in refs:
        info = lock.infos.get(ref) or lock.left_infos.get(ref)
        entry: dict[str, Any] = {"span": span_name(cf, ref), "state": _shard_state(lock, ref),
                                 "ddls": list(info.ddls) if info is not None else [],
                                 "position": info.position if info is not None else None}
        if ref in lock.left:
            entry["left_reason"] = lock.left[ref]
        shards.append(entry)
    conflict: dict[str, Any] | None = None
    if lock.in_conflict:
        statements = [list(lock.ddls)]
        for ddls in lock.conflict.values():
            if list(ddls) not in statements:
                statements.append(list(ddls))
        if lock.settled_conflict and lock.settled_before is not None:
            statements.append(list(lock.settled_before))
        conflict = {"statements": statements,
                    "shards": {span_name(cf, r): list(d) for r, d in sorted(lock.conflict.items())},
                    "hint": "unlock with skip (nothing executed) or exec naming the owner whose DDL "
                            "the target gets; force_remove starts the lock over"}
    return {
        "changefeed": cf, "target": str(lock.target), "instance": lock.instance,
        "generation": lock.generation,
        "state": lock.phase, "owner": span_name(cf, lock.owner) if lock.owner is not None else None,
        "ddls": list(lock.ddls), "shards": shards, "conflict": conflict, "error": lock.exec_error,
        "created_at": _iso(lock.created_at), "mode": lock.mode,
        "unlocks": [{"mode": u.mode, "owner": span_name(cf, u.owner) if u.owner else None, "by": u.by,
                     "reason": u.reason, "at": _iso(u.at)} for u in lock.unlocks],
    }
