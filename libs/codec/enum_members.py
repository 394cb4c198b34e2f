"""ENUM/SET member names the source's catalog cannot spell, read back from the table's rows.

MariaDB and MySQL spell member names in utf8mb3 in information_schema and SHOW CREATE TABLE, so a
4-byte character ('😀') reads '?' there, while the table stores and returns the real value. A
target created from that catalog text refuses the real values (MariaDB: 1265 "Data truncated").
Capture repairs the names from the binlog's table map (``table_meta.reconcile_members``); an
initial load reads the catalog before any row of the table need have passed through the binlog,
so it asks the rows instead: ``SELECT DISTINCT col + 0, col`` gives each member present in the
table with its index (ENUM) or bit (SET), losslessly in utf8mb4.

A member that may be lossy (its catalog spelling holds '?') and that no row holds cannot be
known from the source at all. Its column then becomes a ``varchar`` wide enough for every
member (or every combination of a SET) instead of an ENUM/SET that would refuse that member's
value: the values stay exact, only the downstream type is wider.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from libs.codec.decode import SqlTypeError, parse_sql_type
from libs.codec.table_meta import ColumnSpec, TableInfo

# (number, text) of each distinct non-NULL value of a column: ``col + 0`` and ``col``.
PresentValues = Callable[[str], Iterable[tuple[int, str]]]


def _members(spec: ColumnSpec) -> tuple[str, list[str]] | None:
    if spec.kind not in ("string", "set"):
        return None
    try:
        parsed = parse_sql_type(spec.sql_type)
    except SqlTypeError:
        return None
    if parsed.base not in ("enum", "set"):
        return None
    return parsed.base, [str(a) for a in parsed.args]


def suspect_columns(info: TableInfo) -> list[str]:
    """ENUM/SET columns with a member whose catalog spelling may have lost characters."""
    out = []
    for spec in info.columns:
        found = _members(spec)
        if found is not None and any("?" in m for m in found[1]):
            out.append(spec.name)
    return out


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _learn(base: str, members: list[str], values: Iterable[tuple[int, str]]) -> dict[int, str]:
    """Index (0-based) -> real name, from the values present."""
    known: dict[int, str] = {}
    for number, text in values:
        if base == "enum":
            if 1 <= number <= len(members):
                known[number - 1] = text
            continue
        # A SET value lists its members in bit order, comma separated (names hold no comma).
        bits = [i for i in range(len(members)) if number >> i & 1]
        names = text.split(",") if text else []
        if len(bits) == len(names):
            known.update(zip(bits, names, strict=True))
    return known


def _could_be(catalog: str, real: str) -> bool:
    """``catalog`` is ``real`` with each character outside utf8mb3 spelled '?'."""
    return len(catalog) == len(real) and all(
        c == r or (c == "?" and ord(r) > 0xFFFF) for c, r in zip(catalog, real, strict=True))


def resolve_members(info: TableInfo, present: PresentValues) -> TableInfo:
    """``info`` with the suspect ENUM/SET columns' members read from the rows (``present``)
    and, where a suspect member holds in no row, the column widened to a ``varchar``."""
    specs: list[ColumnSpec] = []
    changed = False
    for spec in info.columns:
        found = _members(spec)
        if found is None or not any("?" in m for m in found[1]):
            specs.append(spec)
            continue
        base, members = found
        known = _learn(base, members, present(spec.name))
        real = [known.get(i, m) for i, m in enumerate(members)]
        if not all(_could_be(m, r) for m, r in zip(members, real, strict=True)):
            # The rows disagree with the catalog (e.g. the table changed since it was read):
            # keep nothing of them; the widened type takes every value.
            known, real = {}, list(members)
        unknown = [i for i, m in enumerate(members) if "?" in m and i not in known]
        if not unknown:
            body = ",".join(_quote(m) for m in real)
            specs.append(replace(spec, sql_type=f"{base}({body})"))
        else:
            width = max((len(m) for m in members), default=1) if base == "enum" else \
                max(1, sum(len(m) for m in members) + len(members) - 1)
            specs.append(replace(spec, sql_type=f"varchar({width})"))
        changed = True
    return replace(info, columns=tuple(specs), _meta=None) if changed else info
