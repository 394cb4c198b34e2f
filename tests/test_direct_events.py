"""The direct path's reading of GTID, XID and BEGIN/COMMIT packets against the binlog library's
own events for the same bytes, without a server: each packet is fed to a ``DirectStream`` once
as it runs in capture and once with the direct path off, and capture's reader makes the same
item of both. Packets the direct path must not read (another statement, a post-header of
another length, a table whose map it has not seen) go to the library. The rows events and
table maps, on a real binlog: ``tests/test_capture_direct_events.py``."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import pytest
from pymysql.protocol import MysqlPacket
from pymysqlreplication.constants import BINLOG

from services.capture.binlog_reader import _EVENTS, Begin, Commit, DecodeCounts, Query, _convert, _direct_item
from services.capture.direct_events import DirectEvent, DirectStream, PushBackConnection

SERVER_ID = 7
FILE = "binlog.000003"


def packet(kind: int, body: bytes, *, log_pos: int = 4242, timestamp: int = 1_700_000_000) -> MysqlPacket:
    """An OK byte and a binlog event (v4 header, ``body``, CRC32 checksum) as the server sends it."""
    size = 19 + len(body) + 4
    event = struct.pack("<IBIIIH", timestamp, kind, SERVER_ID, size, log_pos, 0) + body
    return MysqlPacket(b"\x00" + event + struct.pack("<I", zlib.crc32(event)), "utf8")


def gtid(seq: int, domain: int, flags: int) -> MysqlPacket:
    return packet(BINLOG.MARIADB_GTID_EVENT, struct.pack("<QIB", seq, domain, flags) + b"\x00" * 6)


def query(sql: bytes, schema: bytes = b"", status: bytes = b"") -> MysqlPacket:
    post = struct.pack("<IIBHH", 11, 0, len(schema), 0, len(status))
    return packet(BINLOG.QUERY_EVENT, post + status + schema + b"\x00" + sql)


def fresh(packets: list[MysqlPacket]) -> list[MysqlPacket]:
    return [MysqlPacket(p.get_all_data(), "utf8") for p in packets]


class _Packets(PushBackConnection):
    """A stream connection whose packets come from a list (a pymysql ``Connection`` never connected)."""

    def __init__(self, packets: list[MysqlPacket]) -> None:  # no socket, no handshake
        self.packets = packets
        self.charset = "utf8mb4"

    def _read_packet(self, packet_type: Any = MysqlPacket) -> Any:
        pushed = self._pushed
        if pushed is not None:
            self._pushed = None
            return pushed
        return self.packets.pop(0)


class _Ctl:
    charset = "utf8mb4"

    def _get_dbms(self) -> str:
        return "mariadb"


def stream(packets: list[MysqlPacket], *, direct: bool,
           post_header_lengths: bytes | None = None) -> DirectStream:
    s = DirectStream(connection_settings={}, server_id=1, only_events=_EVENTS, resume_stream=True)
    s._stream_connection = _Packets(packets)
    s._ctl_connection = _Ctl()
    s._BinLogStreamReader__connected_stream = True
    s._BinLogStreamReader__connected_ctl = True
    s._BinLogStreamReader__use_checksum = True
    s._BinLogStreamReader__post_header_lengths = post_header_lengths
    if not direct:
        s._handlers = {}
    return s


def items(packets: list[MysqlPacket], *, direct: bool, **kwargs: Any) -> tuple[list[Any], DirectStream]:
    # Fresh packets: the library's read moves a packet's position, the server's are read once.
    s = stream(fresh(packets), direct=direct, **kwargs)
    out = []
    for _ in packets:
        event = s.fetchone()
        kind = type(event)
        if direct and kind in DirectEvent.__args__:
            out.append(_direct_item(event, FILE, {}, {}, True, DecodeCounts()))
        else:
            out.append(_convert(event, FILE, {}))
    return out, s


HOT = [
    gtid(123456789012, 0, 0), gtid(5, 2, 0x40), gtid(2**64 - 1, 2**32 - 1, 0xFF),
    query(b"BEGIN"), query(b"COMMIT", b"shop"),
    query(b"BEGIN", b"caf\xc3\xa9", status=b"\x00\x00\x00\x00\x00"),  # Q_FLAGS2_CODE, 4 bytes
    packet(BINLOG.XID_EVENT, struct.pack("<Q", 99)),
]


def test_the_direct_path_reads_gtid_xid_begin_commit_as_the_library_does() -> None:
    library, _ = items(HOT, direct=False)
    direct, s = items(HOT, direct=True)
    assert direct == library
    assert [type(i) for i in direct] == [Begin, Begin, Begin, Query, Query, Query, Commit]
    assert direct[1].xa and not direct[0].xa
    assert direct[0].gtid == f"0-{SERVER_ID}-123456789012"
    assert direct[4].schema == "shop" and direct[5].schema == "café"
    assert direct[6].position.pos == 4242
    assert s.direct == len(HOT)
    assert s.log_pos == 4242  # kept for the library's reconnect, as it keeps it


@pytest.mark.parametrize("pkt", [
    query(b"CREATE TABLE t (id INT)", b"shop"), query(b"XA START 'x'"), query(b"begin"),
    query(b"ROLLBACK"),
], ids=["ddl", "xa-start", "lower-case", "rollback"])
def test_other_statements_go_to_the_library(pkt: MysqlPacket) -> None:
    library, _ = items([pkt], direct=False)
    direct, s = items([pkt], direct=True)
    assert direct == library
    assert s.direct == 0


def test_a_post_header_of_another_length_goes_to_the_library() -> None:
    # The format description says QUERY's post-header is 15 bytes: the library skips the two
    # it does not know; the direct path leaves the packet to it.
    lengths = bytearray(40)
    lengths[BINLOG.QUERY_EVENT - 1] = 15
    post = struct.pack("<IIBHH", 11, 0, 0, 0, 0) + b"\xAA\xBB"
    pkt = packet(BINLOG.QUERY_EVENT, post + b"\x00" + b"BEGIN")
    library, _ = items([pkt], direct=False, post_header_lengths=bytes(lengths))
    direct, s = items([pkt], direct=True, post_header_lengths=bytes(lengths))
    assert direct == library
    assert isinstance(direct[0], Query) and direct[0].query == "BEGIN"
    assert s.direct == 0


def test_a_rows_event_of_an_unknown_table_is_skipped_as_the_library_skips_it() -> None:
    # Table id 77 has no map in the stream (filtered out, or never seen): the library drops the
    # event; the direct path too, and the XID after it still comes.
    rows = packet(BINLOG.WRITE_ROWS_EVENT_V1, (77).to_bytes(6, "little") + b"\x01\x00" + b"\x01\x01\x00\x05",
                  log_pos=100)
    xid = packet(BINLOG.XID_EVENT, struct.pack("<Q", 1), log_pos=200)
    for direct in (False, True):
        s = stream(fresh([rows, xid]), direct=direct)
        event = s.fetchone()
        assert (event.packet.log_pos if not direct else event.log_pos) == 200
        assert s.log_pos == 200
