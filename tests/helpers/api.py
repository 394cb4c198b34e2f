"""Reading the api's server-sent event frames."""

from __future__ import annotations

import json
from typing import Any

import httpx


def _frames(resp: httpx.Response) -> Any:
    frame: dict[str, Any] = {}
    for line in resp.iter_lines():
        if not line:
            if frame:
                yield frame
            frame = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            frame[key] = json.loads(value) if key == "data" else value
