"""Database URLs: one parser for every place that talks to MySQL/MariaDB, PostgreSQL or SQLite."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from libs.secret_refs import SecretError, resolve_password

Dialect = Literal["mysql", "postgresql", "sqlite"]

_SCHEMES: dict[str, Dialect] = {
    "mysql": "mysql",
    "mariadb": "mysql",
    "mysql+pymysql": "mysql",
    "postgres": "postgresql",
    "postgresql": "postgresql",
    "postgresql+psycopg": "postgresql",
    "sqlite": "sqlite",
}

_DEFAULT_PORTS: dict[Dialect, int] = {"mysql": 3306, "postgresql": 5432, "sqlite": 0}


class DatabaseUrlError(ValueError):
    """A database URL that cannot be used, with the reason."""


@dataclass(frozen=True)
class DatabaseUrl:
    dialect: Dialect
    host: str = ""
    port: int = 0
    user: str = ""
    password: str = ""
    database: str = ""
    path: str = ""
    options: tuple[tuple[str, str], ...] = ()

    def redacted(self) -> str:
        """The URL without its password, safe for logs."""
        if self.dialect == "sqlite":
            return f"sqlite:///{self.path}"
        auth = f"{self.user}:***@" if self.password else (f"{self.user}@" if self.user else "")
        return f"{self.dialect}://{auth}{self.host}:{self.port}/{self.database}"

    def option(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.options:
            if key == name:
                return value
        return default


def parse_database_url(url: str, *, resolve_secrets: bool = True) -> DatabaseUrl:
    """Parse ``url`` with SQLAlchemy's ``make_url``; a ``secret:NAME`` password is resolved
    (libs.secret_refs) unless ``resolve_secrets`` is false (checking a spec's shape without its
    secrets), and only when the secret is bound to the URL's host and port (DatabaseUrlError
    naming the binding otherwise: no caller gets the password for another host).
    Kept here because make_url does not: map scheme aliases to a dialect, fill default ports,
    refuse a port out of range, or resolve secret references."""
    scheme = urlsplit(url).scheme
    dialect = _SCHEMES.get(scheme.lower())
    if dialect is None:
        raise DatabaseUrlError(
            f"unsupported database URL scheme {scheme!r}; use one of {sorted(_SCHEMES)}"
        )
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise DatabaseUrlError(f"bad database URL: {exc}") from None
    # Blank values are left out and a repeated option's last value wins, as parse_qs did.
    options = tuple((k, v[-1] if isinstance(v, tuple) else v)
                    for k, v in parsed.query.items() if (v[-1] if isinstance(v, tuple) else v))
    if dialect == "sqlite":
        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        if not parsed.database:
            raise DatabaseUrlError("sqlite URL needs a file path, e.g. sqlite:///data/sluice.db")
        return DatabaseUrl(dialect="sqlite", path=str(Path(parsed.database)), options=options)
    port = parsed.port or _DEFAULT_PORTS[dialect]
    if not 0 <= port <= 65535:
        raise DatabaseUrlError("bad port in database URL: Port out of range 0-65535")
    host = (parsed.host or "127.0.0.1").lower()
    return DatabaseUrl(
        dialect=dialect,
        host=host,
        port=port,
        user=parsed.username or "",
        password=_password(parsed.password or "", (host, port) if resolve_secrets else None),
        database=parsed.database or "",
        options=options,
    )


def _password(given: str, destination: tuple[str, int] | None) -> str:
    if destination is None:
        return given
    try:
        return resolve_password(given, [destination])
    except SecretError as exc:
        raise DatabaseUrlError(str(exc)) from None
