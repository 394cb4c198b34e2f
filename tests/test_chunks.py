"""Splitting a message over max_payload into chunks and joining them again (pure logic)."""

from __future__ import annotations

import os
import random

import pytest

from libs.chunks import (
    CHUNK,
    CHUNK_OF,
    HEADER_ROOM,
    ChunkError,
    ChunkJoiner,
    chunk_info,
    chunk_size_for,
    needs_chunks,
    split,
)

MAX_PAYLOAD = 64 * 1024


def _chunks(payload: bytes, of: str = "src:binlog.000001:4:db.t:0", ts: int = 7,
            max_payload: int = MAX_PAYLOAD) -> list[tuple[str, dict[str, str], bytes]]:
    return list(split(payload, of, ts, max_payload))


def test_a_message_under_the_chunk_size_needs_no_chunks() -> None:
    assert not needs_chunks(MAX_PAYLOAD - HEADER_ROOM, MAX_PAYLOAD)
    assert needs_chunks(MAX_PAYLOAD - HEADER_ROOM + 1, MAX_PAYLOAD)


def test_chunks_cover_the_payload_in_order_within_max_payload() -> None:
    payload = os.urandom(5 * MAX_PAYLOAD + 123)
    chunks = _chunks(payload)
    assert b"".join(piece for _, _, piece in chunks) == payload
    assert all(len(piece) + HEADER_ROOM <= MAX_PAYLOAD for _, _, piece in chunks)
    infos = [chunk_info(headers) for _, headers, _ in chunks]
    assert [i.index for i in infos if i] == list(range(len(chunks)))
    assert {(i.count, i.total, i.ts) for i in infos if i} == {(len(chunks), len(payload), 7)}


def test_ids_are_deterministic_and_name_the_chunk_size() -> None:
    payload = os.urandom(3 * MAX_PAYLOAD)
    assert [c[0] for c in _chunks(payload)] == [c[0] for c in _chunks(payload)]
    ids = [c[0] for c in _chunks(payload)]
    assert len(set(ids)) == len(ids)
    other = [c[0] for c in _chunks(payload, max_payload=2 * MAX_PAYLOAD)]
    assert not set(ids) & set(other)


def test_joiner_joins_in_any_order_with_duplicates() -> None:
    payload = os.urandom(7 * MAX_PAYLOAD)
    chunks = _chunks(payload)
    order = [*range(1, len(chunks)), 2, 3]
    random.Random(3).shuffle(order)
    joiner = ChunkJoiner()
    first = chunks[0]
    info0 = chunk_info(first[1])
    assert info0 is not None
    assert joiner.add(info0, 100, first[2], {**first[1], "traceparent": "tp"}) is None
    joined = None
    for n, i in enumerate(order):
        info = chunk_info(chunks[i][1])
        assert info is not None
        assert joined is None, "joined before every chunk arrived"
        joined = joiner.add(info, 101 + n, chunks[i][2], chunks[i][1])
    assert joined is not None
    assert joined.data == payload
    assert joined.first_seq == 100
    assert joined.headers == {"traceparent": "tp", "Nats-Msg-Id": "src:binlog.000001:4:db.t:0"}
    assert CHUNK not in joined.headers and CHUNK_OF not in joined.headers
    assert len(joiner) == 0


def test_a_set_starts_only_at_its_first_chunk() -> None:
    chunks = _chunks(os.urandom(3 * MAX_PAYLOAD))
    joiner = ChunkJoiner()
    for n, (_, headers, piece) in enumerate(chunks[1:]):
        info = chunk_info(headers)
        assert info is not None
        assert joiner.add(info, n, piece, headers) is None
    assert len(joiner) == 0, "a tail without its first chunk is not collected"


def test_incomplete_sets_report_their_first_seq_and_ts() -> None:
    joiner = ChunkJoiner()
    for seq, (ts, of) in enumerate([(9, "b"), (5, "a")]):
        _, headers, piece = _chunks(os.urandom(2 * MAX_PAYLOAD), of=of, ts=ts)[0]
        info = chunk_info(headers)
        assert info is not None
        joiner.add(info, 10 + seq, piece, headers)
    assert joiner.partial() == [(10, 9), (11, 5)]
    assert joiner.buffered_bytes == 2 * chunk_size_for(MAX_PAYLOAD)


def test_chunks_of_two_cuts_never_mix() -> None:
    payload = os.urandom(4 * MAX_PAYLOAD)
    small = _chunks(payload)
    large = _chunks(payload, max_payload=2 * MAX_PAYLOAD)
    joiner = ChunkJoiner()
    joined = None
    for n, (_, headers, piece) in enumerate([small[0], large[0], *small[1:2], *large[1:]]):
        info = chunk_info(headers)
        assert info is not None
        joined = joiner.add(info, n, piece, headers) or joined
    assert joined is not None and joined.data == payload
    assert len(joiner) == 1, "the small cut's set is still incomplete"


def test_a_corrupt_set_is_refused() -> None:
    chunks = _chunks(os.urandom(2 * MAX_PAYLOAD))
    joiner = ChunkJoiner()
    with pytest.raises(ChunkError, match="digest"):
        for n, (_, headers, piece) in enumerate(chunks):
            info = chunk_info(headers)
            assert info is not None
            joiner.add(info, n, bytes(len(piece)) if n == 1 else piece, headers)


@pytest.mark.parametrize("header", ["x/2/10/10", "2/2/10/10", "0/1/10/99"])
def test_malformed_chunk_headers_are_refused(header: str) -> None:
    with pytest.raises(ChunkError):
        chunk_info({CHUNK_OF: "a", CHUNK: header, "Sluice-Chunk-Digest": "d", "Sluice-Chunk-Ts": "1"})


def test_ordinary_messages_have_no_chunk_info() -> None:
    assert chunk_info(None) is None
    assert chunk_info({"Nats-Msg-Id": "x"}) is None
