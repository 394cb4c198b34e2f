"""Run a Sluice service as a real subprocess: start it, wait for health, kill -9, pause, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.localservers.common import free_port, wait_until
from libs.localservers.nats_server import NatsServer


@dataclass
class ServiceProcess:
    module: str  # e.g. "services.member"
    env: dict[str, str]
    log_dir: Path
    instance_id: str = ""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()
        if not self.instance_id:
            self.instance_id = f"{self.module.rsplit('.', 1)[-1]}-{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.instance_id}.log"

    def start(self) -> ServiceProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "SLUICE_HTTP_PORT": str(self.port),
               "SLUICE_INSTANCE_ID": self.instance_id}
        # A service runs as its own NATS role, never as the admin user of the stack's URL.
        env |= NatsServer.credentials_for(self.module, env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get_json(self, path: str, timeout: float = 1.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def _answer(self, path: str) -> dict[str, Any] | None:
        """The body of ``path`` when it answers 200, else None (not up, or failing)."""
        try:
            status, body = self.get_json(path)
        except (OSError, ValueError):
            return None
        return body if status == 200 else None

    def health(self) -> dict[str, Any] | None:
        return self._answer("/healthz")

    def _wait_for(self, path: str, timeout: float) -> dict[str, Any]:
        answers: list[dict[str, Any]] = []

        def check() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.instance_id} exited; log:\n{self.tail_log()}")
            body = self._answer(path)
            if body is None:
                return False
            answers.append(body)
            return True

        wait_until(check, timeout, f"{self.instance_id} {path}", interval=0.1)
        return answers[-1]

    def wait_healthy(self, timeout: float = 30) -> dict[str, Any]:
        return self._wait_for("/healthz", timeout)

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        """Until ``/readyz`` answers 200; its body."""
        return self._wait_for("/readyz", timeout)

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 20) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return int(self.proc.returncode)
