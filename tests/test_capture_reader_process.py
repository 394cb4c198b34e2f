"""The binlog reader's child process: failures cross as failures, never as the binlog's end."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

from services.capture.binlog_reader import Commit, Heartbeat, Item, Position, ReaderFailed, Rows
from services.capture.reader_child import batches, picklable
from services.capture.reader_process import ReaderDied, ReaderProcess

START = Position("binlog.000001", 4)


def take_until_failed(reader: ReaderProcess, within: float) -> ReaderFailed:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        items = reader.take(wait=0.2)
        if items:
            assert isinstance(items[-1], ReaderFailed), items
            return items[-1]
    raise AssertionError(f"no failure from the reader within {within} s")


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts and never answers: the child blocks in the MySQL handshake."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_connection_error_crosses_with_its_code() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reader = ReaderProcess({"host": "127.0.0.1", "port": port, "user": "u", "password": "s3cret-pw"},
                           1, START)
    reader.start()
    try:
        failed = take_until_failed(reader, 30)
        assert isinstance(failed.error, pymysql.err.OperationalError)
        assert failed.error.args[0] == 2003  # as 1236 (a purged binlog) crosses: code and words
    finally:
        reader.stop()
    assert reader.join(5)


def test_a_killed_child_is_a_reader_failure_at_once(silent_server: int) -> None:
    reader = ReaderProcess({"host": "127.0.0.1", "port": silent_server, "user": "u",
                            "password": "s3cret-pw"}, 1, START)
    reader.start()
    try:
        assert reader.take(wait=0.3) == []  # blocked in the handshake: nothing yet
        assert reader.pid is not None
        cmdline = Path(f"/proc/{reader.pid}/cmdline").read_bytes()
        assert b"s3cret-pw" not in cmdline, "the password is on the child's command line"
        os.kill(reader.pid, signal.SIGKILL)
        began = time.monotonic()
        failed = take_until_failed(reader, 10)
        assert isinstance(failed.error, ReaderDied)
        assert time.monotonic() - began < 2
    finally:
        reader.stop()


def test_stopping_ends_the_child_and_takes_nothing(silent_server: int) -> None:
    reader = ReaderProcess({"host": "127.0.0.1", "port": silent_server, "user": "u",
                            "password": "s3cret-pw"}, 1, START)
    reader.start()
    pid = reader.pid
    reader.stop()
    assert reader.join(5)
    assert not Path(f"/proc/{pid}").exists()
    assert reader.take(wait=0.1) == []  # a stopped reader's end is not a failure


def _rows(size: int) -> Rows:
    return Rows(START, 0, "d", "t", "insert", (), (), size)


def test_batches_are_cut_by_rows_bytes() -> None:
    items: list[Item] = [_rows(600), _rows(600), Commit(START, 0), _rows(100), Heartbeat(START)]
    assert batches(items, 1000) == [items[:2], items[2:]]
    assert batches(items, 10_000) == [items]


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


def test_an_unpicklable_failure_crosses_with_its_words() -> None:
    items: list[Item] = [Heartbeat(START), ReaderFailed(_Unpicklable(1, 2))]
    out = picklable(items)
    assert out[0] == items[0]
    last = out[-1]
    assert isinstance(last, ReaderFailed) and isinstance(last.error, RuntimeError)
    assert str(last.error) == "_Unpicklable: 1/2"
