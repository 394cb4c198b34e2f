"""Sliced base64 (libs/codec/base64_sliced.py) equals the one-call functions, strictness included."""

from __future__ import annotations

import base64
import binascii
import os

import pytest

from libs.codec.base64_sliced import _DECODE_SLICE, _ENCODE_SLICE, b64decode_strict, b64encode_text

SIZES = [0, 1, 2, 3, _ENCODE_SLICE - 1, _ENCODE_SLICE, _ENCODE_SLICE + 1, _ENCODE_SLICE + 2,
         3 * _ENCODE_SLICE, 3 * _ENCODE_SLICE + 1, 5 * _ENCODE_SLICE + 2]


@pytest.mark.parametrize("size", SIZES)
def test_encode_and_decode_equal_the_one_call_functions(size: int) -> None:
    raw = os.urandom(size)
    text = base64.b64encode(raw).decode("ascii")
    assert b64encode_text(raw) == text
    assert b64encode_text(bytearray(raw)) == text
    assert b64encode_text(memoryview(raw)) == text
    assert b64decode_strict(text) == raw


def test_padding_before_the_end_is_refused_on_a_slice_boundary_and_inside_a_slice() -> None:
    group = "QQ=="  # one byte, padded
    on_boundary = "A" * (_DECODE_SLICE - 4) + group + "AAAA"
    inside = "A" * 8 + group + "A" * (_DECODE_SLICE + 8)
    for text in (on_boundary, inside):
        with pytest.raises(binascii.Error):
            base64.b64decode(text, validate=True)
        with pytest.raises(binascii.Error):
            b64decode_strict(text)


@pytest.mark.parametrize("bad", [
    "A" * (_DECODE_SLICE + 1), "A" * _DECODE_SLICE + "A\nAA", "AB*D" * (_DECODE_SLICE // 2),
])
def test_malformed_text_is_refused_as_the_one_call_function_refuses_it(bad: str) -> None:
    with pytest.raises(binascii.Error):
        base64.b64decode(bad, validate=True)
    with pytest.raises(binascii.Error):
        b64decode_strict(bad)
