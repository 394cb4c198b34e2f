"""Snapshots larger than one NATS message: cut into chunks, and joined only when complete.

Writing a snapshot of ``state`` covering the events up to ``up_to_seq`` (``plan``):

- a state whose JSON is at most ``INLINE_MAX`` bytes (and fits the server's max_payload) goes
  inside the ``snapshot.taken`` message, as it always did;
- a larger one is compressed (zlib of the JSON) and cut by ``libs.chunks`` into messages that fit
  the server's max_payload. The chunks go to one of two chunk subjects beside the snapshot
  subject (``<snapshot subject>.chunks.a`` / ``.b``): always the one the newest complete
  snapshot does not use, the first chunk with ``Nats-Rollup: sub``, so the server drops whatever
  that subject held before (the snapshot before the newest one, or a torn write). Then
  ``snapshot.taken`` is written on the snapshot subject, rolled up as before, naming the chunks'
  subject, first sequence, count, size and digest. Every chunk names the snapshot too: its
  ``up_to_seq`` (``Sluice-Snapshot-Up-To``) and ``index/count`` (``Sluice-Chunk``).

Every message of one snapshot is an append the leader fences on the stream's last sequence, so
the chunks sit at consecutive sequences right before their ``snapshot.taken``, and a deposed
leader cannot add a chunk anywhere. A leader stopped after some chunks leaves no
``snapshot.taken`` for them: readers still find the previous one, whose chunks are on the other
subject and untouched. At most two snapshots' chunks are ever kept.

Reading (``assemble``): the chunks named by the newest ``snapshot.taken`` are checked one by one
(subject, snapshot, index, count, digest) and joined; the joined bytes are checked against the
size and SHA-256 the marker names. Anything else raises ``TornSnapshot``: the reader then does
not trust the snapshot (it replays the events instead: slower, the same state).

Pure code, shared by the JetStream log (``snapshots.py``, ``domain_log.py``) and its in-memory
twin (``memory.py``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contracts.events.snapshots import SnapshotChunksV1, SnapshotTakenV2
from libs.chunks import ChunkError, ChunkJoiner, chunk_info, chunk_size_for, digest_of, split

INLINE_MAX = 256 * 1024
"""A state whose JSON is larger than this is compressed and chunked (well below the 1 MiB
max_payload, so a follower never reads a near-limit message for a snapshot)."""
SNAPSHOT_UP_TO = "Sluice-Snapshot-Up-To"
"""On every chunk: the ``up_to_seq`` of the snapshot it belongs to."""
ENCODING = "zlib+json"
SLOTS = ("a", "b")
DEFAULT_MAX_PAYLOAD = 1024 * 1024


class TornSnapshot(ValueError):
    """The chunks a ``snapshot.taken`` names are missing, out of place or do not join."""


@dataclass(frozen=True)
class Chunk:
    msg_id: str
    headers: dict[str, str]
    data: bytes


@dataclass(frozen=True)
class Planned:
    """One snapshot to write: ``inline`` alone, or ``chunks`` then ``marker(first_seq)``."""

    domain: str
    up_to_seq: int
    inline: SnapshotTakenV2 | None
    chunks: list[Chunk]
    subject: str
    """The chunks' subject (empty for an inline snapshot)."""
    size: int
    digest: str

    def marker(self, first_seq: int) -> SnapshotTakenV2:
        """The ``snapshot.taken`` that makes the chunks written from ``first_seq`` a snapshot."""
        if self.inline is not None:
            return self.inline
        return SnapshotTakenV2(domain=self.domain, up_to_seq=self.up_to_seq, chunks=SnapshotChunksV1(
            subject=self.subject, first_seq=first_seq, count=len(self.chunks), size=self.size,
            digest=self.digest, encoding=ENCODING))


def chunk_subjects(snapshot_subject: str) -> list[str]:
    return [f"{snapshot_subject}.chunks.{slot}" for slot in SLOTS]


def next_chunk_subject(snapshot_subject: str, newest: str | None) -> str:
    """The chunk subject the newest complete snapshot (its chunks on ``newest``) does not use."""
    first, second = chunk_subjects(snapshot_subject)
    return second if newest == first else first


