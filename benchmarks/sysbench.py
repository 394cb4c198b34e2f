"""sysbench (the Debian package) against a local MariaDB: install, prepare, run, parse.

The OLTP benchmarks use sysbench's own Lua scripts and its default table shape (``sbtest<N>``:
``id`` INT auto-increment key, ``k`` INT indexed, ``c`` CHAR(120), ``pad`` CHAR(60)), as a user
trying Sluice would; nothing here tunes the workload to the system under test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from libs.localservers.mariadb import MariaDB

DB = "sbtest"
# Row changes per transaction of each script (sysbench 1.0 defaults): oltp_write_only runs one
# indexed UPDATE, one non-indexed UPDATE, one DELETE and one INSERT; oltp_read_write the same
# writes after its reads.
ROWS_PER_TXN = {"oltp_write_only": 4, "oltp_read_write": 4}


def ensure_sysbench() -> str:
    """The sysbench binary; installed with apt-get when missing (as infra/dev.sh installs the
    servers), which needs root or sudo."""
    found = shutil.which("sysbench")
    if found:
        return found
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "install", "-y", "-qq", "--no-install-recommends", "sysbench"],
                ["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "sysbench"]):
        subprocess.run(prefix + cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                       check=False, timeout=600)
        found = shutil.which("sysbench")
        if found:
            return found
    raise RuntimeError("sysbench is not installed and apt-get could not install it "
                       "(apt-get install sysbench)")


@dataclass(frozen=True)
class SysbenchResult:
    script: str
    threads: int
    seconds: float
    transactions: int
    tps: float
    row_changes: int
    errors: int

    @property
    def rows_per_s(self) -> float:
        return self.row_changes / self.seconds if self.seconds > 0 else 0.0


def _args(db: MariaDB, script: str, tables: int, table_size: int, threads: int) -> list[str]:
    return [ensure_sysbench(), script, "--db-driver=mysql", "--mysql-host=127.0.0.1",
            f"--mysql-port={db.port}", "--mysql-user=root", f"--mysql-db={DB}",
            f"--tables={tables}", f"--table-size={table_size}", f"--threads={threads}"]


def prepare(db: MariaDB, tables: int, table_size: int) -> None:
    db.execute(f"CREATE DATABASE IF NOT EXISTS {DB}")
    subprocess.run([*_args(db, "oltp_write_only", tables, table_size, 1), "prepare"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)


def start_run(db: MariaDB, script: str, *, tables: int, table_size: int, threads: int,
              seconds: int, rate: float = 0) -> subprocess.Popen[str]:
    """sysbench ``run`` in the background; ``finish`` waits for it and reads its report.
    ``rate``: transactions a second, sysbench's own pacing (0: as fast as it can)."""
    # --report-interval=0 and --histogram off: only the final summary, parsed by ``finish``.
    return subprocess.Popen([*_args(db, script, tables, table_size, threads), f"--time={seconds}",
                             f"--rate={int(rate)}", "--rand-type=uniform", "run"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], script: str, threads: int) -> SysbenchResult:
    out, _ = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"sysbench {script} failed ({proc.returncode}):\n{out[-3000:]}")
    return parse_report(out, script, threads)


def parse_report(out: str, script: str, threads: int) -> SysbenchResult:
    def number(pattern: str) -> float:
        found = re.search(pattern, out)
        if found is None:
            raise RuntimeError(f"sysbench report without {pattern!r}:\n{out[-3000:]}")
        return float(found.group(1))

    transactions = int(number(r"transactions:\s+(\d+)"))
    seconds = number(r"total time:\s+([\d.]+)s")
    errors = int(number(r"ignored errors:\s+(\d+)"))
    # Each script's transactions write a fixed number of rows; a transaction that failed (a
    # deadlock sysbench ignores and retries) wrote none.
    return SysbenchResult(script, threads, seconds, transactions, transactions / seconds if seconds else 0.0,
                          transactions * ROWS_PER_TXN[script], errors)


def run(db: MariaDB, script: str, *, tables: int, table_size: int, threads: int,
        seconds: int) -> SysbenchResult:
    proc = start_run(db, script, tables=tables, table_size=table_size, threads=threads, seconds=seconds)
    return finish(proc, script, threads)
