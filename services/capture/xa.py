"""XA transactions as the server runs them: a prepared group's rows wait, keyed by XID, for
the XA COMMIT or XA ROLLBACK that may come much later, from another connection, after other
transactions committed.

The binlog writes a two-phase XA transaction as two event groups: the prepared group (its rows,
``XA END``, an XA_PREPARE event) and, later, a group holding only ``XA COMMIT <xid>`` or
``XA ROLLBACK <xid>``. ``XaBook`` keeps the prepared groups' row parts (cut by the pipeline as
it cuts any transaction's parts) until that decision. Parts stay in memory up to a budget shared
by all prepared transactions; beyond it they go to one unlinked temporary file per transaction,
so a large or long-undecided XA transaction costs disk, not memory.

Pure logic and the spill file; no binlog, no NATS. The pipeline decides what to publish.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from contracts.events.rows import RowImageV2
from libs.codec.table_meta import TableInfo
from services.capture.binlog_reader import Position

TableKey = tuple[str, str]
XaVerb = Literal["start", "end", "prepare", "commit", "rollback", "other"]

# ------------------------------------------------------------------ XIDs and statements

_VERB = re.compile(r"\s*XA\s+(START|BEGIN|END|PREPARE|COMMIT|ROLLBACK|RECOVER)\b(.*)$",
                   re.IGNORECASE | re.DOTALL)
# One XID part as the server may spell it: X'hex', 0xhex, 'text' or "text" (doubled quotes).
_PART = re.compile(r"""\s*(?:[xX]'([0-9a-fA-F]*)'|0x([0-9a-fA-F]+)|'((?:[^']|'')*)'|"((?:[^"]|"")*)")""")
_VERBS: dict[str, XaVerb] = {"START": "start", "BEGIN": "start", "END": "end", "PREPARE": "prepare",
                             "COMMIT": "commit", "ROLLBACK": "rollback"}
_FORMAT = re.compile(r"\s*(\d+)")
_TRAILER = re.compile(r"\s*(ONE\s+PHASE|JOIN|RESUME|SUSPEND(?:\s+FOR\s+MIGRATE)?)?\s*;?\s*$",
                      re.IGNORECASE)


def canonical_xid(gtrid: bytes, bqual: bytes = b"", format_id: int = 1) -> str:
    """The XID as the server writes it into its binlog: ``X'<gtrid>',X'<bqual>',<formatID>``
    (lowercase hex), whichever way the client spelt it: the key prepared rows are kept by."""
    return f"X'{gtrid.hex()}',X'{bqual.hex()}',{format_id}"


def _part(text: str, at: int) -> tuple[bytes, int] | None:
    m = _PART.match(text, at)
    if m is None:
        return None
    hex_a, hex_b, single, double = m.groups()
    if hex_a is not None or hex_b is not None:
        digits = hex_a if hex_a is not None else hex_b
        assert digits is not None
        if len(digits) % 2:
            digits = "0" + digits
        return bytes.fromhex(digits), m.end()
    if single is not None:
        return single.replace("''", "'").encode("utf-8"), m.end()
    assert double is not None
    return double.replace('""', '"').encode("utf-8"), m.end()


_COMMA = re.compile(r"\s*,")


def _comma(text: str, at: int) -> int | None:
    m = _COMMA.match(text, at)
    return m.end() if m else None


@dataclass(frozen=True)
class XaStatement:
    verb: XaVerb
    xid: str | None = None
    one_phase: bool = False


def parse_xa(query: str) -> XaStatement | None:
    """What an ``XA ...`` statement of the binlog does, with its canonical XID; None when the
    query is no XA statement. An XID that does not parse gives ``xid=None`` (never a guess)."""
    m = _VERB.match(query)
    if m is None:
        return None
    word = m.group(1).upper()
    verb = _VERBS.get(word, "other")
    rest = m.group(2)
    first = _part(rest, 0)
    if first is None:
        return XaStatement(verb)
    gtrid, at = first
    bqual, format_id = b"", 1
    after = _comma(rest, at)
    if after is not None:
        second = _part(rest, after)
        if second is None:
            return XaStatement(verb)
        bqual, at = second
        after = _comma(rest, at)
        if after is not None:
            fm = _FORMAT.match(rest, after)
            if fm is None:
                return XaStatement(verb)
            format_id, at = int(fm.group(1)), fm.end()
    trailer = _TRAILER.match(rest, at)
    if trailer is None:
        return XaStatement(verb)
    one_phase = bool(trailer.group(1)) and trailer.group(1).upper().startswith("ONE")
    return XaStatement(verb, canonical_xid(gtrid, bqual, format_id), one_phase)


# ------------------------------------------------------------------ prepared transactions

@dataclass
class _Part:
    rows: list[RowImageV2] | None  # None: in the spill file at (offset, length)
    offset: int = 0
    length: int = 0
    size: int = 0  # approximate bytes while in memory


@dataclass
class XaTable:
    info: TableInfo
    position: Position  # of the latest rows event of the table
    parts: list[_Part] = field(default_factory=list)