def encode_state(state: dict[str, Any]) -> bytes:
    return json.dumps(state, separators=(",", ":")).encode()


def compress(raw: bytes) -> bytes:
    # Level 6: on the replication state at 100,000 spans, level 9 saves under 5 % for twice the CPU.
    return zlib.compress(raw, 6)


def inline_fits(raw: bytes, max_payload: int, inline_max: int = INLINE_MAX) -> bool:
    """Whether a state of JSON ``raw`` goes inside its ``snapshot.taken`` (``chunk_size_for``
    leaves room for the headers; the envelope around the state is far smaller)."""
    return len(raw) <= min(inline_max, chunk_size_for(max_payload))


def plan(domain: str, snapshot_subject: str, up_to_seq: int, state: dict[str, Any], *, epoch: int,
         newest_chunks: str | None, max_payload: int = DEFAULT_MAX_PAYLOAD,
         inline_max: int = INLINE_MAX, raw: bytes | None = None,
         compressed: bytes | None = None) -> Planned:
    """How to write a snapshot of ``state``; ``newest_chunks`` is the chunk subject of the newest
    complete snapshot (None when it has none). ``raw``/``compressed`` may be passed when the
    caller encoded (or compressed, off the event loop) already."""
    raw = encode_state(state) if raw is None else raw
    if inline_fits(raw, max_payload, inline_max):
        return Planned(domain, up_to_seq, SnapshotTakenV2(domain=domain, up_to_seq=up_to_seq, state=state),
                       [], "", len(raw), "")
    payload = compress(raw) if compressed is None else compressed
    digest = digest_of(payload)
    of = f"snapshot.{domain}.{up_to_seq}.{epoch}.{digest[:16]}"
    chunks = []
    for msg_id, headers, data in split(payload, of, up_to_seq, max_payload, digest):
        headers[SNAPSHOT_UP_TO] = str(up_to_seq)
        chunks.append(Chunk(msg_id, headers, data))
    return Planned(domain, up_to_seq, None, chunks, next_chunk_subject(snapshot_subject, newest_chunks),
                   len(payload), digest)


RawChunk = tuple[str, dict[str, str], bytes]
"""(subject, headers, data) of a chunk message as the stream returns it."""


def assemble(marker: SnapshotTakenV2, found: Sequence[RawChunk | None]) -> dict[str, Any]:
    """The state of a chunked snapshot from the messages at ``marker.chunks.first_seq + i``
    (None where there is none); ``TornSnapshot`` unless they are exactly its chunks."""
    ref = marker.chunks
    if ref is None:
        assert marker.state is not None
        return marker.state
    if len(found) != ref.count:
        raise TornSnapshot(f"{len(found)} chunk messages read, the snapshot has {ref.count}")
    joiner = ChunkJoiner()
    joined = None
    for index, message in enumerate(found):
        seq = ref.first_seq + index
        if message is None:
            raise TornSnapshot(f"chunk {index} (seq {seq}) is gone")
        subject, headers, data = message
        try:
            info = chunk_info(headers)
        except ChunkError as exc:
            raise TornSnapshot(f"seq {seq}: {exc}") from None
        if (subject != ref.subject or info is None or headers.get(SNAPSHOT_UP_TO) != str(marker.up_to_seq)
                or info.index != index or info.count != ref.count or info.digest != ref.digest):
            raise TornSnapshot(f"seq {seq} on {subject} is not chunk {index}/{ref.count} of the snapshot "
                               f"up to {marker.up_to_seq}")
        try:
            joined = joiner.add(info, seq, data, headers)
        except ChunkError as exc:
            raise TornSnapshot(str(exc)) from None
    if joined is None or len(joined.data) != ref.size:
        raise TornSnapshot(f"the chunks of the snapshot up to {marker.up_to_seq} do not join")
    try:
        state = json.loads(zlib.decompress(joined.data))
    except (zlib.error, ValueError) as exc:
        raise TornSnapshot(f"the joined snapshot does not decode: {exc}") from None
    if not isinstance(state, dict):
        raise TornSnapshot("the joined snapshot is not an object")
    return state
