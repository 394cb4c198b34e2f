"""Helpers shared by the local server launchers."""

from __future__ import annotations

import random
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Its own generator: a test that seeds ``random`` must not make every xdist worker try the
# same ports in the same order.
_PORTS = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port that ``bind(0)`` hands out
    comes from that range, so an outgoing connection of any process (the suite opens thousands)
    may take it again before the server binds it, seen as a service's "address already in use"
    and a test waiting for a process that never started."""
    low = _ephemeral_low()
    if low > 2048:
        for _ in range(100):
            port = _PORTS.randrange(max(1024, low - 12000), low)
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
