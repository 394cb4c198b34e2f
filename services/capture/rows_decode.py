"""ROWS events decoded by a decoder compiled once per table map, in place of pymysqlreplication's
per-column parse.

The library decodes every value through a chain of ``if column.type == ...`` tests, a
``struct.unpack`` of a fresh slice, a name lookup in the table map and a bitmap test per
column: about 180 us of CPU a sysbench row change on this machine, the floor of capture's drain
(BENCHMARKS.md, "Capture under many small transactions", fourth round). ``compile_decoder``
picks each column's decoding once, when the table map is new, and writes one Python function
per table that reads a row image straight from the event's bytes (fixed widths with
``struct.unpack_from`` or byte arithmetic, the null bitmap read once per row image as one
integer, strings sliced and decoded with their charset's codec named once).

The values are exactly the library's after capture's repairs (``value_repairs``): same types,
same quirks (an empty binary string is ``''``, text decoded in its charset exactly by
``libs.codec.charsets``, as the library does once capture has fixed its columns, a SET is a
Python set, BIT is a string of 0/1, a zero date is None with the library's "none source"). What
it does not cover, it does not guess: a column type outside the list below makes
``compile_decoder`` return None and the table's rows go through the library as before; an event
it cannot take as laid out (partial row images, ``binlog_row_image`` other than FULL, a library
parse already started, a column count that differs from the map) and any error while decoding
(a value the library would refuse too, bytes that do not end where the event does) send that
event through the library, which then decodes it, or raises what it raises today.

Covered (MariaDB's binlog, v1 and v2 rows events): TINY/SHORT/INT24/LONG/LONGLONG signed and
unsigned, FLOAT, DOUBLE, NEWDECIMAL, YEAR, DATE, DATETIME2, TIMESTAMP2, TIME2, VARCHAR, STRING
(CHAR, BINARY), BLOB (every TEXT and BLOB size), ENUM, SET, BIT, GEOMETRY (every spatial type:
the stored bytes, MariaDB's internal format). Not covered (library path): the pre-5.6 temporal
types (DATETIME, TIME, TIMESTAMP), MySQL's binary JSON, and anything else.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pymysqlreplication.constants import BINLOG, FIELD_TYPE, NONE_SOURCE

from libs.codec.charsets import CODECS, codec_name, mariadb_charset
from services.capture.value_repairs import fix_negative_time2

T = FIELD_TYPE


@dataclass(frozen=True)
class ColumnLayout:
    """What decoding one column's values needs from the table map (the library's ``Column``
    attributes of the same names; ``layout_of`` copies them)."""

    name: str
    type: int
    unsigned: bool = False
    charset: str | None = None
    max_length: int = 0
    length_size: int = 0
    fsp: int = 0
    precision: int = 0
    decimals: int = 0
    bits: int = 0
    bytes: int = 0
    size: int = 0
    enum_values: tuple[str, ...] | None = None
    set_values: tuple[str, ...] | None = None


def layout_of(column: Any) -> ColumnLayout:
    """The layout of one of pymysqlreplication's table-map columns."""
    def num(attr: str) -> int:
        value = getattr(column, attr, 0)
        return int(value) if value is not None else 0

    enum_values = getattr(column, "enum_values", None)
    set_values = getattr(column, "set_values", None)
    name = column.name
    return ColumnLayout(
        name=name if isinstance(name, str) else "", type=int(column.type),
        unsigned=bool(getattr(column, "unsigned", False)),
        charset=getattr(column, "character_set_name", None), max_length=num("max_length"),
        length_size=num("length_size"), fsp=num("fsp"), precision=num("precision"),
        decimals=num("decimals"), bits=num("bits"), bytes=num("bytes"), size=num("size"),
        enum_values=tuple(enum_values) if enum_values is not None else None,
        set_values=tuple(set_values) if set_values is not None else None)


class Unsupported(Exception):
    """A column the compiled decoder does not cover: the table stays on the library's path."""


# ------------------------------------------------------------------ per-type decoding


_COMPRESSED = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)


