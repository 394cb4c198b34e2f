"""Database URLs: one parser for every place that talks to MySQL/MariaDB, PostgreSQL or SQLite."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

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
    """Parse ``url``; a ``secret:NAME`` password is resolved (libs.secret_refs) unless
    ``resolve_secrets`` is false (checking a spec's shape without its secrets)."""
    parts = urlsplit(url)
    dialect = _SCHEMES.get(parts.scheme.lower())
    if dialect is None:
        raise DatabaseUrlError(
            f"unsupported database URL scheme {parts.scheme!r}; use one of {sorted(_SCHEMES)}"
        )
    options = tuple((k, v[-1]) for k, v in parse_qs(parts.query).items())
    if dialect == "sqlite":
        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        raw = url.split("://", 1)[1].split("?", 1)[0]
        path = raw[1:] if raw.startswith("/") else raw
        if not path:
            raise DatabaseUrlError("sqlite URL needs a file path, e.g. sqlite:///data/sluice.db")
        return DatabaseUrl(dialect="sqlite", path=str(Path(path)), options=options)
    try:
        port = parts.port or _DEFAULT_PORTS[dialect]
    except ValueError as exc:
        raise DatabaseUrlError(f"bad port in database URL: {exc}") from exc
    return DatabaseUrl(
        dialect=dialect,
        host=parts.hostname or "127.0.0.1",
        port=port,
        user=unquote(parts.username or ""),
        password=_password(unquote(parts.password or ""), resolve_secrets),
        database=parts.path.lstrip("/"),
        options=options,
    )


def _password(given: str, resolve: bool) -> str:
    if not resolve:
        return given
    try:
        return resolve_password(given)
    except SecretError as exc:
        raise DatabaseUrlError(str(exc)) from None
