"""Entry point: ``python -m services.replication_manager``."""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service


def main() -> None:
    # One leader at a time owns the "replication" domain log; the others wait for its lease.
    run_service("replication-manager", leader_main("replication"))


if __name__ == "__main__":
    main()
