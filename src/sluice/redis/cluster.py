"""Redis Cluster addresses and clients.

A cluster is named by one URL, so that it travels to the executors like any other:

    redis+cluster://127.0.0.1:7000                      one seed node
    redis+cluster://:secret@10.0.0.1:7000,10.0.0.2:7000  several seeds, a password
    rediss+cluster://user:secret@redis.example:6380     TLS

The seeds are only where the client starts: it asks any of them for the slot map and then talks
to every master directly. `sluice.yaml` may also give a YAML list of `redis://host:port` seeds;
the config turns it into this URL (`seeds_to_url`). A cluster has one database, so no `/db`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import PRIMARY, ClusterNode, RedisCluster
from redis.retry import Retry

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_RETRIES = 8


@dataclass(frozen=True)
class ClusterAddress:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False

    def url(self) -> str:
        scheme = CLUSTER_SCHEMES[1] if self.tls else CLUSTER_SCHEMES[0]
        auth = ""
        if self.password is not None or self.username is not None:
            auth = f"{self.username or ''}:{self.password or ''}@"
        return f"{scheme}://{auth}{','.join(f'{h}:{p}' for h, p in self.nodes)}"


def is_cluster_url(url: str | None) -> bool:
    return url is not None and url.split("://", 1)[0] in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterAddress:
    """Split a `redis+cluster://` URL. Raises ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        raise ValueError(
            f"a cluster URL starts with redis+cluster:// or rediss+cluster://: {url!r}"
        )
    rest = rest.split("?", 1)[0]
    auth, at, hosts = rest.rpartition("@")
    if hosts.endswith("/0"):
        hosts = hosts[:-2]
    elif "/" in hosts:
        raise ValueError(
            "a Redis Cluster has only database 0;"
            f" remove the `/db` part of {redact_cluster_url(url)!r}"
        )
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"cluster seed {part!r} must be host:port, in {redact_cluster_url(url)!r}"
            )
        nodes.append((host.strip("[]"), int(port)))
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    return ClusterAddress(tuple(nodes), username, password, scheme == CLUSTER_SCHEMES[1])


def seeds_to_url(seeds: list[str]) -> str:
    """`[redis://h1:p1, redis://h2:p2]` -> `redis+cluster://h1:p1,h2:p2` (credentials and TLS
    from the first seed; all seeds must agree on them). Raises ValueError."""
    if not seeds:
        raise ValueError("a list of cluster seeds must not be empty")
    nodes: list[tuple[str, int]] = []
    auth: set[tuple[str | None, str | None, bool]] = set()
    for seed in seeds:
        if not isinstance(seed, str) or not seed.startswith(("redis://", "rediss://")):
            raise ValueError(f"cluster seed {seed!r} must be a redis:// or rediss:// URL")
        parts = urlsplit(seed)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ValueError(f"cluster seed {redact_cluster_url(seed)!r} must name host and port")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(
                f"a Redis Cluster has only database 0; {redact_cluster_url(seed)!r} names another"
            )
        nodes.append((parts.hostname, port))
        user = unquote(parts.username) if parts.username else None
        pw = unquote(parts.password) if parts.password is not None else None
        auth.add((user, pw, parts.scheme == "rediss"))
    if len(auth) > 1:
        raise ValueError("all cluster seeds must use the same scheme and credentials")
    user, pw, tls = auth.pop()
    return ClusterAddress(tuple(nodes), user, pw, tls).url()


def redact_cluster_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    auth, at, hosts = rest.rpartition("@")
    if not at or ":" not in auth:
        return url
    return f"{scheme}{sep}{auth.split(':', 1)[0]}:***@{hosts}"


class _Cluster(RedisCluster):
    """`RedisCluster` that follows an ASK to a master it has not met yet. A master that joined
    since the client last read the slot map (a machine added, then slots migrated onto it)
    answers an ASK redirect; redis-py looks the redirect's node up by name in its cache, finds
    none and fails with AttributeError, where a MOVED adds the node. Here the named node is
    added as a master, as a MOVED would add it."""

    def get_node(self, host: Any = None, port: Any = None, node_name: Any = None) -> Any:
        node = super().get_node(host, port, node_name)
        if node is None and node_name and ":" in node_name:
            h, p = node_name.rsplit(":", 1)
            new = ClusterNode(h, int(p), PRIMARY)
            node = self.nodes_manager.nodes_cache.setdefault(new.name, new)
        return node


def cluster_client(url: str, timeout_s: float, connect_timeout_s: float | None = None) -> Any:
    """A `RedisCluster` (bytes replies) for a cluster URL. Connects to a seed to read the slot
    map, so it blocks and raises redis.RedisClusterException / ConnectionError when no seed
    answers."""
    addr = parse_cluster_url(url)
    return _Cluster(
        startup_nodes=[ClusterNode(h, p) for h, p in addr.nodes],
        username=addr.username,
        password=addr.password,
        ssl=addr.tls,
        socket_connect_timeout=timeout_s if connect_timeout_s is None else connect_timeout_s,
        socket_timeout=timeout_s,
        # A node that is down or a slot not served yet (a failover, a restart) is retried with
        # a slot map refresh in between, for about CLUSTER_RETRIES * 1 s at most.
        retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), CLUSTER_RETRIES),
    )


def node_clients(client: Any) -> list[Any]:
    """One plain client per master: the cluster's masters, or just `client` itself. For what
    is asked of each server (INFO, CONFIG), since a cluster client sends those to one node."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]
