"""The exact decoding of each MariaDB character set, for string, ENUM and SET values read from
the binlog.

pymysqlreplication names a column's charset by pymysql's encoding and decodes with the Python
codec of that name, which is wrong for several of MariaDB's: ``utf16`` and ``utf32`` are
big-endian in MariaDB but Python's ``utf16``/``utf32`` without a BOM are little-endian (a utf16
'añ😀' came out as '愀\\uf100㷘Þ'), ``ucs2``, ``swe7``, ``dec8`` ... have no Python codec (the
value stays bytes), and ``latin1`` (Python's cp1252), ``greek``, ``hebrew``, ``koi8u``, ``cp866``
differ from MariaDB on a few bytes. This module registers one codec per charset capture can
decode exactly, named ``mariadb_<charset>``: the single-byte charsets by MariaDB's own byte
tables (``charset_tables``), the Unicode ones by Python's codec of the right byte order, the
multi-byte Asian ones by the Python codec that agrees with MariaDB on the characters
``tests/test_charsets.py`` round-trips through a live server. A charset outside ``CODECS`` is
refused: capture stops the table with an ``unsupported_type`` incident naming the column and
the charset, never hands on undecoded or misdecoded text.
"""

from __future__ import annotations

import codecs
from typing import Any

from libs.codec.charset_tables import ERRORS, INEXACT, SINGLE_BYTE, TRANSLATE

PREFIX = "mariadb_"

# MariaDB charset -> the Python codec that decodes it exactly.
_UNICODE = {
    "utf8mb3": "utf-8", "utf8mb4": "utf-8",
    "utf16": "utf-16-be", "utf16le": "utf-16-le", "utf32": "utf-32-be",
    # UCS-2 holds BMP code points only, big-endian: UTF-16BE without surrogate pairs.
    "ucs2": "utf-16-be",
}
MULTI_BYTE_BASE = {
    "big5": "cp950", "cp932": "cp932", "euckr": "cp949", "eucjpms": "euc_jp", "gb2312": "gb2312",
    "gbk": "gbk", "sjis": "shift_jis", "ujis": "euc_jp",
}
"""The Python codec each multi-byte charset is decoded with, corrected where MariaDB differs
(``charset_tables.ERRORS`` and ``TRANSLATE``)."""

CODECS: dict[str, str] = {
    **_UNICODE,
    **{n: base for n, base in MULTI_BYTE_BASE.items() if n not in INEXACT},
    **{n: PREFIX + n for n in SINGLE_BYTE},
}
"""Every charset capture decodes exactly; any other (``charset_tables.INEXACT``, charsets of
servers newer than the tables) is refused."""

# pymysqlreplication's spelling of a charset (its ``Charset.encoding``) where it is not the name.
_LIBRARY_NAMES = {"utf8": "utf8mb4", "cp1252": "latin1", "koi8_r": "koi8r", "koi8_u": "koi8u"}


def mariadb_charset(library_name: str | None) -> str | None:
    """The MariaDB charset of a column whose charset pymysqlreplication spells ``library_name``
    (``character_set_name``; also our own ``mariadb_<charset>`` spelling)."""
    if library_name is None:
        return None
    name = library_name.lower()
    if name.startswith(PREFIX):
        return name[len(PREFIX):]
    return _LIBRARY_NAMES.get(name, name)


def codec_name(library_name: str | None) -> str | None:
    """The codec name to decode a column with (``mariadb_<charset>``), or None when capture
    cannot decode its charset exactly (or it is ``binary``: bytes, no charset)."""
    charset = mariadb_charset(library_name)
    if charset is None or charset not in CODECS:
        return None
    return PREFIX + charset


def decodable(library_name: str | None) -> bool:
    """Whether a text column of this charset decodes exactly (None: no charset in the table map,
    which pymysqlreplication decodes as UTF-8, MariaDB's own default)."""
    return library_name is None or library_name == "binary" or codec_name(library_name) is not None