def _fsp_reader(fsp: int) -> tuple[int, Callable[[bytes, int], int]]:
    """Bytes of a fractional part of ``fsp`` digits and its microseconds, as the library
    computes them (a signed big-endian read, ``int(x / 10)`` for odd precisions)."""
    width = (fsp + 1) // 2
    if width == 0:
        return 0, lambda data, p: 0
    odd = fsp % 2 == 1
    scale = 10 ** (6 - fsp)

    def read(data: bytes, p: int) -> int:
        micro = int.from_bytes(data[p:p + width], "big", signed=True)
        if odd:
            micro = int(micro / 10)
        return micro * scale
    return width, read


def _datetime2(col: ColumnLayout) -> Callable[[bytes, int], tuple[Any, int]]:
    width, frac = _fsp_reader(col.fsp)
    datetime = dt.datetime

    def read(data: bytes, p: int) -> tuple[Any, int]:
        v = int.from_bytes(data[p:p + 5], "big")
        p += 5
        year_month = v >> 22 & 0x1FFFF
        try:
            t = datetime(year_month // 13, year_month % 13, v >> 17 & 0x1F, v >> 12 & 0x1F,
                         v >> 6 & 0x3F, v & 0x3F)
        except ValueError:  # zero or invalid date: None, as the library
            return None, p + width
        micro = frac(data, p)
        if micro > 0:
            t = t.replace(microsecond=micro)
        return t, p + width
    return read


def _timestamp2(col: ColumnLayout) -> Callable[[bytes, int], tuple[Any, int]]:
    width, frac = _fsp_reader(col.fsp)
    from_seconds = dt.datetime.utcfromtimestamp

    def read(data: bytes, p: int) -> tuple[Any, int]:
        t = from_seconds(int.from_bytes(data[p:p + 4], "big", signed=True))
        p += 4
        micro = frac(data, p)
        if micro > 0:
            t = t.replace(microsecond=micro)
        return t, p + width
    return read


def _time2(col: ColumnLayout) -> Callable[[bytes, int], tuple[Any, int]]:
    width, frac = _fsp_reader(col.fsp)
    timedelta = dt.timedelta

    def read(data: bytes, p: int) -> tuple[Any, int]:
        d = int.from_bytes(data[p:p + 3], "big", signed=True)
        p += 3
        sign = 1 if d >> 23 & 1 else -1
        if sign == -1:
            d = ~d + 1
        t = timedelta(hours=d >> 12 & 0x3FF, minutes=d >> 6 & 0x3F, seconds=d & 0x3F,
                      microseconds=frac(data, p)) * sign
        return fix_negative_time2(t), p + width
    return read


def _date(t: int) -> dt.date | None:
    if t == 0:
        return None
    year, month, day = t >> 9 & 0x7FFF, t >> 5 & 0xF, t & 0x1F
    if year == 0 or month == 0 or day == 0:
        return None
    return dt.date(year, month, day)


def _newdecimal(col: ColumnLayout) -> Callable[[bytes, int], tuple[Any, int]]:
    integral = col.precision - col.decimals
    if integral < 0 or col.decimals < 0:
        raise Unsupported(f"DECIMAL({col.precision},{col.decimals})")
    whole_int, comp_int = divmod(integral, 9)
    whole_frac, comp_frac = divmod(col.decimals, 9)
    head, tail = _COMPRESSED[comp_int], _COMPRESSED[comp_frac]
    total = head + 4 * whole_int + 4 * whole_frac + tail
    frac_format = f"0{comp_frac}d"

    def read(data: bytes, p: int) -> tuple[Any, int]:
        b = bytearray(data[p:p + total])
        if len(b) != total:
            raise ValueError("decimal past the event's end")
        if b[0] & 0x80:
            res, mask = "", 0
        else:
            res, mask = "-", -1
        b[0] ^= 0x80
        q = 0
        if head:
            res += str(int.from_bytes(b[:head], "big", signed=True) ^ mask)
            q = head
        for _ in range(whole_int):
            res += f"{int.from_bytes(b[q:q + 4], 'big', signed=True) ^ mask:09d}"
            q += 4
        res += "."
        for _ in range(whole_frac):
            res += f"{int.from_bytes(b[q:q + 4], 'big', signed=True) ^ mask:09d}"
            q += 4
        if tail:
            res += format(int.from_bytes(b[q:q + tail], "big", signed=True) ^ mask, frac_format)
        return Decimal(res), p + total
    return read


