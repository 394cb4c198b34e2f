"""Which apply partition a key goes to: keys a downstream may compare as equal share one.

A key change is a delete of the old key and an upsert of the new one. When the two keys differ
exactly but a target's collation says they are equal ('a' and 'A' under a case-insensitive
collation, 'p2' and 'p2  ' under PAD SPACE), they are one row downstream: the delete must run
before the upsert, or it removes the row the upsert just wrote. ``Sink.apply_partition``
deletes before it upserts, so it is enough that both land in one partition: the apply job
partitions by ``key_bucket``, a hash of the key folded the way collations may fold it.

Folding more than a collation does is harmless (keys merely share a partition more often);
folding less is not, so the fold errs coarse: Unicode compatibility decomposition without
combining marks (accent-insensitive collations), case folding, trailing spaces stripped. The
limit: collation-specific equalities beyond that (utf8mb4_general_ci's 'ß' = 's', contractions
of a language's tailoring) are not folded.
"""

from __future__ import annotations

import unicodedata
import zlib
from typing import Any


def fold_text(value: str) -> str:
    """``value`` as coarsely as a case/accent-insensitive PAD SPACE collation may compare it."""
    if value.isascii():
        return value.lower().rstrip(" ")
    decomposed = unicodedata.normalize("NFKD", value)
    stripped = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return unicodedata.normalize("NFKC", stripped.casefold()).rstrip(" ")


def key_bucket(values: list[Any] | tuple[Any, ...]) -> int:
    """A stable (process-independent) 31-bit hash of the key's folded contract JSON values."""
    text = "\x1f".join(fold_text(v) if isinstance(v, str) else repr(v) for v in values)
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) & 0x7FFFFFFF
