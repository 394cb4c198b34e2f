"""Entry point: ``python -m services.scheduler``.

The leader decides which sink-worker runs which span (add, balance, drain, operator moves) and
records schedule tasks in the schedule stream; operator requests are request/reply on
``sluice.cmd.schedule``. ``GET /healthz`` on the leader shows its view.
"""

from __future__ import annotations

from libs.leader_service import leader_main
from libs.service import run_service
from services.scheduler.service import DOMAIN, SchedulerService


def main() -> None:
    run_service("scheduler", leader_main(DOMAIN, service=SchedulerService))


if __name__ == "__main__":
    main()
