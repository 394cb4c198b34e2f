"""The api service's main: rebuild the read models by replay, then keep them following the
streams while uvicorn serves the routes."""

from __future__ import annotations

import logging

from libs.leader_service import ServiceMain
from libs.service import ServiceRuntime
from services.api.context import ApiContext
from services.api.projections import Projections, make_engine

log = logging.getLogger(__name__)


def api_main(ctx: ApiContext) -> ServiceMain:
    async def main(runtime: ServiceRuntime) -> None:
        settings = runtime.settings
        if not settings.api_auth:
            log.warning("SLUICE_API_AUTH is false: every endpoint is open to anyone who reaches "
                        "the api")
        elif settings.api_token is None and settings.api_tokens is None and not settings.api_tokens_file:
            log.error("no api token is configured (SLUICE_API_TOKEN, SLUICE_API_TOKENS or "
                      "SLUICE_API_TOKENS_FILE): every request is refused with 401")
        engine = make_engine(settings.state_db_url)
        projections = Projections(runtime.nc.jetstream(), engine, settings)
        ctx.nc = runtime.nc
        ctx.projections = projections
        ctx.stopping = runtime.stopping
        runtime.add_ready_check("read_models", lambda: projections.ready)
        runtime.status["read_models"] = projections.flushed_seq
        try:
            await projections.run(runtime.stopping)
        finally:
            engine.dispose()

    return main
