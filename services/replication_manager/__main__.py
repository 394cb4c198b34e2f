"""Entry point: ``python -m services.replication_manager``.

The leader owns every span's replication set, executes schedule tasks with two-phase dispatch
to the sink-workers and records set changes and changefeed checkpoints in the replication
stream. ``GET /healthz`` on the leader shows the sets, checkpoints and what blocks them.
"""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service
from services.replication_manager.service import DOMAIN, ReplicationService


def main() -> None:
    run_service("replication-manager", leader_main(DOMAIN, service=ReplicationService))


if __name__ == "__main__":
    main()
