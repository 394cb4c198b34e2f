"""The ops endpoints every service serves (``/healthz``, ``/readyz``, ``/metrics``) as a bare
ASGI app for uvicorn.

Only the api needs FastAPI (routing, validation, OpenAPI). Importing it costs a control service
about 0.7 s of CPU at every start (FastAPI builds its OpenAPI models at import), more than the
rest of a member's start together, and a system starts a dozen services; three fixed GET
routes need none of it. The api mounts the same handlers on its FastAPI app, so the answers are
one code path.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
OpsAnswer = tuple[int, bytes, str]
"""Status, body, content type."""
OpsHandler = Callable[[], OpsAnswer]

JSON_TYPE = "application/json"


def json_answer(body: Any, status: int = 200) -> OpsAnswer:
    # The encoding of FastAPI's JSONResponse, so a service's answers read the same either way.
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    return status, text.encode(), JSON_TYPE


class OpsApp:
    """GET/HEAD on the registered paths; 404 (405 for another method) elsewhere."""

    def __init__(self, routes: dict[str, OpsHandler]) -> None:
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs with lifespan off; websockets are not served
        handler = self.routes.get(scope["path"])
        if handler is None:
            status, body, ctype = json_answer({"detail": "Not Found"}, 404)
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, ctype = json_answer({"detail": "Method Not Allowed"}, 405)
        else:
            status, body, ctype = handler()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body",
                    "body": b"" if scope["method"] == "HEAD" else body})
