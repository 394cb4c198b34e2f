"""Every character set of a live MariaDB (``SHOW CHARACTER SET``) decodes exactly as the server
converts it, or capture refuses it: representative characters (supplementary-plane ones where
the charset holds them) round-trip through the server's bytes, and the committed byte tables
(``libs.codec.charset_tables``) are still what the server answers."""

from __future__ import annotations

import pytest

from libs.codec import charset_tables, charsets
from libs.localservers.mariadb import MariaDB
from tests.helpers.charset_tables import tables

pytestmark = pytest.mark.integration

# Letters of many scripts, the characters Japanese and Chinese charsets map in more than one
# way, the C1 bytes latin1 keeps, and supplementary-plane characters.
CANDIDATES = ("a", "~", "\\", "'", "¥", "‾", "é", "ñ", "ÿ", "€", "Ø", "Ж", "α", "ש", "ع", "ก",  # noqa: RUF001
              "Ա", "ა", "中", "한", "갂", "ア", "ｱ", "〜", "～", "−", "¬", "‖", "①", "髙", "碁",  # noqa: RUF001
              "\ue000", "\x81", "Å", "ü", "ß", "č", "ą", "ğ", "ő", "ā", "ď", "😀", "𠀋", "\U0010ffff")


def test_every_charset_decodes_exactly_or_is_refused(mariadb: MariaDB) -> None:
    conn = mariadb.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW CHARACTER SET")
            names = sorted(str(r[0]) for r in cur.fetchall() if r[0] != "binary")
            assert len(names) >= 39
            refused = [n for n in names if charsets.codec_name(n) is None]
            assert refused == sorted(charset_tables.INEXACT), refused
            for name in names:
                held: list[tuple[str, bytes]] = []
                for ch in CANDIDATES:
                    cur.execute(f"SELECT HEX(CONVERT(%s USING {name})),"
                                f" BINARY CONVERT(CONVERT(%s USING {name}) USING utf8mb4) = BINARY %s",
                                (ch, ch, ch))
                    hexed, same = cur.fetchone()
                    if same:
                        held.append((ch, bytes.fromhex(hexed)))
                assert len(held) >= 4, name
                if name in refused:
                    continue
                for ch, raw in held:
                    assert charsets.decode(raw, name) == ch, (name, ch, raw.hex())
                text = "".join(ch for ch, _ in held)
                assert charsets.decode(b"".join(raw for _, raw in held), name) == text, name
                if name in ("utf8mb4", "utf16", "utf16le", "utf32"):
                    assert "😀" in text and "\U0010ffff" in text, name
    finally:
        conn.close()


def test_the_committed_tables_are_what_the_server_answers(mariadb: MariaDB) -> None:
    found = tables(mariadb)
    assert found["single"] == charset_tables.SINGLE_BYTE
    assert found["errors"] == charset_tables.ERRORS
    assert found["translate"] == charset_tables.TRANSLATE
    assert frozenset(found["inexact"]) == charset_tables.INEXACT