def _bit(col: ColumnLayout) -> Callable[[bytes, int], tuple[Any, int]]:
    bits, width = col.bits, col.bytes
    if bits < 1 or width != (bits + 7) // 8:
        raise Unsupported(f"BIT of {bits} bits in {width} bytes")
    mask, spelling = (1 << bits) - 1, f"0{bits}b"

    def read(data: bytes, p: int) -> tuple[Any, int]:
        # The library's string of '0' and '1', the first byte's unused high bits left out.
        return format(int.from_bytes(data[p:p + width], "big") & mask, spelling), p + width
    return read


def _codec(charset: str | None) -> str | None:
    """The codec that decodes the charset exactly (``libs.codec.charsets``, the one the library
    decodes with once capture has fixed its columns); None for ``binary`` and for a charset
    capture cannot decode (the library keeps the bytes then, and ``describe`` refuses the
    column)."""
    if charset is None:
        return "utf-8"
    name = codec_name(charset)
    if name is not None and CODECS[mariadb_charset(charset) or ""] == "utf-8":
        return "utf-8"
    return name


# ------------------------------------------------------------------ compile


_STRUCTS = {
    (T.SHORT, False): ("<h", 2), (T.SHORT, True): ("<H", 2),
    (T.LONG, False): ("<i", 4), (T.LONG, True): ("<I", 4),
    (T.LONGLONG, False): ("<q", 8), (T.LONGLONG, True): ("<Q", 8),
    (T.FLOAT, False): ("<f", 4), (T.FLOAT, True): ("<f", 4),
    (T.DOUBLE, False): ("<d", 8), (T.DOUBLE, True): ("<d", 8),
}


def _length(size: int) -> list[str]:
    """Lines that read a little-endian length of ``size`` bytes into ``n``."""
    if size == 1:
        return ["n = data[p]", "p += 1"]
    if size == 2:
        return ["n = data[p] | data[p + 1] << 8", "p += 2"]
    if size in (3, 4):
        return [f"n = int.from_bytes(data[p:p + {size}], 'little')", f"p += {size}"]
    raise Unsupported(f"a length of {size} bytes")


