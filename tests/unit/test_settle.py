"""Which derived lookups are read again (`query.settle.unsettled`), from the write marks read
before and after their slices and the slices' tokens. Plan entries are (lookup, metric, cover,
replies, raw, first), as `query.engine` makes them."""

from __future__ import annotations

from typing import Any

from sluice.query.settle import unsettled

METRICS = ["ticket", "cnt"]  # lookup 0: a derived metric; lookup 1: a plain one
DERIVED = {"ticket"}


def _raw(*slices: bytes | None) -> list[Any]:
    """One HMGET's reply."""
    return list(slices)


def _again(before: Any, after: Any, replies: list[Any], raw: bool = True) -> list[int]:
    plan = [(0, None, None, 1, raw, 0), (0, None, None, 1, raw, 1), (1, None, None, 1, raw, 2)]
    return unsettled(METRICS, plan, replies, before, after, DERIVED)


OLD = [_raw(b"5:1", None), _raw(b"5:10"), _raw(b"5:1")]  # every slice of batch 5
HALF = [_raw(b"7:2", None), _raw(b"5:10"), _raw(b"7:2")]  # count has batch 7, sum not yet


def test_no_write_in_flight_is_one_state() -> None:
    assert _again((4, frozenset()), (4, frozenset()), HALF) == []


def test_a_write_in_flight_is_met_only_where_a_slice_holds_its_token() -> None:
    w7 = (5, frozenset({b"7:0"}))
    assert _again(w7, w7, HALF) == [0]  # the plain lookup (1) is never read again
    assert _again(w7, w7, OLD) == []  # none of batch 7's slices read: one state
    other = (5, frozenset({b"70:0"}))  # a token that only starts like it
    assert _again(other, other, HALF) == []


def test_a_write_that_began_between_the_reads_is_checked_by_its_token() -> None:
    began = (6, frozenset({b"7:0"}))
    assert _again((5, frozenset()), began, HALF) == [0]
    assert _again((5, frozenset()), began, OLD) == []
    ended = (7, frozenset())
    assert _again(began, ended, HALF) == [0]  # it ended between them: it was in flight


def test_a_write_that_began_and_ended_unseen_reads_again() -> None:
    """The count grew by two and no write was seen to begin or end: its token is unknown."""
    assert _again((4, frozenset()), (6, frozenset()), OLD) == [0]
    assert _again((4, frozenset({b"7:0"})), (6, frozenset({b"7:0"})), OLD) == [0]


def test_reads_with_no_token_to_tell_by_wait_for_no_write_in_flight() -> None:
    """A HyperLogLog or a range merged in Redis: any write in flight may be in it."""
    merged = [3, 10, 3]  # merged states, no tokens
    assert _again((4, frozenset()), (4, frozenset()), merged, raw=False) == []
    w7 = (5, frozenset({b"7:1"}))
    assert _again(w7, w7, merged, raw=False) == [0]


def test_an_entry_read_for_an_earlier_lookup_takes_its_answer_about_the_write() -> None:
    plan = [(0, None, None, 1, True, 0), (1, None, None, 0, True, 0)]  # lookup 1 shares 0's
    w7 = (5, frozenset({b"7:0"}))
    assert unsettled(["cnt", "ticket"], plan, [_raw(b"7:2")], w7, w7, DERIVED) == [1]
