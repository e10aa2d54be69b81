"""sluice.redis.keys: key escaping, slice hash keys, Redis Cluster slots."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.redis.keys import (
    SLICE_PREFIX,
    dead_letter_marker_key,
    dead_letter_stream_key,
    decode_key,
    encode_key,
    escape_part,
    key_slot,
    slice_hash_key,
    unescape_part,
)

FAST = settings(max_examples=120, deadline=None, database=None)
SPECIAL = st.sampled_from(["|", "{", "}", "%", "%7C", "%25", "%7B", "%7D", "%7c", "%2", "{}"])
tricky_text = st.lists(st.one_of(st.text(max_size=6), SPECIAL), max_size=6).map("".join)
metric_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("plain", "plain"),
        ("a|b", "a%7Cb"),
        ("{tag}", "%7Btag%7D"),
        ("100%", "100%25"),
        ("%7C", "%257C"),
        ("", ""),
    ],
)
def test_escape_examples(raw: str, escaped: str) -> None:
    assert escape_part(raw) == escaped
    assert unescape_part(escaped) == raw


@FAST
@given(tricky_text)
def test_escape_round_trip(value: str) -> None:
    escaped = escape_part(value)
    assert unescape_part(escaped) == value
    assert not set("|{}") & set(escaped)


@FAST
@given(tricky_text, tricky_text)
def test_escape_is_injective(a: str, b: str) -> None:
    if a != b:
        assert escape_part(a) != escape_part(b)


@FAST
@given(st.lists(tricky_text, min_size=1, max_size=5))
def test_encode_decode_key_round_trip(parts: list[str]) -> None:
    encoded = encode_key(parts)
    assert decode_key(encoded) == parts
    assert encoded.count("|") == len(parts) - 1
    assert "{" not in encoded and "}" not in encoded


@FAST
@given(st.lists(tricky_text, min_size=1, max_size=4), st.lists(tricky_text, min_size=1, max_size=4))
def test_distinct_keys_encode_distinctly(a: list[str], b: list[str]) -> None:
    if a != b:
        assert encode_key(a) != encode_key(b)


def test_encode_key_examples() -> None:
    assert encode_key(["card-17"]) == "card-17"
    assert encode_key(["a", "b"]) == "a|b"
    assert encode_key(["a|b"]) == "a%7Cb"
    assert decode_key("a|b") == ["a", "b"]
    assert decode_key("a%7Cb") == ["a|b"]


def test_slice_hash_key_example() -> None:
    assert slice_hash_key("txn_count", "card-17") == "sluice:s:{txn_count|card-17}"
    assert slice_hash_key("m", encode_key(["x", "y"])) == "sluice:s:{m|x|y}"


@FAST
@given(metric_names, st.lists(tricky_text, min_size=1, max_size=4))
def test_slice_hash_key_has_one_tag(metric: str, parts: list[str]) -> None:
    encoded = encode_key(parts)
    key = slice_hash_key(metric, encoded)
    assert key.startswith(SLICE_PREFIX)
    assert key.count("{") == 1 and key.count("}") == 1
    tag = re.fullmatch(re.escape(SLICE_PREFIX) + r"\{([^{}]*)\}", key)
    assert tag is not None
    assert tag.group(1) == f"{metric}|{encoded}"
    # The slot depends on the tag only.
    assert key_slot(key) == key_slot(tag.group(1))
    assert key_slot(key) == key_slot("anything-else:{" + tag.group(1) + "}:suffix")


@pytest.mark.parametrize(
    ("key", "slot"),
    [("foo", 12182), ("bar", 5061), ("123456789", 12739), ("", 0)],
)
def test_key_slot_known_values(key: str, slot: int) -> None:
    assert key_slot(key) == slot
    assert key_slot(key.encode()) == slot


def test_key_slot_crc16_test_vector() -> None:
    # CRC16-XMODEM("123456789") == 0x31C3 == 12739, below 16384, so the slot is the CRC itself.
    assert 0x31C3 == 12739
    assert key_slot("123456789") == 0x31C3


def test_key_slot_hash_tags() -> None:
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("{user1000}.following") == key_slot("user1000")
    assert key_slot("foo{bar}baz") == key_slot("bar")
    # Only the first {...} counts.
    assert key_slot("{a}{b}") == key_slot("a")
    assert key_slot("x{a}y{b}") == key_slot("a")


def test_key_slot_empty_tag_hashes_whole_key() -> None:
    assert key_slot("foo{}{bar}") != key_slot("bar")
    assert key_slot("{}") == key_slot(b"{}")
    # An empty tag means the whole key is hashed, so different keys spread out.
    assert key_slot("foo{}") != key_slot("bar{}")
    # A '{' with no '}' after it is not a tag either.
    assert key_slot("foo{bar") != key_slot("bar")
    assert key_slot("}foo{") != key_slot("foo")


@FAST
@given(st.binary(max_size=40))
def test_key_slot_in_range(raw: bytes) -> None:
    assert 0 <= key_slot(raw) < 16384


def test_dead_letter_keys_share_the_stream_tag() -> None:
    stream = dead_letter_stream_key("events")
    marker = dead_letter_marker_key("events", 123, "abcd")
    assert stream == "sluice:dead:{events}"
    assert marker == "sluice:dlm:{events}:123:abcd"
    assert key_slot(stream) == key_slot(marker) == key_slot("events")


def test_shard_side_keys_share_the_shard_slot() -> None:
    from sluice.redis.keys import shard_keys, shard_side_key

    for shard in ["events", "events:3", "events:0:{5}", *shard_keys("events", 7, hash_tags=True)]:
        k = shard_side_key("rd", shard)
        assert key_slot(k) == key_slot(shard), (shard, k)
        assert key_slot(shard_side_key("emit", shard, 12, 0, 3)) == key_slot(shard)
    assert shard_side_key("rd", "events") == "sluice:rd:{events}"
    assert shard_side_key("emit", "a:1:{9}", 4, 2) == "sluice:emit:a:1:{9}:4:2"
