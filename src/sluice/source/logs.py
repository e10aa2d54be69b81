"""Which log a source reads: Redis Streams or Kafka (see `source.log` for the interface)."""

from __future__ import annotations

from typing import Any

from sluice.graph import KafkaSpec
from sluice.source.kafka import KafkaLog
from sluice.source.log import Log
from sluice.source.options import SourceOptions
from sluice.source.streams import RedisStreamsLog


def open_log(opts: SourceOptions, client: Any = None) -> Log:
    """The log `opts` names. `client`: a Redis client for the log's own bookkeeping (reader
    positions, trimming); made from `opts.url` on first use when None."""
    if isinstance(opts.log, KafkaSpec):
        return KafkaLog(opts, client)
    return RedisStreamsLog(opts, client)
