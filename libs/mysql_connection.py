"""The one pymysql connection class every Sluice MySQL/MariaDB client uses (capture, the sink,
the api's checks, the verifier, the local servers).

Given no TLS options, pymysql 1.2 offers TLS when the server has it ("preferred") and builds a
fresh default ``SSLContext`` for that on every connect, loading the system CA store: about
50 ms of CPU per connection (the largest single cost of a short connection), paid by the apply
job once per partition and round, by capture's metadata reads and by every check. That context
is always the same (no CA, no verification), so one is shared by the process; explicit TLS
options (a CA, a client certificate, verification) still get their own, built from the files
as they are at connect time.
"""

from __future__ import annotations

import threading
from typing import Any

import pymysql

_build_ctx = pymysql.connections.Connection._create_ssl_ctx  # type: ignore[attr-defined]


class MySQLConnection(pymysql.connections.Connection):
    _preferred_ctx: Any = None
    _ctx_lock = threading.Lock()

    def _create_ssl_ctx(self, sslp: Any) -> Any:
        if not (isinstance(sslp, dict) and not sslp):
            return _build_ctx(self, sslp)
        with MySQLConnection._ctx_lock:
            if MySQLConnection._preferred_ctx is None:
                MySQLConnection._preferred_ctx = _build_ctx(self, sslp)
            return MySQLConnection._preferred_ctx


def connect(**kwargs: Any) -> MySQLConnection:
    """``pymysql.connect`` with the shared preferred-TLS context."""
    return MySQLConnection(**kwargs)
