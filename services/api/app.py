"""The api's FastAPI app: the operator endpoints under /api/v1 beside the runtime's /healthz,
/readyz and /metrics; OpenAPI at /openapi.json, Swagger UI at /docs."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI

from services.api.context import ApiContext
from services.api.routes import changefeeds, cluster, ddl, deadletters, events, leaders

API_PREFIX = "/api/v1"


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(
        title="Sluice operator API", version="1",
        description="Changefeeds, tables, members, DDL locks, leaders, dead letters and the event "
                    "feed. Mutating endpoints need `Authorization: Bearer <SLUICE_API_TOKEN>` when "
                    "a token is configured. Commands answer 202 with where to follow them.")
    app.state.ctx = ctx
    api = APIRouter(prefix=API_PREFIX)
    for module in (changefeeds, cluster, ddl, leaders, deadletters, events):
        api.include_router(module.router)
    app.include_router(api)
    return app
