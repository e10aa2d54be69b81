"""The offline side: archived events folded with the live fold's own plan.

`backfill` writes them into the slice store; `training_set` answers, for every row of a table
of labelled events, what the online service would have answered at that row's time, for any
list of windows. See docs/offline.md.
"""

from sluice.offline.backfill import backfill
from sluice.offline.training import training_set

__all__ = ["backfill", "training_set"]
