"""`durability: strict`: make Redis fsync its AOF before it acknowledges a write.

What an acknowledgement means (measured in docs/durability.md):

- `default` (`appendfsync everysec`): the reply to an `XADD` leaves Redis after the entry was
  written to the AOF file, i.e. into the kernel's page cache, except while a background fsync
  is slow, when Redis holds the AOF buffer in its own memory for up to 2 s and replies anyway.
  A `kill -9` of the server loses what was held; a kernel crash or power cut loses up to about
  a second more (what the page cache had not yet flushed).
- `strict` (`appendfsync always`, `no-appendfsync-on-rewrite no`): Redis writes and fsyncs the
  AOF once per event-loop iteration, before any reply of that iteration is sent. An
  acknowledged event survives `kill -9` of the server and a power cut of its machine. It says
  nothing about replicas: replication is asynchronous.

`ensure_durability` is called when a Sluice process connects (`open_redis`), never per write.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import redis

from sluice.errors import ConfigError

Durability = Literal["default", "strict"]
DURABILITY: tuple[Durability, ...] = ("default", "strict")

STRICT_SETTINGS = {"appendonly": "yes", "appendfsync": "always", "no-appendfsync-on-rewrite": "no"}
"""What `strict` needs. With `no-appendfsync-on-rewrite yes`, Redis skips the fsync while an AOF
rewrite or RDB save runs in a child, so `always` alone is not enough."""

log = logging.getLogger(__name__)


def appendfsync_for(durability: Durability) -> str:
    """The `appendfsync` an embedded server is started with under `durability`."""
    if durability not in DURABILITY:
        raise ConfigError(f"must be one of {DURABILITY}, got {durability!r}", "durability")
    return "always" if durability == "strict" else "everysec"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_settings(client: redis.Redis) -> dict[str, str]:
    """The server's persistence settings (`CONFIG GET`). Raises redis.ResponseError (including
    NoPermissionError) when CONFIG is renamed, disabled or denied by an ACL."""
    out: dict[str, str] = {}
    for name in STRICT_SETTINGS:
        reply = client.config_get(name)
        for k, v in reply.items():
            out[_text(k)] = _text(v)
    return out


def ensure_durability(
    client: redis.Redis, mode: Durability, where: str = "redis", timeout_s: float = 60.0
) -> dict[str, str]:
    """Make the server behind `client` honour `mode`; return its effective persistence settings.

    Called once at connect time; blocks for up to `timeout_s` when it has to turn the AOF on
    (Redis then rewrites the whole dataset into a fresh AOF, and writes are not durable until
    that rewrite finishes). `default` changes nothing and returns the settings it can read (an
    empty dict if CONFIG is not allowed). `strict` sets what is missing with `CONFIG SET`; the
    change lasts until the server restarts, so an operator should also put it in redis.conf.

    Raises ConfigError naming `durability` and the settings to apply when CONFIG is not allowed
    (a managed Redis, a renamed command, an ACL) or the server refuses a value.
    """
    if mode not in DURABILITY:
        raise ConfigError(f"must be one of {DURABILITY}, got {mode!r}", "durability")
    if mode == "default":
        try:
            return read_settings(client)
        except redis.ResponseError:
            return {}
    try:
        current = read_settings(client)
    except redis.ResponseError as e:
        reason = f"`CONFIG GET` is not allowed ({e})"
        raise ConfigError(_cannot(where, reason), "durability") from None
    missing = {k: v for k, v in STRICT_SETTINGS.items() if current.get(k) != v}
    if not missing:
        return current
    # Turn the AOF on last: its rewrite then starts with `always` already in force.
    for name in sorted(missing, key=lambda k: k == "appendonly"):
        try:
            client.config_set(name, missing[name])
        except redis.ResponseError as e:
            raise ConfigError(
                _cannot(where, f"`CONFIG SET {name} {missing[name]}` failed ({e})"), "durability"
            ) from None
    if "appendonly" in missing:
        _wait_aof_on(client, where, timeout_s)
    effective = read_settings(client)
    log.warning(
        "durability strict: set %s on %s for this server's lifetime; put them in its redis.conf"
        " too, or a restart reverts them",
        ", ".join(f"{k} {v}" for k, v in missing.items()),
        where,
    )
    return effective


def _cannot(where: str, reason: str) -> str:
    wanted = ", ".join(f"`{k} {v}`" for k, v in STRICT_SETTINGS.items())
    return (
        f"strict durability needs {wanted} on {where}, and Sluice cannot set them: {reason}."
        " Set them in the server's configuration (for a managed Redis, its AOF/fsync setting),"
        " or use `durability: default`"
    )


def _wait_aof_on(client: redis.Redis, where: str, timeout_s: float) -> None:
    """Block until the AOF rewrite that `CONFIG SET appendonly yes` started has finished: only
    then does Redis append (and fsync) new writes to the AOF."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.info("persistence")
        if (
            info.get("aof_enabled") == 1
            and info.get("aof_rewrite_in_progress") == 0
            and info.get("aof_rewrite_scheduled") == 0
        ):
            if info.get("aof_last_bgrewrite_status", "ok") != "ok":
                raise ConfigError(
                    _cannot(where, "turning the AOF on failed; see the server's log"), "durability"
                )
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                _cannot(where, f"the AOF was still being rewritten after {timeout_s:.0f}s"),
                "durability",
            )
        time.sleep(0.05)
