"""The binlog reader in a child process (``SLUICE_CAPTURE_READER_PROCESS``, the default).

pymysqlreplication's parse is most of the reader's CPU, and on a thread it shares capture's
GIL, so one core, with the asyncio event loop. ``ReaderProcess`` runs ``BinlogReader`` in
``services.capture.reader_child`` and has the same face as ``BinlogReader`` (``start``,
``take``, ``pending``, ``position``, ``stop``, ``join``): the event loop only unpickles
ready items.

- Items cross in pickled batches ``(items, read position, items still pending in the child)``
  over a pipe: up to ``batch_items`` items (whole event groups) and about ``batch_bytes`` of
  rows events, gathered for up to ``linger_s`` (10 ms): with the parse in its own process the
  event loop outruns it, and without the linger every batch would hold a transaction or two
  and pay the pipeline's fixed cost per batch for it. Back-pressure is the child's bounded
  queue (``max_items``) behind the pipe: a capture that does not take stops the child's send,
  then its queue, then its binlog read.
- The source's settings, password included, are the first message on a second pipe; the
  child exits at that pipe's end of file and the kernel kills it when capture dies.
- A child that dies (or breaks the pipe) is a ``ReaderFailed`` at once: the session's retry
  path, never the end of the binlog.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from libs.project_path import pythonpath_with_project
from services.capture.binlog_reader import Item, Position, ReaderFailed


class ReaderDied(RuntimeError):
    """The reader's child process ended or its pipe broke while capture was reading."""


class ReaderProcess:
    def __init__(self, connection: dict[str, Any], server_id: int, start: Position, *,
                 heartbeat_s: float = 1.0, max_items: int = 2000,
                 only_schemas: list[str] | None = None, batch_items: int = 500,
                 batch_bytes: int = 1024 * 1024, linger_s: float = 0.01,
                 fast_rows: bool = True, start_gtid: str | None = None, direct: bool = True) -> None:
        self._config = {"connection": dict(connection), "server_id": server_id, "file": start.file,
                        "pos": start.pos, "start_gtid": start_gtid, "heartbeat_s": heartbeat_s,
                        "max_items": max_items,
                        "only_schemas": only_schemas, "batch_items": batch_items,
                        "batch_bytes": batch_bytes, "linger_s": linger_s, "fast_rows": fast_rows,
                        "direct": direct}
        self._proc: subprocess.Popen[bytes] | None = None
        self._data: Connection | None = None
        self._ctl: Connection | None = None
        self._stop = threading.Event()
        self._child_pending = 0
        self._held: list[Item] = []
        self.position = start

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child; call from the main thread (the kernel's parent-death signal follows
        the thread that started the child)."""
        data_r, data_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        try:
            # PYTHONPATH: the child imports the same services package as capture.
            env = dict(os.environ)
            env["PYTHONPATH"] = pythonpath_with_project(env)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.capture.reader_child", str(data_w), str(ctl_r),
                 str(os.getpid())], pass_fds=(data_w, ctl_r), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(data_w)
            os.close(ctl_r)
        self._data = Connection(data_r, writable=False)
        self._ctl = Connection(ctl_w, readable=False)
        self._ctl.send(self._config)  # the password crosses here, not in argv or the environment

    def stop(self) -> None:
        """Stop now: the child is killed (its replication connection goes with it) and reaped."""
        self._stop.set()
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
                pass

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout: float) -> bool:
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def pending(self) -> int:
        """Items read and not taken yet (> 0 while a backlog drains): the child's count at its
        last batch, the held ones, and at least one for a batch waiting in the pipe."""
        waiting = 0
        data = self._data
        if data is not None:
            try:
                waiting = 1 if data.poll(0) else 0
            except (EOFError, OSError):
                waiting = 0
        return self._child_pending + len(self._held) + waiting

    def take(self, max_items: int = 2000, wait: float = 0.5, linger: float = 0.002) -> list[Item]:
        """Up to ``max_items`` items (a batch from the child is not split): the first batch
        within ``wait``, more within ``linger``. Runs off-loop, one caller at a time."""
        items, self._held = self._held, []
        if not items:
            got = self._receive(wait)
            if got is None:
                return self._ended()
            if not got:
                return []
            items = got
        until = time.monotonic() + linger
        while len(items) < max_items and not isinstance(items[-1], ReaderFailed):
            got = self._receive(max(0.0, until - time.monotonic()))
            if got is None:  # the child ended: what came before it still counts
                self._held = self._ended()
                break
            if not got:
                break
            items.extend(got)
        return items

    def _receive(self, wait: float) -> list[Item] | None:
        """One batch ([] if none within ``wait``); None once the pipe is closed."""
        data = self._data
        if data is None:
            return None
        try:
            if not data.poll(wait):
                return []
            batch, self.position, self._child_pending = pickle.loads(data.recv_bytes())
        except (EOFError, OSError):
            data.close()
            self._data = None
            return None
        return list(batch)

    def _ended(self) -> list[Item]:
        if self._stop.is_set():
            return []
        code: int | None = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # its pipe broke first; it is ended by stop()
                code = None
        self._stop.set()
        return [ReaderFailed(ReaderDied(f"the binlog reader process ended (exit status {code})"))]
