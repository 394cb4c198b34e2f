"""Entry point: ``python -m services.capture``."""

from __future__ import annotations

from libs.service import run_service
from services.capture.service import main as capture_main


def main() -> None:
    run_service("capture", capture_main)


if __name__ == "__main__":
    main()