def _single_byte(table: str) -> codecs.CodecInfo:
    decoding = table  # charmap_decode takes the str; U+FFFE marks an undefined byte
    encoding = codecs.charmap_build(table.replace("\ufffe", "\ufffd"))

    def encode(text: str, errors: str = "strict") -> tuple[bytes, int]:
        return codecs.charmap_encode(text, errors, encoding)

    def decode(data: Any, errors: str = "strict") -> tuple[str, int]:
        return codecs.charmap_decode(data, errors, decoding)
    return codecs.CodecInfo(encode, decode, name="mariadb_single_byte")


def _multi_byte(charset: str, base: str) -> codecs.CodecInfo:
    found = codecs.lookup(base)
    overrides = ERRORS.get(charset, {})
    table = str.maketrans(TRANSLATE.get(charset, {}))
    handler = PREFIX + charset

    def on_error(exc: UnicodeError) -> tuple[str, int]:
        # A sequence the Python codec refuses but MariaDB maps (user-defined areas, ...).
        if isinstance(exc, UnicodeDecodeError):
            data = bytes(exc.object)
            for width in (3, 2, 1):
                seq = data[exc.start:exc.start + width]
                char = overrides.get(seq.hex()) if len(seq) == width else None
                if char is not None:
                    return char, exc.start + width
        raise exc

    codecs.register_error(handler, on_error)

    def decode(data: Any, errors: str = "strict") -> tuple[str, int]:
        if errors != "strict":
            return found.decode(data, errors)
        text, used = found.decode(data, handler)
        return (text.translate(table) if table else text), used
    return codecs.CodecInfo(found.encode, decode, name=PREFIX + charset)


def _search(name: str) -> codecs.CodecInfo | None:
    if not name.startswith(PREFIX):
        return None
    charset = name[len(PREFIX):]
    if charset in SINGLE_BYTE:
        info = _single_byte(SINGLE_BYTE[charset])
        return codecs.CodecInfo(info.encode, info.decode, name=name)
    base = CODECS.get(charset)
    if base is None:
        return None
    if charset in MULTI_BYTE_BASE:
        return _multi_byte(charset, base)
    found = codecs.lookup(base)
    return codecs.CodecInfo(found.encode, found.decode, name=name,
                            incrementalencoder=found.incrementalencoder,
                            incrementaldecoder=found.incrementaldecoder)


codecs.register(_search)


def decode(data: bytes, library_name: str | None) -> str:
    """``data`` of a column whose charset the library spells ``library_name``, decoded exactly;
    raises ``LookupError`` for a charset capture cannot decode."""
    name = codec_name(library_name)
    if name is None:
        raise LookupError(f"character set {mariadb_charset(library_name)}")
    return data.decode(name)


def fix_library_columns(columns: Any) -> None:
    """Make pymysqlreplication decode a table map's text columns exactly: each column's
    ``character_set_name`` becomes the ``mariadb_<charset>`` codec (the library decodes with a
    codec of that name, for lack of a pymysql charset so named), and ENUM/SET members, which the
    library decodes as UTF-8 (a member that is not UTF-8 becomes ''), are decoded again in the
    column's charset. Done once per column list (the table-map cache shares it between maps):
    ``binlog_charset`` keeps the library's original spelling. A column whose charset capture
    cannot decode keeps it (its values stay bytes, or misdecoded members), and ``describe``
    refuses it."""
    for c in columns:
        if hasattr(c, "binlog_charset"):
            continue
        original = getattr(c, "character_set_name", None)
        c.binlog_charset = original
        if original is None or original == "binary":
            continue
        name = codec_name(original)
        if name is None:
            continue
        c.character_set_name = name
        if CODECS[mariadb_charset(original) or ""] == "utf-8":
            continue
        for attr in ("enum_values", "set_values"):
            members = getattr(c, attr, None)
            if members:
                setattr(c, attr, [_member(m, name) for m in members])


def _member(value: str, name: str) -> str:
    # The library's UTF-8 decoding succeeded (it is injective) or gave '' (kept: the library's
    # invalid-value member, a declared '' or a name it could not decode, which describe refuses).
    try:
        return value.encode("utf-8").decode(name)
    except UnicodeError:
        return value


def original_charset(column: Any) -> str | None:
    """A library column's charset as pymysqlreplication spelled it (before ``fix_library_columns``)."""
    if hasattr(column, "binlog_charset"):
        value: str | None = column.binlog_charset
        return value
    return getattr(column, "character_set_name", None)
