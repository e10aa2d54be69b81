"""A Redis that is loading its dataset (RDB or AOF) at start-up: waited for, never a failure.

While it loads, Redis answers most commands with `-LOADING Redis is loading the dataset in
memory` (PING and INFO still work). redis-py raises `BusyLoadingError` for it (a
`ConnectionError`); a raw reply parsed by hiredis, as the multiplexed client reads them, is a
`ResponseError` starting with `LOADING`. `is_loading` recognises both.

Clients made by `connection.client_for` do not retry (a URL-made redis-py client has a retry of
0 attempts), so the error reaches the caller at once. The source and the writer wait with
`wait_while_loading`; the status and the server report it (503 with Retry-After).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from redis._parsers.base import BaseParser
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterError,
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)

LOADING = "loading"  # the reason a waiting log or a 503 gives
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
log = logging.getLogger(__name__)
T = TypeVar("T")


def is_loading(e: BaseException) -> bool:
    """Whether `e` is Redis answering LOADING (redis-py's `BusyLoadingError`, or an error reply
    parsed by hiredis)."""
    if isinstance(e, BusyLoadingError):
        return True
    return isinstance(e, ResponseError) and str(e).startswith("LOADING")


def wait_while_loading(
    call: Callable[[], T],
    what: str,
    on_wait: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> T:
    """`call()`, called again while it fails because Redis is loading, with a backoff from
    50 ms doubling up to `max_backoff_s`; without a bound on the total wait (a large AOF takes
    minutes to load). `call` must be safe to repeat: it is retried from its start.

    Logs one warning when the wait starts and one line when it ends, naming `what` was waiting;
    `on_wait(message)` is called before each sleep (to report the wait: it should throttle
    itself). Any other error is raised as it comes.
    """
    backoff_s = FIRST_BACKOFF_S
    started: float | None = None
    while True:
        try:
            out = call()
        except (ConnectionError, ResponseError) as e:
            if not is_loading(e):
                raise
            if started is None:
                started = time.monotonic()
                extra = {"what": what, "error": str(e)}
                log.warning("redis is loading its dataset; waiting", extra=extra)
            if on_wait is not None:
                on_wait(str(e))
            sleep(backoff_s)
            backoff_s = min(max_backoff_s, backoff_s * 2)
            continue
        if started is not None:
            waited_s = round(time.monotonic() - started, 1)
            log.info("redis has loaded; resumed", extra={"what": what, "waited_s": waited_s})
        return out


# Error replies that say "not now" (a failover, a full memory, a busy script, a migrating slot)
# rather than "never": a retry may succeed. redis-py raises its own class for some of them and
# drops the code from the message; a raw reply (the multiplexed client's) keeps it.
_TRANSIENT_CODES = frozenset({"BUSY", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "MASTERDOWN", "OOM",
                              "NOREPLICAS", "MOVED", "ASK", "LOADING"})  # fmt: skip
_TRANSIENT_CLASSES = (ConnectionError, TimeoutError, OutOfMemoryError, ReadOnlyError,
                      ClusterError, TryAgainError, AskError, SlotNotCoveredError)  # fmt: skip


def is_transient(e: BaseException) -> bool:
    """Whether a Redis error may clear by itself: no connection, a timeout, or an error reply
    from a server that cannot answer now. Everything else (`WRONGTYPE` on a key some other
    program wrote, a command the client got wrong, keys in two slots) is answered the same on
    every retry."""
    if isinstance(e, AuthenticationError | AuthorizationError):
        return False  # a wrong password stays wrong
    if isinstance(e, _TRANSIENT_CLASSES):
        return True
    if isinstance(e, ResponseError):
        if str(e).split(" ", 1)[0] in _TRANSIENT_CODES:
            return True
        plain = unwrapped_script_error(e)  # a script's command refused the same way
        return plain is not e and is_transient(plain)
    return False


def unwrapped_script_error(e: Exception, what: str = "") -> Exception:
    """A script's error for a command Redis refused in it (Redis wraps the reply: "Error
    running script ...: -OOM command not allowed ...") as the error redis-py raises for that
    command run plainly (OutOfMemoryError, ReadOnlyError, ...), so that callers catch them
    alike; `what` (the command and the script) is added to its message. Any other error as
    it is."""
    text = str(e)
    _, sep, reply = text.rpartition(": -")
    if not sep or "@user_script" not in text:
        return e
    plain = BaseParser.parse_error(reply.strip())
    if type(plain) is ResponseError:
        return e
    return type(plain)(f"{plain} ({what})" if what else str(plain))
