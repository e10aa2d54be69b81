"""A port found free can be taken by another program before redis-server binds it (the suite's
servers and other processes on one machine pick ports at the same time): the embedded server
and the local cluster then take another port, and never mistake what holds the first for
their own server. Real redis-server processes; the port chooser is told which port to offer
first, one a plain TCP listener holds."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.redis import embedded, local_cluster
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.local_cluster import LocalCluster


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port held by a program that accepts and answers nonsense."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"*1\r\n$2\r\nno\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


def offering_first(port: int, then: object) -> object:
    """A port chooser that offers `port` once, then what `then` offers."""
    offered = [port]

    def choose() -> int:
        return offered.pop() if offered else then()  # type: ignore[operator]

    return choose


def test_the_embedded_server_takes_another_port_when_its_first_is_taken(
    taken: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded, "_free_port", offering_first(taken, embedded._free_port))
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        assert server.port != taken
        conf = server.data_dir / "redis.conf"
        assert server.port is not None and embedded.answers_as(server.port, conf)
        assert not embedded.answers_as(taken, conf)
    finally:
        server.stop()


def test_a_cluster_node_takes_another_port_when_its_first_is_taken(
    taken: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chooser = offering_first(taken, local_cluster._free_cluster_port)
    monkeypatch.setattr(local_cluster, "_free_cluster_port", chooser)
    with LocalCluster(tmp_path / "cluster", masters=2) as cluster:
        assert taken not in cluster.ports and len(cluster.ports) == 2


def test_a_paused_server_is_named_as_such_not_as_a_foreign_program(tmp_path: Path) -> None:
    """A second process joining the embedded server while it is paused (SIGSTOP): the error
    says the server is paused or busy, not that another program holds the port (removing the
    port file under a live server would start a second one on its data)."""
    import os
    import signal

    from sluice.errors import RedisUnavailable

    server = EmbeddedRedis(tmp_path / "redis").start()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RedisUnavailable, match=r"pid \d+, port \d+\) accepts .* paused"):
            EmbeddedRedis(tmp_path / "redis").start(timeout_s=1.0)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()
