"""Human output: tables, and checkpoints as UTC times with how far they are behind; ``--json``
bypasses all of this (and is the only place raw ts values appear)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from libs.progress_text import rows_progress


def make_console() -> Console:
    return Console(highlight=False, soft_wrap=True)


console = make_console()


def as_json(value: Any) -> None:
    console.out(json.dumps(value, indent=2, sort_keys=True), highlight=False)


def checkpoint(item: dict[str, Any], field: str = "checkpoint_time") -> str:
    """The api's ``2026-11-23 22:31:07.120 UTC, 0.8 s behind``, or why there is none."""
    return str(item.get(field) or "none yet")


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
          out: Console | None = None) -> None:
    """A table that never cuts a value. Into a pipe or a file it is as wide as its widest values
    (``grep`` and ``awk`` see each whole); on a terminal its cells wrap, and when even wrapped
    columns do not fit (headers keep their words), each row is printed as ``column  value``
    lines instead."""
    target = out or console
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
    if not cells:
        target.print(f"{title}: none")
        return
    t = Table(title=title, title_justify="left", show_lines=False)
    for col in columns:
        t.add_column(col, overflow="fold", min_width=max((cell_len(w) for w in col.split()), default=1))
    for row in cells:
        t.add_row(*row)
    # A cell takes its text plus one space each side plus one border; one more border closes a row.
    widest = [max([cell_len(col), *(cell_len(row[i]) for row in cells)]) for i, col in enumerate(columns)]
    narrowest = [max((cell_len(w) for w in col.split()), default=1) for col in columns]
    if not target.is_terminal:
        wide = Console(file=target.file, width=max(target.width, sum(widest) + 3 * len(columns) + 1),
                       highlight=False, soft_wrap=True, color_system=None)
        wide.print(t)
    elif sum(narrowest) + 3 * len(columns) + 1 <= target.width:
        target.print(t)
    else:
        name_width = max(len(c) for c in columns)
        for i, row in enumerate(cells, 1):
            target.print(f"{title} {i}/{len(cells)}", style="bold")
            for col, value in zip(columns, row, strict=True):
                target.print(f"  {col:<{name_width}}  {value}", overflow="fold")


def _state(c: dict[str, Any]) -> str:
    """The state, with the creation checks it was accepted despite (skip_checks)."""
    failed = c.get("failed_checks") or []
    if not failed:
        return str(c["state"])
    return f"{c['state']} (failed checks: {', '.join(f['check'] for f in failed)})"


def changefeeds(items: list[dict[str, Any]]) -> None:
    table("changefeeds", ["id", "state", "checkpoint", "tables", "by state"],
          ([c["id"], _state(c), checkpoint(c), c["tables"],
            " ".join(f"{k}={v}" for k, v in c.get("tables_by_state", {}).items())] for c in items))
    stopped = [(c["id"], s) for c in items for s in c.get("stopped_tables") or []]
    if stopped:
        table("stopped tables (not covered by their changefeed's checkpoint)",
              ["changefeed", "source", "database", "table", "stopped at", "incident", "reason"],
              ([cf, s["source"], s["database"], s["table"], s.get("checkpoint_time"), s["incident"],
                s["reason"]] for cf, s in stopped))


_EXPRESSIONS = (("ignore_insert_value_expr", "insert"), ("ignore_update_old_value_expr", "update old"),
                ("ignore_update_new_value_expr", "update new"), ("ignore_delete_value_expr", "delete"))


def table_rules(items: list[dict[str, Any]]) -> None:
    def ignored_rows(r: dict[str, Any]) -> str | None:
        found = [f"{label}: {r[field]}" for field, label in _EXPRESSIONS if r.get(field)]
        return "; ".join(found) or None

    def columns(r: dict[str, Any]) -> str | None:
        parts = []
        if r.get("keep_columns") is not None:
            parts.append("keep " + ", ".join(r["keep_columns"]))
        if r.get("drop_columns"):
            parts.append("drop " + ", ".join(r["drop_columns"]))
        parts += [f"{c['name']} = {c['expr']} ({c.get('type', 'string')})" for c in r.get("computed") or []]
        return "; ".join(parts) or None

    table("table rules", ["tables", "ignored events", "ignored rows", "columns"],
          ([", ".join(r["tables"]), ", ".join(r.get("ignore_events") or []) or None, ignored_rows(r),
            columns(r)] for r in items))


