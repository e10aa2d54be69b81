"""Whether a batch's fold runs Spark's pre-shuffle partial aggregation.

Spark folds `GROUP BY (g, k, s)` in two steps: each task folds its own rows (partial), the
shuffle brings each cell's partial states together, and a final step merges them. The partial
step pays only when cells repeat within a task. With many keys and events spread over time,
nearly every exploded row is a cell of its own (bench/ingest.py's high-cardinality workload
folds 0.7 rows per exploded row): the partial step then builds a hash map that reduces nothing.
Spark 4.3 can skip it (`spark.sql.execution.bypassPartialAggregation`: one aggregation after the
shuffle). Skipping it folded that workload 6–23 % faster in the bare engine, and cost the
few-keys workload (0.1 rows per exploded row) 14 %, so it is chosen per batch: a batch skips the
partial step when the last batch written folded at least `BYPASS_AT` rows per exploded row.

The answer is the same either way; only where Spark merges changes. Setting the Spark option in
`spark.conf` fixes the choice; a Spark that lacks the option is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from py4j.protocol import Py4JError

BYPASS_PARTIAL = "spark.sql.execution.bypassPartialAggregation"
BYPASS_AT = 0.5  # folded rows per exploded row from which the partial step is skipped

log = logging.getLogger("sluice.fold")


class PartialAggregation:
    """The choice for the next batch, from the batches written so far. `observe` and `apply`
    are called from the fold's threads one at a time (the record of a batch, the plan of the
    next); neither blocks."""

    def __init__(self, spark: Any, user_conf: dict[str, str]) -> None:
        self.adaptive = BYPASS_PARTIAL not in user_conf and _settable(spark, BYPASS_PARTIAL)
        self.bypass = False  # Spark's default until a batch says otherwise

    def observe(self, rows_in: int, rows_out: int) -> None:
        """A written batch's exploded rows and the folded rows they made."""
        if not self.adaptive or rows_in <= 0:
            return
        bypass = rows_out >= BYPASS_AT * rows_in
        if bypass != self.bypass:
            log.info(
                "partial aggregation " + ("skipped" if bypass else "resumed"),
                extra={"rows_in": rows_in, "rows_out": rows_out},
            )
        self.bypass = bypass

    def apply(self, session: Any) -> None:
        """Set the choice on `session` (the streaming query's) before a batch is planned."""
        if self.adaptive:
            session.conf.set(BYPASS_PARTIAL, "true" if self.bypass else "false")


def _settable(spark: Any, key: str) -> bool:
    """Whether this Spark knows `key` as a runtime SQL option."""
    try:
        return bool(spark.conf.isModifiable(key))
    except (AttributeError, Py4JError):  # a session without the call: leave it alone
        return False
