"""A series' step when none is asked (`query.engine.default_step`)."""

from __future__ import annotations

import pytest

from sluice.query.engine import MAX_POINTS, default_step

S, M, H, D = 1_000, 60_000, 3_600_000, 86_400_000


@pytest.mark.parametrize(
    ("slices", "window", "step"),
    [
        ([10 * S], H, 10 * S),  # 360 points: the slice
        ([S], H, 5 * S),  # 3,600 slices: the round 5 s (720 points)
        ([10 * S], D, 2 * M),
        ([7 * S], D, 91 * S),  # no round multiple of 7 s within twice 91 s: 91 s itself
        ([45 * S], D, 90 * S),  # not 15 m, which would give 96 points
        ([10 * S, 15 * S], D, 2 * M),  # a derived metric's inputs: a multiple of both
        ([10 * S, 15 * S], 10 * M, 30 * S),
        ([M], 3650 * D, 7 * D),
    ],
)
def test_the_step_fits_the_points_and_the_slices(slices: list[int], window: int, step: int) -> None:
    got = default_step(slices, window)
    assert got == step
    assert all(got % s == 0 for s in slices)
    assert window // got + 2 <= MAX_POINTS
