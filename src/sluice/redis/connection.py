"""Connections: a configured URL (redis://, rediss://, unix://, with password; or a Redis Cluster,
redis+cluster://, see `sluice.redis.cluster`), or the embedded server under `state_dir`.
`open_redis` returns a handle that owns the embedded server, if any, and has checked the server
(every master of a cluster) against `durability` (see `sluice.redis.durability`).

`client_for(url)` is the one place a client is made from a URL, on the driver and on the
executors alike: a plain `redis.Redis`, or a `redis.cluster.RedisCluster` for a cluster URL.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from sluice.errors import RedisUnavailable
from sluice.redis.cluster import (
    cluster_client,
    is_cluster_url,
    node_clients,
    redact_cluster_url,
)
from sluice.redis.durability import Durability, appendfsync_for, ensure_durability
from sluice.redis.embedded import EmbeddedRedis


def redact(url: str) -> str:
    """The URL with any password replaced by `***`, for messages and logs."""
    if is_cluster_url(url):
        return redact_cluster_url(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{netloc}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def client_for(url: str, timeout_s: float = 10.0, connect_timeout_s: float | None = None) -> Any:
    """A client (bytes replies) for `url`: `redis.Redis`, or `RedisCluster` for a cluster URL.

    A plain client does not connect until first used; a cluster client reads the slot map from
    a seed at once (blocks; raises redis.exceptions.RedisClusterException when no seed answers).
    On a cluster, every multi-key command, script and MULTI must keep its keys in one slot (see
    `sluice.redis.keys`).
    """
    connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
    if is_cluster_url(url):
        return cluster_client(url, timeout_s, connect_s)
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=connect_s,
        socket_timeout=timeout_s,
        health_check_interval=30,
    )


def is_cluster(client: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def server_now_ms(client: Any) -> int:
    """Redis's own clock in epoch ms (on a cluster, the first master's): the clock retention
    and expiry are measured by (write_slices.lua)."""
    reply = client.time()
    if isinstance(reply, dict):  # a cluster client answers per node
        reply = next(iter(reply.values()))
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """PING the server (every master of a cluster); raise RedisUnavailable with a readable
    reason if it does not answer."""
    try:
        with client_for(url, timeout_s) as c:
            for node in node_clients(c):
                node.ping()
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"redis at {redact(url)} refused the credentials: {e}") from None
    except redis.ResponseError as e:
        raise RedisUnavailable(f"redis at {redact(url)} answered with an error: {e}") from None
    except redis.exceptions.RedisClusterException as e:
        raise RedisUnavailable(
            f"redis cluster at {redact(url)} is not usable: {_said(e)}. Check that every seed in"
            " `redis:` is a node of a cluster that serves all 16384 slots (cluster_state:ok)."
        ) from None
    except (redis.RedisError, OSError) as e:
        if is_cluster_url(url):  # the slot map was read: a master of it does not answer
            raise RedisUnavailable(
                f"a master of the redis cluster at {redact(url)} does not answer: {_said(e)}."
                " Is that node down or failing over? Until a replica takes its slots over, or"
                " it is back, the cluster cannot serve them."
            ) from None
        raise RedisUnavailable(
            f"cannot reach redis at {redact(url)}: {_said(e)}. Is the server running? Check"
            " `redis:` in sluice.yaml, or omit it to use the embedded server."
        ) from None


class RedisHandle:
    """The Redis a Sluice process uses: `url` for executors, `client` for this process, and
    `local_url` for other processes on this machine (the embedded server's Unix socket, where
    it has one; else `url`).

    `persistence` holds the server's persistence settings (`appendonly`, `appendfsync`, ...) as
    `open_redis` found or made them under `durability: strict`; it is empty otherwise.
    """

    def __init__(self, url: str, embedded: EmbeddedRedis | None = None) -> None:
        self.url = url
        self.embedded = embedded
        self.local_url = url if embedded is None else embedded.local_url
        self.client = client_for(url)
        self.persistence: dict[str, str] = {}

    def close(self) -> None:
        self.client.close()
        if self.embedded is not None:
            self.embedded.stop()

    def __enter__(self) -> RedisHandle:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_redis(url: str | None, state_dir: Path, durability: Durability = "default",
               ensure: bool = True) -> RedisHandle:  # fmt: skip
    """Connect to `url`, or start/join the embedded server under `state_dir/redis` if it is None.

    Under `durability: strict` an embedded server this call starts runs with `appendfsync
    always`; a joined or external server is checked and, if needed, switched with `CONFIG SET`
    (`ensure_durability`), unless not `ensure` (a command that only reads). Blocks until the
    server answers. Raises RedisUnavailable, or ConfigError if strict durability cannot be had;
    on failure nothing this call started is left running.
    """
    if url is None:
        server = EmbeddedRedis(Path(state_dir) / "redis", appendfsync=appendfsync_for(durability),
                               keep=True)  # fmt: skip
        handle = RedisHandle(server.start().url, server)
        where = f"the embedded redis under {server.data_dir}"
    else:
        check_reachable(url)
        handle = RedisHandle(url)
        where = f"redis at {redact(url)}"
    if durability == "strict" and ensure:
        try:
            for node in node_clients(handle.client):
                kw = node.connection_pool.connection_kwargs
                at = (
                    f"{where} (node {kw.get('host')}:{kw.get('port')})"
                    if node is not handle.client
                    else where
                )
                handle.persistence = ensure_durability(node, durability, at)
        except BaseException:
            handle.close()
            raise
    return handle


def _said(e: BaseException) -> str:
    """An error's message without its closing period (redis-py ends some with one), for a
    sentence that goes on after it."""
    return str(e).rstrip(". ")