class _Compiler:
    def __init__(self) -> None:
        self.globals: dict[str, Any] = {"NULL": NONE_SOURCE.NULL}
        self._structs: dict[str, str] = {}

    def bind(self, name: str, value: Any) -> str:
        self.globals[name] = value
        return name

    def unpacker(self, fmt: str) -> str:
        name = self._structs.get(fmt)
        if name is None:
            name = self._structs[fmt] = self.bind(f"S{len(self._structs)}", struct.Struct(fmt).unpack_from)
        return name

    def column(self, i: int, col: ColumnLayout) -> tuple[list[str], str | None]:
        """Lines that decode column ``i`` into ``v{i}`` and move ``p`` past it; and the none
        source of a None they may give for a non-NULL value (None: they never do)."""
        v = f"v{i}"
        t = col.type
        if (t, col.unsigned) in _STRUCTS:
            fmt, width = _STRUCTS[(t, col.unsigned)]
            return [f"{v} = {self.unpacker(fmt)}(data, p)[0]", f"p += {width}"], None
        if t == T.TINY:
            lines = [f"{v} = data[p]", "p += 1"]
            return (lines if col.unsigned else [*lines, f"if {v} > 127: {v} -= 256"]), None
        if t == T.INT24:
            lines = [f"{v} = data[p] | data[p + 1] << 8 | data[p + 2] << 16", "p += 3"]
            return (lines if col.unsigned else [*lines, f"if {v} >= 0x800000: {v} -= 0x1000000"]), None
        if t == T.YEAR:  # the byte + 1900, and 0 for the byte 0 (value_repairs.fix_year)
            return [f"{v} = data[p]", "p += 1", f"{v} = {v} + 1900 if {v} else 0"], None
        if t in (T.VARCHAR, T.STRING, T.BLOB):
            if t == T.BLOB:
                size = col.length_size
            else:
                size = 2 if col.max_length > 255 else 1
            lines = [*_length(size), f"{v} = data[p:p + n]", "p += n"]
            codec = _codec(col.charset)
            if codec is None:
                lines.append(f"if not n: {v} = ''")  # b''.decode(unknown) is '', as the library has it
            elif codec == "utf-8":
                lines.append(f"{v} = {v}.decode()")
            else:
                lines.append(f"{v} = {v}.decode({self.bind(f'C{i}', codec)})")
            if t == T.STRING and col.charset == "binary" and col.max_length > 0:
                from services.capture.value_repairs import binary_padder
                lines.append(f"{v} = {self.bind(f'P{i}', binary_padder(col.max_length))}({v})")
            return lines, None
        if t == T.GEOMETRY:
            # MariaDB's internal format (SRID + WKB) as the library reads it: the bytes after a
            # length of ``length_size`` bytes, never decoded as text.
            return [*_length(col.length_size), f"{v} = data[p:p + n]", "p += n"], None
        if t == T.DATE:
            return [f"{v} = {self.bind('DATE', _date)}(data[p] | data[p + 1] << 8 | data[p + 2] << 16)",
                    "p += 3"], NONE_SOURCE.OUT_OF_DATE_RANGE
        readers: dict[int, tuple[Callable[[ColumnLayout], Any], str | None]] = {
            T.DATETIME2: (_datetime2, NONE_SOURCE.OUT_OF_DATETIME2_RANGE),
            T.TIMESTAMP2: (_timestamp2, None), T.TIME2: (_time2, None),
            T.NEWDECIMAL: (_newdecimal, None), T.BIT: (_bit, None),
        }
        if t in readers:
            make, none = readers[t]
            return [f"{v}, p = {self.bind(f'R{i}', make(col))}(data, p)"], none
        if t == T.ENUM:
            if not col.enum_values or col.size not in (1, 2):
                raise Unsupported("ENUM without its members")
            index = "data[p]" if col.size == 1 else "data[p] | data[p + 1] << 8"
            return [f"{v} = {self.bind(f'E{i}', list(col.enum_values))}[{index}]",
                    f"p += {col.size}"], None
        if t == T.SET:
            if not col.set_values or not 1 <= col.size <= 8:
                raise Unsupported("SET without its members")
            members = self.bind(f"M{i}", tuple((1 << k, m) for k, m in enumerate(col.set_values)))
            return [f"n = int.from_bytes(data[p:p + {col.size}], 'little')", f"p += {col.size}",
                    f"{v} = {{m for bit, m in {members} if n & bit}} or None"], NONE_SOURCE.EMPTY_SET
        raise Unsupported(f"binlog column type {t}")


RowFunction = Callable[[bytes, int], tuple[dict[str, Any], dict[str, str], int]]


def compile_row(columns: Sequence[ColumnLayout]) -> RowFunction:
    """A function ``(data, p) -> (values, none_sources, p after the row image)`` for row images
    with every column present (FULL row image); raises ``Unsupported``."""
    if not columns:
        raise Unsupported("a table map without columns")
    names = [c.name for c in columns]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise Unsupported("column names missing from the table map")
    compiler = _Compiler()
    null_bytes = (len(columns) + 7) // 8
    body = ["nulls = data[p]" if null_bytes == 1 else
            f"nulls = int.from_bytes(data[p:p + {null_bytes}], 'little')",
            f"p += {null_bytes}", "ns = {}"]
    for i, col in enumerate(columns):
        lines, none = compiler.column(i, col)
        name = compiler.bind(f"N{i}", col.name)
        body.append(f"if nulls & {1 << i}:")
        body.append(f"    v{i} = None")
        body.append(f"    ns[{name}] = NULL")
        body.append("else:")
        body.extend("    " + line for line in lines)
        if none is not None:
            body.append(f"    if v{i} is None: ns[{name}] = {compiler.bind(f'Z{i}', none)}")
    items = ", ".join(f"N{i}: v{i}" for i in range(len(columns)))
    body.append(f"return {{{items}}}, ns, p")
    source = "def row(data, p):\n" + "".join(f"    {line}\n" for line in body)
    namespace = dict(compiler.globals)
    exec(compile(source, "<rows_decode>", "exec"), namespace)  # our own generated source
    row: RowFunction = namespace["row"]
    return row


