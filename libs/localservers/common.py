"""Helpers shared by the local server launchers."""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_block() -> range:
    """This process' ports: below the kernel's ephemeral range, and a block of their own for
    each pytest-xdist worker, so two workers starting stacks at the same moment never pick
    the same port."""
    low = _ephemeral_low()
    first = max(1024, low - 12000)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (low - first) // workers
    return range(first + index % workers * size, first + (index % workers + 1) * size)


_BLOCK: range | None = None
_NEXT: int | None = None
_PORT_LOCK = threading.Lock()


def free_port() -> int:
    """A port free now. Not one ``bind(0)`` hands out: that comes from the kernel's ephemeral
    range, where an outgoing connection of any process (the suite opens thousands) may take it
    again before the server binds it, and a process that restarts a server on its old port
    finds it taken. Ports are handed out in turn from this process' block (``_port_block``),
    from a random start, so a port is not handed out twice before the block wraps; each is
    checked free by binding it."""
    global _BLOCK, _NEXT
    with _PORT_LOCK:
        if _BLOCK is None:
            _BLOCK = _port_block()
            _NEXT = random.SystemRandom().randrange(len(_BLOCK)) if len(_BLOCK) > 0 else 0
        block = _BLOCK
        for _ in range(min(len(block), 500)):
            assert _NEXT is not None
            port = block[_NEXT % len(block)]
            _NEXT += 1
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
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
