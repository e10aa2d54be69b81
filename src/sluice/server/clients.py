"""The server's asyncio Redis clients, one per event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from sluice.redis.connection import is_cluster
from sluice.redis.mux import MuxClient


class AsyncClients:
    """One asyncio Redis client per event loop, built from the sync client's connection settings:
    a `MuxClient` (one multiplexed connection) for a single Redis over TCP or a Unix socket,
    redis-py's asyncio clients for TLS and for a cluster.

    uvicorn runs one loop per worker; Starlette's TestClient may start a loop per request, and an
    asyncio connection must not be used from another loop than the one that opened it.
    """

    def __init__(self, client: Any) -> None:
        self._by_loop: dict[int, Any] = {}
        self.cluster: list[tuple[str, int]] | None = None
        self.kind = ""
        if is_cluster(client):
            # Seeds: the masters the sync client found; credentials and TLS from its settings.
            self.cluster = [(n.host, n.port) for n in client.get_primaries()]
            conn = client.nodes_manager.connection_kwargs
            keep = ("username", "password", "socket_timeout", "socket_connect_timeout")
            self.kwargs = {k: v for k, v in conn.items() if k in keep}
            if conn.get("connection_class") is not None:
                self.kwargs["ssl"] = conn["connection_class"].__name__ == "SSLConnection"
            return
        pool = client.connection_pool
        kind = pool.connection_class.__name__  # Connection, SSLConnection or UnixDomain...
        allowed = _ASYNC_KWARGS + (_SSL_KWARGS if kind == "SSLConnection" else ())
        self.kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in allowed}
        self.kind = kind

    def get(self) -> Any:
        loop = id(asyncio.get_running_loop())
        found = self._by_loop.get(loop)
        if found is None and self.cluster is not None:
            nodes = [ClusterNode(h, p) for h, p in self.cluster]
            found = self._by_loop[loop] = RedisCluster(startup_nodes=nodes, **self.kwargs)
        if found is None:
            if len(self._by_loop) > 64:  # loops of finished test requests
                self._by_loop.clear()
            if self.kind == "SSLConnection":
                pool = aredis.ConnectionPool(connection_class=aredis.SSLConnection, **self.kwargs)
                found = aredis.Redis(connection_pool=pool)
            else:  # TCP or a Unix socket: one multiplexed connection
                found = MuxClient(**self.kwargs)
            self._by_loop[loop] = found
        return found


_ASYNC_KWARGS: tuple[str, ...] = (
    "host", "port", "db", "username", "password", "socket_timeout", "socket_connect_timeout",
    "path", "client_name",
)  # fmt: skip
_SSL_KWARGS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname")
