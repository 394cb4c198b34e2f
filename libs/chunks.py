"""Messages larger than the NATS server's max_payload, sent as ordered chunks and joined again.

A message whose payload does not fit in one NATS message is published as ``count`` chunk
messages on the same subject, one after another, each a slice of the payload of at most
``chunk_size`` bytes. Every chunk carries the headers below; its ``Nats-Msg-Id`` is
``<logical id>#chunk:<chunk_size>:<index>``, a pure function of the logical message and the
chunk size, so a re-publication after a crash is deduplicated by JetStream like any message.
The chunk size is in the id and in the set's identity because a capture restarted against a
server with another max_payload cuts the same payload differently: chunks of two cuts must
never be mixed (the digest checks that too).

This module is pure: splitting a payload into chunks, and a ``ChunkJoiner`` that collects
chunks (in any order, duplicates allowed) until a set is complete and verified.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

CHUNK_OF = "Sluice-Chunk-Of"
"""The logical message's id (what ``Nats-Msg-Id`` would have been unchunked)."""
CHUNK = "Sluice-Chunk"
"""``<index>/<count>/<chunk_size>/<total bytes>``."""
CHUNK_DIGEST = "Sluice-Chunk-Digest"
"""SHA-256 (hex) of the whole payload, checked when the set is joined."""
CHUNK_TS = "Sluice-Chunk-Ts"
"""The event's ts, so a reader knows where an incomplete set belongs in ts order."""

# Room left in each chunk message for the headers (ids, trace context, chunk headers): the
# server's max_payload bounds headers plus payload.
HEADER_ROOM = 8 * 1024
_MIN_CHUNK = 1024


class ChunkError(ValueError):
    """A chunk whose headers are malformed, or a joined set whose digest or size is wrong."""


@dataclass(frozen=True)
class ChunkInfo:
    of: str
    index: int
    count: int
    chunk_size: int
    total: int
    digest: str
    ts: int

    @property
    def set_key(self) -> tuple[str, int, str]:
        return (self.of, self.chunk_size, self.digest)


def chunk_size_for(max_payload: int) -> int:
    """The payload bytes each chunk may carry under the server's ``max_payload``."""
    return max(_MIN_CHUNK, max_payload - HEADER_ROOM)


def needs_chunks(payload_size: int, max_payload: int) -> bool:
    return payload_size > chunk_size_for(max_payload)


def chunk_msg_id(of: str, chunk_size: int, index: int) -> str:
    return f"{of}#chunk:{chunk_size}:{index}"


def digest_of(payload: bytes) -> str:
    """The set's digest (hashlib frees the GIL while it hashes: run it in a thread)."""
    return hashlib.sha256(payload).hexdigest()


def split(payload: bytes, of: str, ts: int, max_payload: int,
          digest: str | None = None) -> Iterator[tuple[str, dict[str, str], bytes]]:
    """``(Nats-Msg-Id, chunk headers, slice)`` of each chunk of ``payload``, in order.

    Slices are made one at a time, so the caller holds the payload plus one chunk, never a
    second copy of the payload.
    """
    size = chunk_size_for(max_payload)
    count = max(1, -(-len(payload) // size))
    digest = digest or digest_of(payload)
    for index in range(count):
        headers = {
            CHUNK_OF: of,
            CHUNK: f"{index}/{count}/{size}/{len(payload)}",
            CHUNK_DIGEST: digest,
            CHUNK_TS: str(ts),
        }
        yield chunk_msg_id(of, size, index), headers, payload[index * size:(index + 1) * size]


def chunk_info(headers: Mapping[str, str] | None) -> ChunkInfo | None:
    """The chunk headers of a message, None for an ordinary message; ``ChunkError`` when malformed."""
    if not headers or CHUNK_OF not in headers:
        return None
    try:
        index, count, size, total = (int(x) for x in headers[CHUNK].split("/"))
        ts = int(headers[CHUNK_TS])
        digest = headers[CHUNK_DIGEST]
    except (KeyError, ValueError) as exc:
        raise ChunkError(f"malformed chunk headers: {exc}") from None
    if not (0 <= index < count) or size <= 0 or total < 0 or total > count * size:
        raise ChunkError(f"inconsistent chunk header {headers[CHUNK]!r}")
    return ChunkInfo(of=headers[CHUNK_OF], index=index, count=count, chunk_size=size, total=total,
                     digest=digest, ts=ts)


@dataclass
class _Partial:
    info: ChunkInfo
    first_seq: int
    parts: dict[int, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts.values())


@dataclass(frozen=True)
class Joined:
    """A complete, verified chunk set: the logical message."""

    of: str
    first_seq: int
    """Stream sequence of the set's first chunk: where the logical message begins."""
    last_seq: int
    data: bytes
    headers: dict[str, str]
    """Chunk 0's headers without the chunk headers, ``Nats-Msg-Id`` set to the logical id."""


_CHUNK_HEADERS = frozenset({CHUNK_OF, CHUNK, CHUNK_DIGEST, CHUNK_TS})


class ChunkJoiner:
    """Chunk sets being collected, keyed by (logical id, chunk size, digest).

    ``add`` returns the joined message once its last missing chunk arrives. A set starts only
    at its chunk 0 (a reader that began inside a set cannot join it and must re-read from its
    start); duplicates of a chunk are ignored.
    """

    def __init__(self) -> None:
        self._sets: dict[tuple[str, int, str], _Partial] = {}

    def __len__(self) -> int:
        return len(self._sets)

    @property
    def buffered_bytes(self) -> int:
        return sum(p.size for p in self._sets.values())

    def partial(self) -> list[tuple[int, int]]:
        """``(first stream seq, ts)`` of every incomplete set, by first seq."""
        return sorted((p.first_seq, p.info.ts) for p in self._sets.values())

    def clear(self) -> None:
        self._sets.clear()

    def knows(self, info: ChunkInfo) -> bool:
        return info.set_key in self._sets

    def add(self, info: ChunkInfo, seq: int, data: bytes, headers: Mapping[str, str]) -> Joined | None:
        partial = self._sets.get(info.set_key)
        if partial is None:
            if info.index != 0:
                return None  # the set's start was not read here
            partial = self._sets[info.set_key] = _Partial(info, seq, headers={
                k: v for k, v in headers.items() if k not in _CHUNK_HEADERS})
        if len(data) > info.chunk_size:
            del self._sets[info.set_key]
            raise ChunkError(f"chunk {info.index} of {info.of} has {len(data)} bytes, more than "
                             f"its chunk size {info.chunk_size}")
        partial.parts.setdefault(info.index, data)
        if len(partial.parts) < info.count:
            return None
        del self._sets[info.set_key]
        whole = b"".join(partial.parts[i] for i in range(info.count))
        partial.parts.clear()
        if len(whole) != info.total or hashlib.sha256(whole).hexdigest() != info.digest:
            raise ChunkError(f"chunks of {info.of} join to {len(whole)} bytes that do not match "
                             f"the digest of the {info.total} bytes sent")
        headers = dict(partial.headers)
        headers["Nats-Msg-Id"] = info.of
        return Joined(of=info.of, first_seq=partial.first_seq, last_seq=seq, data=whole, headers=headers)
