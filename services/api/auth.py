"""Bearer-token auth with roles: with ``SLUICE_API_AUTH`` on (the default) every /api/v1
endpoint needs a token; a viewer token may read, an operator token may also change things.

Tokens come from ``SLUICE_API_TOKEN`` (an operator called ``operator``), ``SLUICE_API_TOKENS``
(``principal:role:token`` entries, comma separated) and ``SLUICE_API_TOKENS_FILE`` (one entry a
line). With auth on and no token configured the api refuses every request (fail closed). The
principal of the token is who a mutation is recorded as (``requested_by``). Tokens are compared
in constant time and never logged (neither is the Authorization header: the api has no access
log)."""

from __future__ import annotations

import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from libs.config import Settings

Role = Literal["viewer", "operator"]
ROLES: tuple[Role, ...] = ("viewer", "operator")
ANONYMOUS = "anonymous"

bearer = HTTPBearer(auto_error=False, description="A viewer or operator token (SLUICE_API_TOKENS).")
# Set by the auth dependency of each request; read where a command records who asked for it.
current_principal: ContextVar[str] = ContextVar("current_principal", default=ANONYMOUS)

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "No valid bearer token (Authorization: Bearer <token>)"}}
WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **AUTH_RESPONSES, 403: {"description": "The token's role may only read (operator needed)"}}


class TokenConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


def parse_token_entries(text: str, where: str) -> list[tuple[str, Principal]]:
    """``principal:role:token`` entries separated by commas or newlines; ``#`` starts a comment."""
    out: list[tuple[str, Principal]] = []
    for n, raw in enumerate(text.replace(",", "\n").splitlines(), 1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        parts = entry.split(":", 2)
        if len(parts) != 3 or not all(p.strip() for p in parts):
            raise TokenConfigError(f"{where}: entry {n} is not principal:role:token")
        name, role, token = (p.strip() for p in parts)
        if role not in ROLES:
            raise TokenConfigError(f"{where}: entry {n} ({name}) has role {role!r}; use viewer or operator")
        out.append((token, Principal(name, role)))
    return out


@dataclass
class TokenTable:
    enabled: bool
    by_token: dict[str, Principal]

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenTable:
        entries: list[tuple[str, Principal]] = []
        if settings.api_token is not None:
            entries.append((settings.api_token.get_secret_value(), Principal("operator", "operator")))
        if settings.api_tokens is not None:
            entries += parse_token_entries(settings.api_tokens.get_secret_value(), "SLUICE_API_TOKENS")
        if settings.api_tokens_file:
            entries += parse_token_entries(Path(settings.api_tokens_file).read_text(),
                                           settings.api_tokens_file)
        return cls(settings.api_auth, dict(entries))

    def lookup(self, given: str) -> Principal | None:
        found: Principal | None = None
        # Compare against every token so the time taken does not say which one was close.
        for token, principal in self.by_token.items():
            if secrets.compare_digest(given.encode(), token.encode()):
                found = principal
        return found


def _authenticate(request: Request, creds: HTTPAuthorizationCredentials | None) -> Principal:
    table: TokenTable = request.app.state.tokens
    if not table.enabled:
        return Principal(ANONYMOUS, "operator")
    given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""
    principal = table.lookup(given) if given else None
    if principal is None:
        detail = ("a valid bearer token is required (Authorization: Bearer <token>)" if table.by_token
                  else "the api has no tokens configured: set SLUICE_API_TOKEN or SLUICE_API_TOKENS")
        raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
    return principal


def _remember(request: Request, principal: Principal) -> None:
    current_principal.set(principal.name)
    # Also in the request's scope, where the audit line of the metrics middleware finds it.
    request.state.principal = principal.name


async def require_read(request: Request,
                       creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    _remember(request, _authenticate(request, creds))


async def require_write(request: Request,
                        creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    principal = _authenticate(request, creds)
    # Remembered before the role check, so the audit line of a refused change names who tried.
    _remember(request, principal)
    if principal.role != "operator":
        raise HTTPException(403, f"{principal.name} is a {principal.role}: this needs an operator token")
