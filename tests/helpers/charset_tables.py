"""Writes ``libs/codec/charset_tables.py`` from a live MariaDB: how the server itself converts
every byte sequence of its character sets to utf8mb4.

``python -m tests.helpers.charset_tables libs/codec/charset_tables.py`` starts a private
MariaDB, asks it for each single-byte charset's 256 characters and, for each multi-byte charset
capture decodes with a Python codec (``charsets.MULTI_BYTE_BASE``), every one-, two- (and for the
EUC charsets three-) byte sequence; it keeps where the server and the Python codec disagree:
sequences the codec refuses (``errors``) and characters the codec gives for one sequence where
the server gives another (``translate``, kept only when the codec gives that character for no
other sequence, so a translation cannot hit the wrong one). A charset where that does not hold
is written to ``INEXACT`` and refused by capture.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from libs.localservers.mariadb import MariaDB


def _server_chars(cur: Any, charset: str, seqs: list[bytes]) -> Iterator[tuple[bytes, str | None]]:
    """Each sequence with the one character the server converts it to, None when it has none."""
    for i in range(0, len(seqs), 400):
        chunk = seqs[i:i + 400]
        cur.execute("SELECT " + ",".join(
            f"HEX(CONVERT(CONVERT(UNHEX('{b.hex()}') USING {charset}) USING utf8mb4))" for b in chunk))
        for seq, hexed in zip(chunk, cur.fetchone(), strict=True):
            text = bytes.fromhex(hexed).decode() if hexed is not None else None
            if text is None or len(text) != 1 or text == "\ufffd" or (text == "?" and seq != b"?"):
                yield seq, None
            else:
                yield seq, text


def _sequences(charset: str) -> list[bytes]:
    seqs = [bytes([b]) for b in range(256)]
    seqs += [bytes([lead, trail]) for lead in range(0x81, 0xFF) for trail in range(0x40, 0xFF)]
    if charset in ("ujis", "eucjpms"):
        seqs += [bytes([0x8F, lead, trail]) for lead in range(0xA1, 0xFF) for trail in range(0xA1, 0xFF)]
    return seqs


def tables(server: MariaDB) -> dict[str, Any]:
    from libs.codec.charsets import MULTI_BYTE_BASE

    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW CHARACTER SET")
            charsets = sorted((str(r[0]), int(r[3])) for r in cur.fetchall())
            single: dict[str, str] = {}
            for name, maxlen in charsets:
                if maxlen == 1 and name != "binary":
                    chars = _server_chars(cur, name, [bytes([b]) for b in range(256)])
                    single[name] = "".join(c if c is not None else "\ufffe" for _, c in chars)
            errors: dict[str, dict[str, str]] = {}
            translate: dict[str, dict[str, str]] = {}
            inexact: list[str] = []
            for name, base in sorted(MULTI_BYTE_BASE.items()):
                errs: dict[str, str] = {}
                trans: dict[str, str] = {}
                produced: dict[str, int] = {}
                for seq, server_char in _server_chars(cur, name, _sequences(name)):
                    try:
                        mine: str | None = seq.decode(base)
                    except UnicodeDecodeError:
                        mine = None
                    if mine is not None and len(mine) == 1:
                        produced[mine] = produced.get(mine, 0) + 1
                    if server_char is None or mine == server_char:
                        continue
                    if mine is None:
                        errs[seq.hex()] = server_char
                    elif len(mine) == 1:
                        trans[mine] = server_char
                    else:
                        inexact.append(name)
                if name not in inexact and any(produced.get(p, 0) > 1 for p in trans):
                    inexact.append(name)
                errors[name], translate[name] = errs, trans
            return {"single": single, "errors": errors, "translate": translate,
                    "inexact": sorted(set(inexact))}
    finally:
        conn.close()


def _literal(text: str) -> str:
    return '"' + "".join(c if 0x20 <= ord(c) < 0x7F and c not in '\\"' else f"\\u{ord(c):04x}"
                         if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in text) + '"'


def render(found: dict[str, Any]) -> str:
    lines = [
        '"""How MariaDB converts its character sets to Unicode, as the server itself answers',
        "(``SELECT CONVERT(CONVERT(UNHEX(...) USING cs) USING utf8mb4)``), written by",
        "``python -m tests.helpers.charset_tables libs/codec/charset_tables.py`` against MariaDB 10.11.",
        "",
        "``SINGLE_BYTE``: each single-byte charset's 256 characters, U+FFFE for a byte the server",
        "maps to none (decoding it fails instead of guessing). ``ERRORS``: per multi-byte charset,",
        "sequences its Python codec (``charsets.MULTI_BYTE_BASE``) refuses but MariaDB maps.",
        "``TRANSLATE``: characters that codec gives where MariaDB gives another (each from one",
        "sequence only). ``INEXACT``: charsets where that does not hold (capture refuses them).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "SINGLE_BYTE: dict[str, str] = {",
    ]
    for name, table in sorted(found["single"].items()):
        lines.append(f"    {name!r}: (")
        lines.extend(f"        {_literal(table[i:i + 16])}" for i in range(0, 256, 16))
        lines.append("    ),")
    lines.append("}")
    for title, key in (("ERRORS", "errors"), ("TRANSLATE", "translate")):
        lines.append("")
        lines.append(f"{title}: dict[str, dict[str, str]] = {{")
        for name, entries in sorted(found[key].items()):
            lines.append(f"    {name!r}: {{")
            lines.extend(f"        {_literal(k)}: {_literal(v)}," for k, v in sorted(entries.items()))
            lines.append("    },")
        lines.append("}")
    lines.append("")
    lines.append(f"INEXACT: frozenset[str] = frozenset({tuple(found['inexact'])!r})")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        server = MariaDB(data_dir=Path(tmp), server_id=1).start()
        try:
            found = tables(server)
        finally:
            server.cleanup()
    path.write_text(render(found))
    print(f"{len(found['single'])} single-byte tables, {len(found['errors'])} multi-byte charsets "
          f"({', '.join(found['inexact']) or 'none'} inexact) written to {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
