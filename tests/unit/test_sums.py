"""The C build of the count and sum merge (src/sluice/slices/_sums.c) against the same merge in
Python: the same answer to the bit, or a step aside for anything it does not read plainly."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.slices import state


@contextmanager
def _in_python() -> Iterator[None]:
    kept, state._add_in_c = state._add_in_c, None
    try:
        yield
    finally:
        state._add_in_c = kept


def _merged(replies: list[bytes | None]) -> Any:
    try:
        return state.merge_add_states(replies)
    except ValueError:
        return "refused"


def _python(replies: list[bytes | None]) -> Any:
    with _in_python():
        return _merged(replies)


def _same(a: Any, b: Any) -> bool:
    """Equal lists, their doubles compared to the bit (NaN to NaN, whatever its sign)."""
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return a == b
    return all(
        (x == y and struct.pack("<d", x) == struct.pack("<d", y)) or (x != x and y != y)
        for x, y in zip(a, b, strict=True)
    )


def test_the_c_merge_is_built() -> None:
    assert state._add_in_c is not None, (
        "sluice.slices._sums is not built: `pip install -e .` builds it (it needs a C compiler)"
    )


def _decimal(sign: str, digits: str, point: int) -> str:
    return sign + (digits if point > len(digits) else f"{digits[:point]}.{digits[point:]}")


# Up to 15 digits with a point anywhere (or none): what the C code reads itself, as a quotient
# of two exact doubles.
_short_decimals = st.builds(
    _decimal, st.sampled_from(["", "-"]), st.text("0123456789", min_size=1, max_size=15),
    st.integers(0, 16),
)  # fmt: skip
_texts = st.one_of(
    _short_decimals,
    st.integers(0, 10**6).map(str),
    st.integers(0, 2**64).map(str),  # past 2**53: added as doubles, rounded as `float` reads
    st.integers(-(2**60), -1).map(str),
    st.floats().map(repr),
    st.floats().map(state.format_number),  # as the script writes a merged state
    st.sampled_from(
        ["-0", "0", "00012", "+5", " 5", "5 ", "1_0", "", "x", "0x10", "1e+15", "Infinity", "5:6"]
    ),
)
_replies = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(0, 2**53), _texts).map(lambda p: f"{p[0]}:{p[1]}")),
    max_size=60,
).map(lambda items: [None if i is None else i.encode() for i in items])


@given(_replies)
def test_c_adds_what_python_adds_or_steps_aside(replies: list[bytes | None]) -> None:
    """Where the C code answers, it answers what the Python merge answers, to the bit (counts,
    doubles in slice order, the sign of a zero, infinities); where it does not read a state
    plainly (a space, an underscore, a sign the parser refuses, a second ':'), it gives way and
    the Python merge answers or refuses the state."""
    assert state._add_in_c is not None
    fast = state._add_in_c(replies)
    want = _python(replies)
    if fast is None:
        assert _same(_merged(replies), want)
        return
    got = [float(fast[0]), fast[1]] if fast[0] else [0]
    assert _same(got, want), (replies, got, want)


@pytest.mark.parametrize(
    "replies",
    [
        [b"9:3", None, b"9:4"],  # counts
        [b"9:0.1", b"9:0.2", b"9:0.3"],  # doubles, in order: not 0.6
        [b"9:1355.8500000000001", b"9:0.000000000000001", b"9:-999999999999999"],
        [b"9:-0", b"9:-0"],  # -0.0, as the doubles add
        [None, None],  # no state
        [],
    ],
)
def test_c_answers_plain_states(replies: list[bytes | None]) -> None:
    assert state._add_in_c is not None and state._add_in_c(replies) is not None
    assert _same(state.merge_add_states(replies), _python(replies))


@pytest.mark.parametrize("replies", [[b"9:1:2"], [b"9"], [b"9: 5"], [b"9:1_0"], ("9:1",), [7]])
def test_c_steps_aside_for_what_it_does_not_read_plainly(replies: Any) -> None:
    assert state._add_in_c is not None and state._add_in_c(replies) is None
