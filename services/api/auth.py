"""Bearer-token auth: mutating endpoints need ``SLUICE_API_TOKEN`` when it is set; read-only
ones too when ``SLUICE_API_AUTH_READS`` is true. The token is compared in constant time and
never logged (neither is the Authorization header: the api has no access log)."""

from __future__ import annotations

import secrets

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

bearer = HTTPBearer(auto_error=False, description="SLUICE_API_TOKEN")


def _check(request: Request, creds: HTTPAuthorizationCredentials | None) -> None:
    token = request.app.state.ctx.settings.api_token
    if token is None:
        return
    expected = token.get_secret_value()
    given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else ""
    if not given or not secrets.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(401, "a valid bearer token is required (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})


def require_write(request: Request,
                  creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    _check(request, creds)


def require_read(request: Request,
                 creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    if request.app.state.ctx.settings.api_auth_reads:
        _check(request, creds)
