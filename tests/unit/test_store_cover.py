"""Which windows the slice store can answer for a training set (`offline.store._uncovered`):
those within what a backfill (from its start to its seam) or the live fold (from its first
whole slice) wrote, and nothing in a gap or before or past them."""

from __future__ import annotations

import pytest

from sluice.offline.store import _uncovered
from sluice.status.coverage import Written

M = 60_000  # the coarsest slice here


@pytest.mark.parametrize(
    ("lo", "hi", "seam", "began", "start", "why"),
    [
        (10 * M, 20 * M, 30 * M, None, 0, None),  # within a backfill over the whole archive
        (10 * M, 20 * M, 30 * M, None, 10 * M, None),  # ... one that began at the window
        (5 * M, 20 * M, 30 * M, None, 10 * M, "before the history a backfill wrote"),
        (10 * M, 40 * M, 30 * M, None, 0, "past 'm''s backfill seam"),
        (10 * M, 40 * M, 30 * M, 25 * M, 10 * M, None),  # backfill, then live: no gap
        (5 * M, 40 * M, 30 * M, 25 * M, 10 * M, "before the history a backfill wrote"),
        (5 * M, 40 * M, 30 * M, 4 * M, 10 * M, None),  # the live fold began even earlier
        (10 * M, 40 * M, 30 * M, 35 * M, 0, "into the gap"),
        (36 * M, 40 * M, 30 * M, 35 * M, 10 * M, None),  # the live fold's own
        (10 * M, 20 * M, None, None, 0, "holds nothing"),
        (10 * M, 20 * M, None, 15 * M, 0, "before the live fold began"),
    ],
)
def test_a_window_is_answered_only_where_something_wrote_it(
    lo: int, hi: int, seam: int | None, began: int | None, start: int, why: str | None
) -> None:
    spans = ((start, seam),) if seam is not None else ()
    got = _uncovered("m", lo, hi, M, Written(seam, began, spans))
    assert (got is None) if why is None else (got is not None and why in got), got


@pytest.mark.parametrize(
    ("lo", "hi", "began", "why"),
    [
        (10 * M, 20 * M, None, None),  # within the first run's span
        (50 * M, 60 * M, None, None),  # within the second's
        (20 * M, 45 * M, None, "[1970-01-01T00:30:00Z, 1970-01-01T00:40:00Z), which no backf"),
        (35 * M, 45 * M, None, "[1970-01-01T00:35:00Z, 1970-01-01T00:40:00Z)"),
        (20 * M, 45 * M, 25 * M, None),  # the live fold wrote the gap
        (20 * M, 45 * M, 32 * M, "[1970-01-01T00:30:00Z, 1970-01-01T00:32:00Z)"),
        (50 * M, 70 * M, None, "past 'm''s backfill seam"),
    ],
)
def test_a_gap_between_two_backfills_spans_is_not_answered(
    lo: int, hi: int, began: int | None, why: str | None
) -> None:
    """Runs over [0, 30m) and [40m, 60m): the 10 minutes between them hold nothing."""
    w = Written(60 * M, began, ((0, 30 * M), (40 * M, 60 * M)))
    got = _uncovered("m", lo, hi, M, w)
    assert (got is None) if why is None else (got is not None and why in got), got
    assert w.complete_from(M) == (None if began is None else (0 if began <= 30 * M else 32 * M))


def test_spans_merge_where_they_meet_and_read_as_stored() -> None:
    from sluice.status.coverage import merged, parse_spans, spans_text, stored_spans

    assert merged([(40, 60), (0, 30), (30, 35), (50, 55)]) == ((0, 35), (40, 60))
    assert parse_spans(spans_text(((0, 35), (40, 60)))) == ((0, 35), (40, 60))
    # Stored before spans were kept: the earliest start to the newest seam, one span.
    assert stored_spans(None, b"60", b"10") == ((10, 60),)
    assert stored_spans(None, b"60", None) == ((0, 60),) and stored_spans(None, None, None) == ()
    assert stored_spans(b"0:30,40:60", b"60", b"0") == ((0, 30), (40, 60))


def test_a_window_near_the_retention_edge_is_refused_while_the_fold_may_trim_it() -> None:
    """The oldest slice every key holds now is a retention back from the newest slice's start;
    the live fold may move that on while the job reads, so a window starting within
    TRIM_MARGIN_MS of it is refused, and one starting after that answered."""
    from sluice.config import config_from_dict
    from sluice.offline.store import TRIM_MARGIN_MS, _StorePlan, _why_not

    cfg = config_from_dict({"metrics": [{"name": "m", "key": ["key"], "agg": "count",
                                         "slice": "1m", "retention": "2h"}]})  # fmt: skip
    now = 1_000 * 3_600_000 + 30_000  # mid-slice
    plan = _StorePlan(cfg=cfg, url="redis://unused", now_ms=now, features=(), keys=(),
                      types={}, written={"m": Written(now, None, ((0, now),))})  # fmt: skip
    held_from = now - 30_000 - 2 * 3_600_000  # the oldest slice's start every key holds
    t = now - 30_000 - 10 * M - 1  # a slice's last millisecond, before the store's clock
    edge = t + 1 - (held_from + TRIM_MARGIN_MS)  # the longest window that is answered
    assert _why_not(plan, "m", t, edge) is None
    why = _why_not(plan, "m", t, edge + M)
    assert why is not None and "within 15m of it" in why, why


def test_with_resolutions_the_bound_is_the_finest_slices_one() -> None:
    """A window's start is read from the finest slices, which a key just written keeps from its
    newest finest slice a retention back: up to a coarse slice later than the coarse ones."""
    from sluice.config import config_from_dict
    from sluice.offline.store import TRIM_MARGIN_MS, _StorePlan, _why_not

    metric = {"name": "m", "key": ["key"], "agg": "count", "resolutions": ["1m", "1h"],
              "retention": "2h"}  # fmt: skip
    cfg = config_from_dict({"metrics": [metric]})
    hour = 3_600_000
    now = 1_000 * hour + 40 * M + 30_000  # 10:40:30 of some day
    plan = _StorePlan(cfg=cfg, url="redis://unused", now_ms=now, features=(), keys=(),
                      types={}, written={"m": Written(now, None, ((0, now),))})  # fmt: skip
    held_from = 1_000 * hour + 40 * M - 2 * hour  # 08:40: the finest slices every key holds
    t = 1_000 * hour + 30 * M - 1  # 10:29:59.999
    edge = t + 1 - (held_from + TRIM_MARGIN_MS)
    assert _why_not(plan, "m", t, edge) is None
    assert _why_not(plan, "m", t, 2 * hour) is not None  # from 08:30: its first slices are gone
