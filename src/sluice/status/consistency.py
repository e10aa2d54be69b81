"""The newest consistency report: what `sluice consistency` found when it compared a sample of
the answers the server gave (`sluice:{consistency}:answers`, see `sluice.query.answers`) with
values recomputed offline from the archive.

The command stores the report as JSON at `CONSISTENCY_KEY`:

    {"at_ms", "input", "samples", "matched", "mismatched", "missing", "skipped",
     "metrics": {metric: {"matched", "mismatched", "missing", "skipped"}},
     "examples": [{"metric", "key", "window_ms", "end_ms", "online", "offline"}, ...]}

It is read here as stored, for the status snapshot, its terminal view and Prometheus.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from sluice.redis.keys import CONSISTENCY_KEY

log = logging.getLogger(__name__)

RESULTS = ("matched", "mismatched", "missing", "skipped")


def read_consistency(client: Any) -> dict[str, Any] | None:
    """The newest report, or None when there is none or it is not a JSON object (bad JSON is
    logged at debug only: the status is polled every second). One GET; raises redis errors."""
    raw = client.get(CONSISTENCY_KEY)
    if raw is None:
        return None
    try:
        report = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        log.debug("consistency report at %s is not JSON: %s", CONSISTENCY_KEY, e)
        return None
    return report if isinstance(report, dict) else None
