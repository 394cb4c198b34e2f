"""Entry point: ``python -m services.api``."""

from __future__ import annotations

from libs.config import get_settings
from libs.service import run_service
from services.api.app import create_app
from services.api.context import ApiContext
from services.api.service import api_main


def main() -> None:
    settings = get_settings()
    ctx = ApiContext(settings=settings, producer=f"api/{settings.instance_id}")
    run_service("api", api_main(ctx), app=create_app(ctx))


if __name__ == "__main__":
    main()
