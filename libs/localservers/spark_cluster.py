"""A real Spark standalone cluster and a Spark Connect server on this host, from pyspark's own
launchers (``bin/spark-class``, ``bin/spark-submit``; no Spark download).

``SparkStandalone``: a master and N workers (``spark://127.0.0.1:PORT``); ``SparkConnect``: a
Spark Connect server (``sc://127.0.0.1:PORT``) running its jobs on ``local[N]`` or on a
standalone master. Every process binds to 127.0.0.1 and logs to a file in the data directory;
the Python workers they start run this venv's interpreter with the project on ``PYTHONPATH``,
so they import ``libs`` and ``services`` like a sink-worker does. What the compose stack runs
as the ``spark-master``, ``spark-worker`` and ``spark-connect`` services.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from libs.localservers.common import free_port, port_open, wait_until
from libs.project_path import pythonpath_with_project


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _environment(daemon: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": pythonpath_with_project(env),
    })
    if daemon:
        # Small daemons: the master and workers only schedule; executors get their own memory.
        # (Not for spark-submit: it would cap the Connect server's driver below Spark's minimum.)
        env["SPARK_DAEMON_MEMORY"] = "256m"
    return env


@dataclass
class _Process:
    name: str
    args: list[str]
    log: Path
    daemon: bool = True
    proc: subprocess.Popen[bytes] | None = None
    _out: IO[bytes] | None = field(default=None, repr=False)

    def start(self, cwd: Path) -> None:
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(self.args, cwd=cwd, env=_environment(self.daemon), stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # The launcher's process group: the JVM and any executor or Python worker it started.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._out is not None:
            self._out.close()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class _Group:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[_Process] = []

    def _launch(self, name: str, args: list[str], daemon: bool = True) -> _Process:
        p = _Process(name, args, self.data_dir / f"{name}.log", daemon)
        p.start(self.data_dir)
        self.processes.append(p)
        return p

    def _wait(self, predicate: Any, timeout: float, what: str) -> None:
        def check() -> bool:
            dead = [p for p in self.processes if not p.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited while waiting for {what}:\n{dead[0].tail()}")
            return bool(predicate())

        wait_until(check, timeout, what, interval=0.2)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.processes)


class SparkStandalone(_Group):
    """A standalone master with ``workers`` workers of ``cores`` cores each."""

    def __init__(self, data_dir: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        super().__init__(data_dir)
        self.workers, self.cores, self.memory = workers, cores, memory
        self.port, self.ui_port = free_port(), free_port()

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        """The master's own view (its web UI's JSON): workers, running applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
            status: dict[str, Any] = json.load(r)
            return status

    def _alive_workers(self) -> int:
        try:
            return int(self.status().get("aliveworkers", 0))
        except (OSError, ValueError):
            # Not up yet: no answer, or (seen under load) the web UI answering before its JSON
            # handler does, with an empty body.
            return 0

    def start(self, timeout: float = 60) -> SparkStandalone:
        spark_class = str(spark_home() / "bin" / "spark-class")
        self._launch("spark-master", [spark_class, "org.apache.spark.deploy.master.Master",
                                      "--host", "127.0.0.1", "--port", str(self.port),
                                      "--webui-port", str(self.ui_port)])
        self._wait(lambda: port_open(self.port) and port_open(self.ui_port), timeout,
                   f"the Spark master on port {self.port}")
        for i in range(self.workers):
            work = self.data_dir / f"work-{i}"
            self._launch(f"spark-worker-{i}", [
                spark_class, "org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1",
                "--port", str(free_port()), "--webui-port", str(free_port()), "--cores", str(self.cores),
                "--memory", self.memory, "--work-dir", str(work)])
        self._wait(lambda: self._alive_workers() == self.workers, timeout,
                   f"{self.workers} Spark workers registered with the master")
        return self


class SparkConnect(_Group):
    """A Spark Connect server whose jobs run on ``master`` (``local[N]`` or ``spark://...``)."""

    def __init__(self, data_dir: Path, master: str = "local[1]") -> None:
        super().__init__(data_dir)
        self.master = master
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> SparkConnect:
        self._launch("spark-connect", [
            str(spark_home() / "bin" / "spark-submit"), "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer", "--name", "sluice-spark-connect",
            "--master", self.master, "--driver-memory", "768m",
            "--conf", f"spark.connect.grpc.binding.port={self.port}",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.catalogImplementation=in-memory",
            "--conf", f"spark.pyspark.python={sys.executable}",
            "--conf", "spark.sql.shuffle.partitions=3"], daemon=False)
        self._wait(lambda: port_open(self.port), timeout, f"the Spark Connect server on port {self.port}")
        return self
