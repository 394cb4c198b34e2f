"""Entry point: ``python -m services.ddl_lock``."""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service
from services.ddl_lock.service import DdlLockService


def main() -> None:
    # One leader at a time owns the "ddl" domain log and every shard DDL lock; the others wait
    # for its lease.
    run_service("ddl-lock", leader_main("ddl", service=DdlLockService))


if __name__ == "__main__":
    main()
