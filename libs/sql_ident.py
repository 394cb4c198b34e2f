"""Quoting SQL identifiers: the one helper every module that writes a table or column name into a
statement uses (sinks, the initial load's source reads, DDL re-runs, validation, foreign keys).

Names are always quoted, never checked against a keyword list, so any name the source allows
round-trips; what no target can hold faithfully is refused up front instead of being truncated.
"""

from __future__ import annotations

# Longest identifier each dialect keeps: PostgreSQL silently truncates past 63 bytes, which
# would make reconcile_schema add the "missing" column forever; MySQL rejects past 64 chars.
_MAX_IDENT = {"postgresql": 63, "mysql": 64, "sqlite": 1_000_000}


class IdentifierError(ValueError):
    """A table or column name no target can represent faithfully."""


def quote_ident(dialect: str, name: str, *, for_params: bool = False) -> str:
    """Quote one identifier for ``dialect`` (``mysql``, ``postgresql``, ``sqlite``); ``for_params``
    doubles ``%`` for %s-style drivers."""
    if not name:
        raise IdentifierError("empty identifier")
    if "\x00" in name:
        raise IdentifierError(f"identifier with a NUL character: {name!r}")
    size = len(name.encode()) if dialect == "postgresql" else len(name)
    if size > _MAX_IDENT[dialect]:
        raise IdentifierError(f"identifier longer than {dialect} allows ({_MAX_IDENT[dialect]}): {name!r}")
    if dialect == "mysql":
        quoted = "`" + name.replace("`", "``") + "`"
    else:
        quoted = '"' + name.replace('"', '""') + '"'
    if for_params and dialect in ("mysql", "postgresql"):
        quoted = quoted.replace("%", "%%")
    return quoted


def mysql_ident(name: str) -> str:
    """A MySQL/MariaDB identifier (a source's database, table or column), quoted; a one-argument
    callable for the key-range builders that take a quoting function."""
    return quote_ident("mysql", name)
