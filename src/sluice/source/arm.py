"""A streaming query started ahead of its takeover: the standby's half of a fast failover.

Starting a streaming query over a Python source costs seconds before its first batch: Spark
starts a fresh Python process to plan the source's reads (`python_streaming_source_runner`),
which imports PySpark and Sluice and builds the reader. A standby (`pipeline.standby`) pays that
while it stands by: it starts each of its queries *armed*. The query's reader then waits, in
`getDefaultReadLimit` (Spark asks for it once, while it builds the query's plan, before it
reads the checkpoint), for one word on a Redis list of its own (`redis.keys.arm_key`):

- `go`, pushed once this process holds the lease: Spark goes on, reads the checkpoint as it is
  now (the offset and commit logs the old leader left), and re-runs or plans the next batch
  exactly as a query started at that moment would;
- `stop`, pushed when the standby stops or the armed query is dropped: the planner process
  exits at once; Spark has already ended the query.

The planner also exits when the process that started it is gone. Nothing is read from the log
and nothing is written before `go`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from sluice.redis.connection import client_for

log = logging.getLogger(__name__)

GO = b"go"
STOP = b"stop"
POLL_S = 1.0  # how often a waiting planner checks that its parent is still there
KEY_TTL_S = 60  # a word nobody took goes with its key


def wait_for_go(url: str, key: str) -> None:
    """Block until `go` is pushed to `key`; exit this process on `stop` or when its parent
    (Spark's JVM) is gone. Redis being unreachable only makes it wait longer."""
    parent = os.getppid()
    client = client_for(url, timeout_s=POLL_S + 5, connect_timeout_s=5)
    while True:
        try:
            got = client.blpop([key], timeout=POLL_S)
        except Exception as e:  # noqa: BLE001 - Redis away: keep waiting for it
            log.debug("armed query cannot reach redis", extra={"error": str(e)})
            time.sleep(POLL_S)
            got = None
        if got is not None and got[1] == GO:
            client.close()
            return
        if got is not None or os.getppid() != parent:
            # Spark ended this query already (a `stop`), or its JVM is gone: no one reads
            # this process's answer, so it leaves without one, and without a traceback.
            os._exit(0)


def signal(client: Any, key: str, word: bytes) -> None:
    """Push `word` (GO or STOP) to an armed query's key."""
    pipe = client.pipeline(transaction=False)
    pipe.rpush(key, word)
    pipe.expire(key, KEY_TTL_S)
    pipe.execute()
