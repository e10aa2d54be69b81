"""sluice.source.streams.backlog_share: a reader's share of a stream, estimated by entry time."""

from __future__ import annotations

import pytest

from sluice.source.streams import backlog_share


@pytest.mark.parametrize(
    ("offset", "first", "last", "share"),
    [
        (None, "1000-0", "1100-0", 1.0),  # nothing committed: the whole stream
        ("1000-0", "1000-0", "1100-0", 1.0),  # the slowest reader: the stream is its backlog
        ("900-3", "1000-0", "1100-0", 1.0),  # an offset before the stream's first entry
        ("1075-0", "1000-0", "1100-0", 0.25),
        (b"1075-9", b"1000-0", b"1100-0", 0.25),  # ids as bytes, as Redis sends them
        ("1100-0", "1000-0", "1100-0", 0.0),  # at the last entry
        ("1200-0", "1000-0", "1100-0", 0.0),  # past it
        ("1000-0", "1000-0", "1000-5", 1.0),  # one ms only, with entries after the offset
        (None, None, None, 0.0),  # an empty stream
    ],
)
def test_backlog_share(
    offset: str | bytes | None, first: str | bytes | None, last: str | bytes | None, share: float
) -> None:
    assert backlog_share(offset, first, last) == share
