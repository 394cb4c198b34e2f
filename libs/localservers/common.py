"""Helpers shared by the local server launchers."""

from __future__ import annotations

import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_binary(name: str, extra_dirs: tuple[str, ...] = ()) -> str:
    """Find ``name`` next to this interpreter (the venv), on PATH, or in ``extra_dirs``."""
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.exists():
        return str(venv_bin)
    found = shutil.which(name)
    if found:
        return found
    for d in extra_dirs:
        for candidate in sorted(Path("/").glob(d.lstrip("/")), reverse=True):
            path = candidate / name
            if path.exists():
                return str(path)
    raise FileNotFoundError(f"{name} not found; run the README's set-up command first")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0