_V2 = frozenset((BINLOG.WRITE_ROWS_EVENT_V2, BINLOG.UPDATE_ROWS_EVENT_V2, BINLOG.DELETE_ROWS_EVENT_V2))
_V1 = frozenset((BINLOG.WRITE_ROWS_EVENT_V1, BINLOG.UPDATE_ROWS_EVENT_V1, BINLOG.DELETE_ROWS_EVENT_V1))


class RowsDecoder:
    """A table map's compiled decoder: ``images`` of one rows event, or None for the library."""

    def __init__(self, columns: Sequence[ColumnLayout]) -> None:
        self.columns = tuple(columns)
        self.row = compile_row(self.columns)
        self._present = (1 << len(self.columns)) - 1

    def decode(self, op: str, data: bytes, pos: int, end: int) -> list[tuple[Any, ...]]:
        """Row images from ``data[pos:end]`` (the event's rows, after its bitmaps): per row
        ``(values, none_sources)``, an update's as ``(before, before_none, after, after_none)``.
        Raises when the bytes do not decode to exactly ``end``."""
        row = self.row
        out: list[tuple[Any, ...]] = []
        if op == "update":
            while pos < end:
                before, before_none, pos = row(data, pos)
                after, after_none, pos = row(data, pos)
                out.append((before, before_none, after, after_none))
        else:
            while pos < end:
                values, none, pos = row(data, pos)
                out.append((values, none))
        if pos != end:
            raise ValueError("row images do not end where the rows event does")
        return out

    def body(self, event: Any) -> tuple[bytes, int, int] | None:
        """The event's row bytes ``(data, start, end)``, or None when the event is not laid out
        as this decoder reads it (the library then parses it)."""
        if event.event_type not in _V2 and event.event_type not in _V1:
            return None
        if getattr(event, "_ignore_decode_errors", False) or not getattr(event, "complete", True):
            return None
        if getattr(event, "_RowsEvent__rows", None) is not None:
            return None  # the library's parse has started: the packet is no longer at the rows
        wrapper = event.packet
        if getattr(wrapper, "_BinLogPacketWrapper__data_buffer", b"") != b"":
            return None
        if event.number_of_columns != len(self.columns):
            return None
        bitmaps = [event.columns_present_bitmap]
        if hasattr(event, "columns_present_bitmap2"):
            bitmaps.append(event.columns_present_bitmap2)
        present = self._present
        if any(int.from_bytes(b, "little") & present != present for b in bitmaps):
            return None  # not a FULL row image: COLS_BITMAP none sources, the library's case
        packet = getattr(wrapper, "packet", None)
        data = getattr(packet, "_data", None)
        start = getattr(packet, "_position", None)
        if not isinstance(data, bytes) or not isinstance(start, int):
            return None
        end = start + int(event.event_size) - int(wrapper.read_bytes)
        if end < start or end > len(data):
            return None
        return data, start, end


def compile_decoder(columns: Sequence[Any]) -> RowsDecoder | None:
    """The decoder for a table map's columns (pymysqlreplication's ``Column`` objects or
    ``ColumnLayout``s); None when a column is not covered (the library decodes the table)."""
    layouts = [c if isinstance(c, ColumnLayout) else layout_of(c) for c in columns]
    try:
        return RowsDecoder(layouts)
    except Unsupported:
        return None
