"""Whether a stage's log can be read now, kept in Redis for the status views.

A log that cannot be read (Kafka unreachable, its topic deleted) does not fail the pipeline:
planning returns no new data and reads wait and try again. `LogState` says so in
`sluice:{stats[:<stage>]}:log` (state `waiting` with the reason and since when, or `ok`), so
`sluice status`, `/v1/status` and `/healthz` can show it. Written by the source reader on the
driver and by reads on the executors; writes never raise (Redis may be down too).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sluice.redis.connection import client_for
from sluice.redis.keys import log_state_key

log = logging.getLogger(__name__)

REFRESH_S = 5.0  # a state unchanged is written again this often (its age shows it is current)


class LogState:
    def __init__(self, url: str, stage: str) -> None:
        self.url = url
        self.key = log_state_key(stage)
        self._client: Any = None
        self._last: tuple[str, str] | None = None
        self._written_s = 0.0
        self._since_ms = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_last": None}

    def waiting(self, reason: str, message: str) -> None:
        if self._last is None or self._last[0] != "waiting":
            log.warning("log unavailable; waiting", extra={"reason": reason, "error": message})
            self._since_ms = time.time_ns() // 1_000_000
        self._write("waiting", reason, message)

    def ok(self) -> None:
        if self._last is not None and self._last[0] == "waiting":
            log.info("log available again")
        self._write("ok", "", "")

    def _write(self, state: str, reason: str, message: str) -> None:
        now = time.monotonic()
        if self._last == (state, reason) and now - self._written_s < REFRESH_S:
            return
        now_ms = time.time_ns() // 1_000_000
        if state == "ok":
            self._since_ms = 0
        try:
            if self._client is None:
                self._client = client_for(self.url, timeout_s=5, connect_timeout_s=5)
            self._client.hset(
                self.key,
                mapping={"state": state, "reason": reason, "message": message,
                         "since_ms": self._since_ms, "updated_ms": now_ms},
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - status only; Redis may be the one that is down
            log.debug("log state not written", extra={"error": str(e)})
            return
        self._last = (state, reason)
        self._written_s = now


def read_log_state(client: Any, stage: str = "spark") -> dict[str, Any] | None:
    """The newest state written for `stage`'s log, or None."""
    raw = client.hgetall(log_state_key(stage))
    if not raw:
        return None
    st = {k.decode(): v.decode() for k, v in raw.items()}
    return {
        "state": st.get("state", "unknown"),
        "reason": st.get("reason") or None,
        "message": st.get("message") or None,
        "since_ms": int(st["since_ms"]) if st.get("since_ms", "0") != "0" else None,
        "updated_ms": int(st.get("updated_ms", 0)),
    }
