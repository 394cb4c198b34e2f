"""Entry point: ``python -m services.member``.

The leader tracks sink-worker heartbeats and records members joining, draining and leaving in
the members domain stream; ``GET /healthz`` on the leader lists the live members.
"""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service
from services.member.service import DOMAIN, MemberService


def main() -> None:
    run_service("member", leader_main(DOMAIN, service=MemberService))


if __name__ == "__main__":
    main()
