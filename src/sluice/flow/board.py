"""Where stages talk: the stage-state hash (seed 000's `/taskstate`) and the signal stream
(its `/taskmessage`), both in Redis, so there is no monitor process.

- Every task publishes its state under its task id: stage, rate, origin rate, backpressure
  flag, queue level, when the state last changed and when it was last published. A task whose
  state is older than `STALE_MS` is treated as gone (a producer that exited).
- A downstream task sends `overload` / `underload` signals addressed to upstream task ids.
  Each task reads the stream from where it last stopped, keeping only signals to itself, so
  delivery is asynchronous and in order, and a slow reader loses nothing (the stream is capped
  at `SIGNALS_MAXLEN`, far above what one sensitivity period produces).
- Every state change is also appended to a short timeline for the status views.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import orjson

from sluice.redis.keys import FLOW_SIGNALS_KEY, FLOW_STATE_KEY, FLOW_TIMELINE_KEY

STALE_MS = 15_000
SIGNALS_MAXLEN = 10_000
TIMELINE_LEN = 1_000
OVERLOAD = "overload"
UNDERLOAD = "underload"


def task_id(stage: str) -> str:
    """A task id unique across hosts and processes: `<stage>/<host>/<pid>`."""
    return f"{stage}/{socket.gethostname()}/{os.getpid()}"


@dataclass(frozen=True)
class Signal:
    id: str
    to: str
    kind: str
    sender: str
    level_bytes: int
    at_ms: int


class Board:
    def __init__(self, client: Any) -> None:
        self.client = client

    # -- /taskstate ---------------------------------------------------------------------------

    def publish(self, task: str, state: dict[str, Any], changed: bool) -> None:
        pipe = self.client.pipeline(transaction=False)
        blob = orjson.dumps(state)
        pipe.hset(FLOW_STATE_KEY, task, blob)
        if changed:
            pipe.lpush(FLOW_TIMELINE_KEY, blob)
            pipe.ltrim(FLOW_TIMELINE_KEY, 0, TIMELINE_LEN - 1)
        pipe.execute()

    def tasks(self, now_ms: int, stage: str | None = None) -> dict[str, dict[str, Any]]:
        """Live tasks (published within STALE_MS), optionally of one stage."""
        out = {}
        for k, v in self.client.hgetall(FLOW_STATE_KEY).items():
            st = orjson.loads(v)
            if now_ms - int(st.get("updated_ms", 0)) > STALE_MS:
                continue
            if stage is None or st.get("stage") == stage:
                out[k.decode() if isinstance(k, bytes) else k] = st
        return out

    def all_tasks(self) -> dict[str, dict[str, Any]]:
        raw = self.client.hgetall(FLOW_STATE_KEY)
        return {
            (k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()
        }

    def forget(self, task: str) -> None:
        self.client.hdel(FLOW_STATE_KEY, task)

    def timeline(self, n: int = 200) -> list[dict[str, Any]]:
        """The newest `n` changes, newest first by the time each happened: a task restarted
        from its snapshot publishes its last change again, when it starts, at that change's
        older time."""
        got = [orjson.loads(b) for b in self.client.lrange(FLOW_TIMELINE_KEY, 0, n - 1)]
        return sorted(got, key=lambda st: -int(st.get("changed_ms") or 0))

    # -- /taskmessage -------------------------------------------------------------------------

    def send(self, to: str, kind: str, sender: str, level_bytes: int, at_ms: int) -> None:
        self.client.xadd(
            FLOW_SIGNALS_KEY,
            {"to": to, "kind": kind, "from": sender, "level": level_bytes, "t": at_ms},
            maxlen=SIGNALS_MAXLEN,
            approximate=True,
        )

    def signals_tail(self) -> str:
        """The id after which a task starting now reads its signals."""
        last = self.client.xrevrange(FLOW_SIGNALS_KEY, "+", "-", count=1)
        if not last:
            return "0-0"
        eid = last[0][0]
        return eid.decode() if isinstance(eid, bytes) else str(eid)

    def receive(self, task: str, after: str) -> tuple[list[Signal], str]:
        """Signals to `task` after id `after` (non-blocking); returns them and the new cursor."""
        got: list[Signal] = []
        while True:
            reply = self.client.xread({FLOW_SIGNALS_KEY: after}, count=500)
            if not reply:
                return got, after
            entries = reply[0][1]
            for eid, fields in entries:
                after = eid.decode() if isinstance(eid, bytes) else str(eid)
                f = {k.decode(): v.decode() for k, v in fields.items()}
                if f.get("to") == task:
                    got.append(
                        Signal(after, task, f["kind"], f["from"], int(f["level"]), int(f["t"]))
                    )
            if len(entries) < 500:
                return got, after
