"""``libs.codec.charsets``: each MariaDB character set decoded exactly, or refused by name.

pymysqlreplication decodes MariaDB's big-endian utf16 with Python's little-endian codec (utf16
'añ😀' became '愀\\uf100㷘Þ', and 'Ø' would not decode at all) and leaves ucs2 and swe7 as
bytes; these tests pin the fix on both decode paths without a server (``test_charsets_server``
checks the tables against a live MariaDB)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pymysqlreplication.constants import FIELD_TYPE
from pymysqlreplication.row_event import RowsEvent

from libs.codec import charsets
from libs.codec.table_meta import BinlogColumn, ColumnSpec, TableInfo, describe
from services.capture.rows_decode import ColumnLayout, compile_row

UNICODE_CASES = ("añ😀", "Ø", "\U0010ffff\U00020000", "", "a  ")


@pytest.mark.parametrize("charset,codec", [("utf16", "utf-16-be"), ("utf16le", "utf-16-le"),
                                           ("utf32", "utf-32-be")])
@pytest.mark.parametrize("text", UNICODE_CASES)
def test_unicode_charsets_decode_in_their_byte_order(charset: str, codec: str, text: str) -> None:
    assert charsets.decode(text.encode(codec), charset) == text


def test_ucs2_is_big_endian_bmp() -> None:
    assert charsets.decode("añ€Ø中".encode("utf-16-be"), "ucs2") == "añ€Ø中"


def test_swe7_is_mapped_explicitly() -> None:
    # swe7 is ASCII with ten letters in place of @[\\]^`{|}~ (MariaDB's own table).
    assert charsets.decode(b"@[\\]^`{|}~az", "swe7") == "ÉÄÖÅÜéäöåüaz"
    with pytest.raises(UnicodeDecodeError):
        charsets.decode(b"\x80", "swe7")  # a byte swe7 does not define: refused, not guessed


def test_single_byte_charsets_are_mariadbs_tables_not_pythons_codecs() -> None:
    assert charsets.decode(b"\x80\x81\xff", "latin1") == "€\x81ÿ"  # cp1252 has no 0x81
    assert charsets.decode(b"\xaf", "hebrew") == "‾"  # Python's iso8859_8 says '¯'
    assert charsets.decode(b"\x95", "koi8u") == "•"  # Python's koi8_u says '∙'


def test_multi_byte_charsets_follow_mariadb_where_python_differs() -> None:
    assert charsets.decode(b"\x81\x5f", "sjis") == "\\"  # Python's shift_jis says '＼'  # noqa: RUF003
    assert charsets.decode(b"a\xf5\xa1b", "ujis") == "a\ue000b"  # user-defined area
    assert charsets.decode("갂".encode("cp949"), "euckr") == "갂"  # MariaDB's euckr is UHC
    assert charsets.decode("中文ｱ".encode("cp932"), "cp932") == "中文ｱ"


def test_the_librarys_spellings_map_to_mariadb_charsets() -> None:
    assert charsets.mariadb_charset("utf8") == "utf8mb4"
    assert charsets.mariadb_charset("cp1252") == "latin1"
    assert charsets.mariadb_charset("koi8_r") == "koi8r"
    assert charsets.mariadb_charset("mariadb_utf16") == "utf16"
    assert charsets.codec_name("utf16") == "mariadb_utf16"
    assert charsets.codec_name("binary") is None
    assert charsets.codec_name("eucjpms") is None
    assert charsets.decodable(None) and charsets.decodable("binary") and charsets.decodable("swe7")
    assert not charsets.decodable("eucjpms") and not charsets.decodable("no_such_charset")
    with pytest.raises(LookupError, match="character set eucjpms"):
        charsets.decode(b"a", "eucjpms")


def _library_column(name: str, charset: str, **more: object) -> SimpleNamespace:
    return SimpleNamespace(name=name, type=FIELD_TYPE.VARCHAR, character_set_name=charset, **more)


def test_the_librarys_columns_decode_exactly_once_fixed() -> None:
    cols = [_library_column("u16", "utf16"), _library_column("u8", "utf8"),
            _library_column("b", "binary"), _library_column("ms", "eucjpms"),
            _library_column("e", "utf16", enum_values=["", "\x00a", "\x00b"]),
            _library_column("s", "cp1252", set_values=["x", ""])]
    charsets.fix_library_columns(cols)
    charsets.fix_library_columns(cols)  # the table-map cache hands the same list again
    assert [c.character_set_name for c in cols] == [
        "mariadb_utf16", "mariadb_utf8mb4", "binary", "eucjpms", "mariadb_utf16", "mariadb_latin1"]
    assert [charsets.original_charset(c) for c in cols] == [
        "utf16", "utf8", "binary", "eucjpms", "utf16", "cp1252"]
    assert cols[4].enum_values == ["", "a", "b"]
    assert cols[5].set_values == ["x", ""]
    # The library decodes a string with the codec its charset_to_encoding names.
    encoding = RowsEvent.charset_to_encoding(cols[0].character_set_name)
    assert "añ😀Ø".encode("utf-16-be").decode(encoding) == "añ😀Ø"


@pytest.mark.parametrize("charset", ["utf16", "mariadb_utf16", "utf16le", "utf32", "ucs2", "swe7",
                                     "latin1", "cp1252", "sjis", "utf8", None])
def test_the_compiled_decoder_decodes_each_charset_exactly(charset: str | None) -> None:
    name = charsets.mariadb_charset(charset) or "utf8mb4"
    text = {"swe7": "ÅÄÖé", "ucs2": "añ€", "latin1": "é€\x81", "cp1252": "é€\x81",
            "sjis": "中\\ｱ"}.get(name, "añ😀")
    codec = "utf-8" if name in ("utf8mb4", "utf8") else charsets.codec_name(name)
    assert codec is not None
    raw = text.encode("utf-8") if codec == "utf-8" else _encode(text, name)
    row = compile_row([ColumnLayout(name="c", type=FIELD_TYPE.VARCHAR, charset=charset,
                                    max_length=40)])
    values, _, end = row(bytes([0, len(raw)]) + raw, 0)
    assert values == {"c": text} and end == 2 + len(raw)


def _encode(text: str, charset: str) -> bytes:
    """``text`` as MariaDB stores it in ``charset`` (the inverse of the tables, for the test)."""
    from libs.codec.charset_tables import SINGLE_BYTE

    if charset in SINGLE_BYTE:
        return bytes(SINGLE_BYTE[charset].index(ch) for ch in text)
    if charset == "sjis":
        return b"".join(b"\x81\x5f" if ch == "\\" else ch.encode("shift_jis") for ch in text)
    return text.encode({"ucs2": "utf-16-be", "utf16": "utf-16-be", "utf16le": "utf-16-le",
                        "utf32": "utf-32-be"}[charset])


def test_a_charset_capture_cannot_decode_stops_the_table_naming_column_and_charset() -> None:
    columns = [BinlogColumn("id", FIELD_TYPE.LONG, is_primary=True, key_part=0, nullable=False),
               BinlogColumn("ok", FIELD_TYPE.VARCHAR, charset="utf16"),
               BinlogColumn("ms", FIELD_TYPE.VARCHAR, charset="eucjpms"),
               BinlogColumn("e", FIELD_TYPE.ENUM, charset="eucjpms", enum_values=("", "a"))]
    binlog_only = describe("d", "t", columns, None)
    catalog = TableInfo("d", "t", (ColumnSpec("id", "int", "int(11)", False),
                                   ColumnSpec("ok", "string", "varchar(10)"),
                                   ColumnSpec("ms", "string", "varchar(10)"),
                                   ColumnSpec("e", "string", "enum('a')")), ("id",), (), True)
    for info in (binlog_only, describe("d", "t", columns, catalog)):
        bad = {c.name: c.sql_type for c in info.unsupported()}
        assert set(bad) == {"ms", "e"}, info
        assert all("character set eucjpms" in t and "cannot decode" in t for t in bad.values())
