"""Entry point: ``python -m services.scheduler``."""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service


def main() -> None:
    # One leader at a time owns the "schedule" domain log; the others wait for its lease.
    run_service("scheduler", leader_main("schedule"))


if __name__ == "__main__":
    main()