@dataclass
class PreparedXa:
    """One XA transaction's rows, from its group's start to its decision."""

    begin: Position
    """Where its group starts: a capture that must find it again reads the binlog from here."""
    xid: str | None = None
    tables: dict[TableKey, XaTable] = field(default_factory=dict)
    _spill: IO[bytes] | None = None

    @property
    def rows(self) -> bool:
        return any(t.parts for t in self.tables.values())

    def parts(self, key: TableKey) -> Iterator[list[RowImageV2]]:
        """The table's parts in the order they were cut (read back from the spill file)."""
        for part in self.tables[key].parts:
            if part.rows is not None:
                yield part.rows
            else:
                assert self._spill is not None
                self._spill.seek(part.offset)
                yield [_decode(r) for r in json.loads(self._spill.read(part.length))]

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None


def _encode(rows: list[RowImageV2]) -> bytes:
    return json.dumps([[r.op, r.before, r.after, r.ordinal] for r in rows],
                      separators=(",", ":")).encode("utf-8")


def _decode(raw: list[Any]) -> RowImageV2:
    op, before, after, ordinal = raw
    return RowImageV2.model_construct(op=op, before=before, after=after, ordinal=ordinal)


@dataclass(frozen=True)
class XaResume:
    """What a resolved mark records of the XA transactions prepared before it and undecided at
    it: where the oldest one's group starts, and their XIDs."""

    begin: Position
    xids: tuple[str, ...]

    def header(self) -> str:
        return json.dumps({"file": self.begin.file, "pos": self.begin.pos, "xids": list(self.xids)},
                          separators=(",", ":"))

    @classmethod
    def from_header(cls, value: str) -> XaResume:
        data = json.loads(value)
        return cls(Position(str(data["file"]), int(data["pos"])), tuple(str(x) for x in data["xids"]))


class XaBook:
    """Prepared XA transactions by XID, with the memory budget their in-memory parts share."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.in_memory = 0
        self.spilled = 0
        self._prepared: dict[str, PreparedXa] = {}

    def open(self, begin: Position) -> PreparedXa:
        """A new XA group is being read (not in the book until its XA PREPARE)."""
        return PreparedXa(begin)

    def add(self, txn: PreparedXa, key: TableKey, info: TableInfo, position: Position,
            rows: list[RowImageV2], size: int) -> None:
        """One part of ``key``'s rows, as the pipeline cut it."""
        table = txn.tables.get(key)
        if table is None:
            table = txn.tables[key] = XaTable(info, position)
        table.position = position
        if self.in_memory + size <= self.memory_bytes:
            table.parts.append(_Part(list(rows), size=size))
            self.in_memory += size
            return
        if txn._spill is None:
            txn._spill = tempfile.TemporaryFile(prefix="sluice-xa-")  # unlinked: gone with us
        data = _encode(rows)
        txn._spill.seek(0, 2)
        offset = txn._spill.tell()
        txn._spill.write(data)
        txn._spill.flush()
        table.parts.append(_Part(None, offset, len(data)))
        self.spilled += len(data)

    def prepare(self, xid: str, txn: PreparedXa) -> PreparedXa | None:
        """XA PREPARE: ``txn`` waits for its decision. Returns a transaction it replaced (the
        server never prepares one XID twice; a replaced one is dropped, and said so by the
        caller)."""
        txn.xid = xid
        old = self._prepared.pop(xid, None)
        if old is not None:
            self.release(old)
        self._prepared[xid] = txn
        return old

    def take(self, xid: str) -> PreparedXa | None:
        """XA COMMIT: the transaction leaves the book; the caller publishes it, then ``release``s."""
        return self._prepared.pop(xid, None)

    def rollback(self, xid: str) -> bool:
        txn = self._prepared.pop(xid, None)
        if txn is None:
            return False
        self.release(txn)
        return True

    def release(self, txn: PreparedXa) -> None:
        """Free what ``txn`` holds (memory budget, spill file)."""
        for table in txn.tables.values():
            for part in table.parts:
                if part.rows is not None:
                    self.in_memory -= part.size
                else:
                    self.spilled -= part.length
            table.parts.clear()
        txn.close()

    def retain(self, xids: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """Keep only ``xids``: (the ones missing from the book, the ones dropped from it)."""
        wanted = set(xids)
        dropped = sorted(x for x in self._prepared if x not in wanted)
        for xid in dropped:
            self.rollback(xid)
        return sorted(wanted - set(self._prepared)), dropped

    def resume(self) -> XaResume | None:
        """What a resolved mark must record now (None: nothing prepared is waiting)."""
        if not self._prepared:
            return None
        begin = min((t.begin for t in self._prepared.values()), key=lambda p: (p.file, p.pos))
        return XaResume(begin, tuple(sorted(self._prepared)))

    def __len__(self) -> int:
        return len(self._prepared)

    def __contains__(self, xid: object) -> bool:
        return xid in self._prepared

    def close(self) -> None:
        for txn in self._prepared.values():
            self.release(txn)
        self._prepared.clear()
