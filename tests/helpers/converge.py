"""Waiting for a downstream to equal its source, for the process tests: the condition is the
row-for-row comparison itself, polled with a deadline, and a failure names what still differs
and shows the processes' last log lines."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from libs.localservers.service_process import ServiceProcess
from services.sink_worker.validation.verify import Verification


def wait_converged(verify: Callable[[], list[Verification]], procs: Sequence[ServiceProcess],
                   timeout: float, *, interval: float = 0.3, log_lines: int = 15) -> None:
    """Until every ``verify()`` result is equal; any process dying first fails at once."""
    deadline = time.monotonic() + timeout
    last = "nothing compared yet"
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        try:
            results = verify()
        except Exception as exc:  # a target table appears with the first batch
            last = repr(exc)
        else:
            if all(r.ok for r in results):
                return
            last = "\n".join(f"{r.target}: {r.diff}" for r in results if not r.ok)
        time.sleep(interval)  # polling the condition itself, with a deadline
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(log_lines)}\nhealth: {p.health()}" for p in procs)
    pytest.fail(f"downstream did not converge within {timeout}s:\n{last}\n{logs}")
