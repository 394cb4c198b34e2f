"""Entry point: ``python -m services.member``."""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service


def main() -> None:
    # One leader at a time owns the "members" domain log; the others wait for its lease.
    run_service("member", leader_main("members"))


if __name__ == "__main__":
    main()
