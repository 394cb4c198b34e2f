"""A real sink-worker that kills itself (SIGKILL, like ``kill -9``) right after it executed a
shard DDL and before it reports the done, once: when the file named by
``SHARD_DDL_CRASH_MARKER`` exists at that moment (the test creates it to arm the crash; the
worker removes it, so a restarted or other worker does not crash again).

Usage: python -m tests.helpers.shard_ddl_worker (with the sink-worker's SLUICE_* environment).
"""

from __future__ import annotations

import os
import signal

from libs.shard_ddl.lock import Operation
from services.sink_worker import __main__ as worker_main
from services.sink_worker.ddl.shard import ShardDdl

_original = ShardDdl.carried_out


async def _carried_out(self: ShardDdl, op: Operation, error: str | None = None) -> None:
    marker = os.environ.get("SHARD_DDL_CRASH_MARKER")
    if marker and op.kind == "exec" and error is None:
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass
        else:
            # The exec ran on the target; its done is never sent.
            os.kill(os.getpid(), signal.SIGKILL)
    await _original(self, op, error)


ShardDdl.carried_out = _carried_out  # type: ignore[method-assign]

if __name__ == "__main__":
    worker_main.main()
