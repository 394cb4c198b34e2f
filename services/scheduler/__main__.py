"""Entry point: ``python -m services.scheduler``."""

from __future__ import annotations

from libs.service import idle_until_stopped, run_service


def main() -> None:
    run_service("scheduler", idle_until_stopped)


if __name__ == "__main__":
    main()
