"""The binlog reader's child process: ``python -m services.capture.reader_child DATA_FD CTL_FD PPID``.

Runs ``BinlogReader`` (the library's parse, the table-map cache, the conversion into items) on
this process's own core and sends its items to capture in pickled batches over DATA_FD. The
settings, with the source's password, come as the first message on CTL_FD: never on the
command line or in the environment. The child never outlives capture: the kernel kills it when
its parent dies (``PR_SET_PDEATHSIG``), and it exits when CTL_FD reaches end of file (the
parent closed it, or died). See ``reader_process`` for the parent's side and the message shape.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from services.capture.binlog_reader import BinlogReader, Item, Position, ReaderFailed, Rows

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; the parent starts the
    child from its main thread, so that is the parent's death)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def batches(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """``items`` cut where their rows events' binlog bytes pass ``max_bytes`` (a rows event's
    decoded values are bounded by its size), so one message never holds an unbounded backlog."""
    out: list[list[Item]] = []
    current: list[Item] = []
    size = 0
    for item in items:
        current.append(item)
        if isinstance(item, Rows):
            size += item.event_size or 0
            if size >= max_bytes:
                out.append(current)
                current, size = [], 0
    if current:
        out.append(current)
    return out


def picklable(items: list[Item]) -> list[Item]:
    """A failure whose exception does not survive pickling crosses as a RuntimeError with its
    words (pymysql's errors, 1236 among them, cross as they are)."""
    last = items[-1] if items else None
    if not isinstance(last, ReaderFailed):
        return items
    try:
        pickle.loads(pickle.dumps(last.error))
        return items
    except Exception:
        error = RuntimeError(f"{type(last.error).__name__}: {last.error}")
        return [*items[:-1], ReaderFailed(error)]


def serve(data: Connection, ctl: Connection, config: dict[str, Any]) -> None:
    start = Position(config["file"], int(config["pos"]))
    reader = BinlogReader(config["connection"], int(config["server_id"]), start,
                          heartbeat_s=float(config["heartbeat_s"]), max_items=int(config["max_items"]),
                          only_schemas=config["only_schemas"],
                          fast_rows=bool(config.get("fast_rows", True)),
                          start_gtid=config.get("start_gtid"), direct=bool(config.get("direct", True)))

    def watch_parent() -> None:
        try:
            ctl.recv_bytes()  # the parent sends nothing more: this returns only at EOF
        except (EOFError, OSError):
            pass
        reader.stop()
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    reader.start()
    batch_items = int(config["batch_items"])
    batch_bytes = int(config["batch_bytes"])
    while True:
        items = reader.take(max_items=batch_items, wait=0.5, linger=float(config["linger_s"]))
        if not items:
            continue
        failed = isinstance(items[-1], ReaderFailed)
        chunks = batches(picklable(items), batch_bytes)
        for n, chunk in enumerate(chunks):
            pending = reader.pending() + sum(len(c) for c in chunks[n + 1:])
            data.send_bytes(pickle.dumps((chunk, reader.position, pending), pickle.HIGHEST_PROTOCOL))
        if failed:
            return


def main(argv: list[str]) -> None:
    data_fd, ctl_fd, parent = (int(a) for a in argv)
    die_with_parent()
    # A signal to capture's process group (Ctrl-C, a supervisor's SIGTERM) is capture's to
    # handle: it stops this child by closing CTL_FD, and a child that died first would look
    # like a reader failure to a capture that is stopping.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(0)
    data = Connection(data_fd, readable=False)
    ctl = Connection(ctl_fd, writable=False)
    try:
        config = ctl.recv()
        serve(data, ctl, config)
    except (EOFError, BrokenPipeError):  # the parent went away: nothing to tell it
        pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
