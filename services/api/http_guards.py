"""ASGI wrappers around the api: a request-body limit answered with 413 before the body is
read, and Prometheus metrics of every request by route template, method and status."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import HTTPException
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HTTP_REQUESTS = Counter("sluice_api_http_requests", "HTTP requests the api answered.",
                        ["route", "method", "status"])
HTTP_LATENCY = Histogram("sluice_api_http_request_seconds", "Time the api took to answer a request.",
                         ["route", "method", "status"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
UNMATCHED = "<unmatched>"
_READS = {"GET", "HEAD", "OPTIONS"}
log = logging.getLogger(__name__)


def _too_large(limit: int) -> str:
    return f"the request body is larger than the api accepts ({limit} bytes, SLUICE_API_MAX_BODY_BYTES)"


class BodyLimit:
    """A declared Content-Length over the limit is refused before any byte is read; a chunked
    body is counted as it arrives and refused once it passes the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            body = json.dumps({"detail": _too_large(self.limit)}).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Raised inside the route's body read, where FastAPI turns it into the answer.
                    raise HTTPException(413, _too_large(self.limit))
            return message

        await self.app(scope, counted, send)


def route_template(scope: Scope) -> str:
    """The matched route's path with its placeholders (``/api/v1/changefeeds/{changefeed_id}``),
    so the label's values stay few; requests no route matched share one value."""
    # FastAPI resolves an included router's route with its prefix in this context; a plain
    # Starlette route carries the whole path itself.
    fastapi_scope = scope.get("fastapi")
    effective = fastapi_scope.get("effective_route_context") if isinstance(fastapi_scope, dict) else None
    for candidate in (effective, scope.get("route")):
        template: Any = getattr(candidate, "path_format", None)
        if template:
            return str(template)
    return UNMATCHED


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            template = route_template(scope)
            labels = (template, scope.get("method", ""), str(status))
            HTTP_REQUESTS.labels(*labels).inc()
            HTTP_LATENCY.labels(*labels).observe(time.perf_counter() - began)
            if labels[1] not in _READS:
                # The audit trail of changes: who (the token's principal), what and the outcome.
                state = scope.get("state") or {}
                log.info("api mutation", extra={"principal": state.get("principal", "unauthenticated"),
                                                "method": labels[1], "route": template,
                                                "status": status})
