"""Structured JSON logs that carry the current trace and span ids."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

from libs.config import Settings

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_SECRET_KEYS = ("password", "token", "secret", "authorization")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "service": self.service,
            "msg": record.getMessage(),
        }
        span_ctx = trace.get_current_span().get_span_context()
        if span_ctx.is_valid:
            out["trace_id"] = format(span_ctx.trace_id, "032x")
            out["span_id"] = format(span_ctx.span_id, "016x")
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_"):
                continue
            # Never let a credential reach the log, whatever a caller passed in ``extra``.
            out[key] = "***" if any(s in key.lower() for s in _SECRET_KEYS) else value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_json:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    # The NATS client logs every reconnect attempt at INFO; ours are enough.
    logging.getLogger("nats").setLevel(logging.WARNING)
