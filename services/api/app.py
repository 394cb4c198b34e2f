"""The api's FastAPI app: the operator endpoints under /api/v1 beside the runtime's /healthz,
/readyz and /metrics; OpenAPI at /openapi.json, Swagger UI at /docs and ReDoc at /redoc, their
scripts and styles served by the api itself (DOCS_ASSETS) so the pages work without internet."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

from services.api.auth import AUTH_RESPONSES, WRITE_RESPONSES, TokenTable
from services.api.context import ApiContext
from services.api.http_guards import BodyLimit, RequestMetrics
from services.api.routes import changefeeds, cluster, ddl, deadletters, events, leaders, sources, table_errors
from services.api.routes import validation as validation_routes

API_PREFIX = "/api/v1"
# Where the Swagger UI and ReDoc bundles (from the fastapi-offline package) are served.
DOCS_ASSETS = "/docs-assets"
_READ_METHODS = {"get", "head", "options"}


async def field_errors_only(request: Request, exc: Exception) -> JSONResponse:
    """422 with where and what (``loc``, ``msg``, ``type``) but never the input: a refused body
    may hold a password, and the answer must not echo it."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse(status_code=422, content={"detail": [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in errors]})


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPIOffline(
        docs_url="/docs", redoc_url="/redoc", static_url=DOCS_ASSETS,
        # Swagger UI would otherwise send the spec to an online validator.
        swagger_ui_parameters={"validatorUrl": None},
        title="Sluice operator API", version="1",
        description="Changefeeds, tables, members, DDL locks, leaders, dead letters and the event "
                    "feed. Every endpoint needs `Authorization: Bearer <token>` (unless "
                    "SLUICE_API_AUTH=false): a viewer token reads, an operator token also changes "
                    "things. Commands answer 202 with where to follow them; bodies over "
                    "SLUICE_API_MAX_BODY_BYTES get 413.")
    app.state.ctx = ctx
    app.add_exception_handler(RequestValidationError, field_errors_only)
    app.state.tokens = TokenTable.from_settings(ctx.settings)
    api = APIRouter(prefix=API_PREFIX)
    for module in (changefeeds, cluster, ddl, leaders, deadletters, events, table_errors, sources):
        api.include_router(module.router, responses=AUTH_RESPONSES)
    api.include_router(validation_routes.router, responses=AUTH_RESPONSES)
    app.include_router(api)
    # Added last is outermost: the metrics see the body limit's 413s too.
    app.add_middleware(BodyLimit, limit=ctx.settings.api_max_body_bytes)
    app.add_middleware(RequestMetrics)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            for path, operations in doc.get("paths", {}).items():
                if not path.startswith(API_PREFIX):
                    continue
                for method, op in operations.items():
                    if method not in _READ_METHODS:
                        for code, resp in WRITE_RESPONSES.items():
                            op.setdefault("responses", {}).setdefault(str(code), dict(resp))
                    op["responses"].setdefault("413", {"description": "Body over the limit"})
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