_SCHEMA_CHANGES = {
    "evolve": "DDL is applied downstream",
    "lenient": "DDL is applied without removing anything (dropped/renamed columns kept, nullable; "
               "no TRUNCATE or DROP TABLE)",
    "ignore": "no DDL reaches the downstream; rows keep to the target's columns",
    "stop": "a DDL stops its table with an incident until resumed",
}


def changefeed(item: dict[str, Any]) -> None:
    changefeeds([item])
    policy = (item.get("spec") or {}).get("schema_change_policy") or "evolve"
    console.print(f"schema changes: {policy} ({_SCHEMA_CHANGES.get(policy, '?')})")
    split = (item.get("spec") or {}).get("large_txn_split_rows")
    console.print("large transactions: " + (f"committed every {split:,} row changes (not atomic downstream)"
                                            if split else "one downstream transaction each"))
    for check in item.get("failed_checks") or []:
        console.print(f"failed check {check.get('check')} on {check.get('target')}: {check.get('message')}")
    console.print("spec (passwords redacted):")
    as_json(item.get("spec"))


def syncpoint(item: dict[str, Any]) -> None:
    if item.get("syncpoint_interval") is None:
        console.print(f"changefeed {item.get('changefeed')}: syncpoints off (no syncpoint_interval)")
    pending = None
    if item.get("cap_ts"):
        pending = f"{item['cap_ts']} ({item.get('cap_time')}), " + ("holding" if item.get("holding")
                                                                     else "waiting for the tables")
    table("syncpoint", ["last ts", "upstream time", "written downstream", "pending", "released",
                        "abandoned", "last abandoned because"],
          [[item.get("last_ts"), item.get("last_time"), item.get("last_commit_time"), pending,
            item.get("released"), item.get("abandoned"), item.get("last_abandoned") or None]])


def members(items: list[dict[str, Any]]) -> None:
    table("members", ["member", "draining", "tables", "primary", "secondary", "address"],
          ([m["member_id"], "yes" if m["draining"] else "no", m["tables"], m["primary"],
            m["secondary"], m.get("address") or None] for m in items))


def ddl_locks(items: list[dict[str, Any]]) -> None:
    table("DDL locks", ["changefeed", "target", "state", "owner", "shards", "conflict/error"],
          ([lk.get("changefeed"), lk.get("target"), lk.get("state"), lk.get("owner"),
            len(lk.get("shards") or []), lk.get("conflict") or lk.get("error")] for lk in items))


def duration(seconds: float | None) -> str | None:
    """``1h02m``, ``3m05s``, ``12s``; None when unknown."""
    if seconds is None or seconds < 0:
        return None
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def speed(snap: dict[str, Any]) -> str:
    """`` at 12,345 rows/s, ETA 3m05s`` of an initial load's progress ('' before a speed is known)."""
    rate = snap.get("rows_per_s") or 0
    if not rate:
        return ""
    eta = duration(snap.get("eta_s")) if snap.get("state") != "done" else None
    return f" at {rate:,.0f} rows/s" + (f", ETA {eta}" if eta else "")


def tables(items: list[dict[str, Any]]) -> None:
    def progress(t: dict[str, Any]) -> str | None:
        snap = t.get("snapshot")
        if not snap:
            return None
        done, est = int(snap.get("rows_copied") or 0), int(snap.get("rows_estimate") or 0)
        return f"{snap.get('state', '?')} {rows_progress(done, est)}" + speed(snap)

    def incident(t: dict[str, Any]) -> str | None:
        stopped = t.get("incident")
        if not stopped:
            return None
        if stopped.get("kind") == "unreplicable":
            return f"{stopped['incident']}: cannot be replicated: {stopped['error']}"
        return (f"{stopped['incident']}: {stopped['statement']} of key {stopped.get('key')} refused: "
                f"{stopped['error']}")

    table("tables", ["source", "database", "table", "state", "primary", "secondary", "checkpoint",
                     "snapshot", "waiting for", "incident"],
          ([t["source"], t["database"], t["table"], t["state"], t.get("primary"), t.get("secondary"),
            checkpoint(t), progress(t), t.get("waiting_for"), incident(t)] for t in items))
