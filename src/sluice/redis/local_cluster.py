"""A Redis Cluster of local `redis-server` processes (masters only, loopback), for tests and
benchmarks: the same binary as the embedded server (`embedded.find_server_binary`).

    with LocalCluster(tmp_dir, masters=3) as cluster:
        cfg = {"redis": cluster.url, ...}     # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...

Master i serves the i-th of `masters` equal, contiguous slot ranges, as `redis-cli --cluster
create` would assign them. A node can be stopped and started again in place (`restart_node`);
with `appendonly` it comes back with its data and, from its nodes file, its slots. A slot can be
moved to another master with its keys, under load (`migrate_slot`), and a master with no slots
can join the running cluster (`add_master`), to take slots that way. A master that gives away
its last slot stays a master (`cluster-allow-replica-migration no`), so slots can come back to it.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import redis

from sluice.errors import RedisUnavailable
from sluice.redis.embedded import answers_as, find_server_binary, on_a_free_port, shutdown

SLOTS = 16384


def _free_cluster_port() -> int:
    """A loopback port p with p + 10000 (the cluster bus) free too; Redis needs p <= 55535."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RedisUnavailable("no free port pair (p, p + 10000) for a cluster node")


class LocalCluster:
    def __init__(self, data_dir: Path, masters: int = 3, appendonly: bool = False,
                 node_timeout_ms: int = 2000) -> None:  # fmt: skip
        """`node_timeout_ms`: Redis's `cluster-node-timeout`, after which a master that does
        not answer is marked failed, and the others refuse writes (`cluster_state:fail`)."""
        if masters < 1:
            raise ValueError(f"`masters` must be at least 1, got {masters}")
        self.data_dir = Path(data_dir)
        self.masters = masters  # master nodes now (`add_master` adds one)
        self.initial = masters  # the masters the slots were first split over
        self.appendonly = appendonly
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes] | None] = []
        self.moved: dict[int, int] = {}  # slot -> master, for slots moved by `migrate_slot`

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def slot_range(self, i: int) -> tuple[int, int]:
        """The slots (first, last) master i serves."""
        return i * SLOTS // self.initial, (i + 1) * SLOTS // self.initial - 1

    def node_of_slot(self, slot: int) -> int:
        """The master serving `slot`: its initial one, unless `migrate_slot` moved it."""
        return self.moved.get(slot, slot * self.initial // SLOTS)

    def migrate_slot(self, slot: int, to: int, batch: int = 100) -> int:
        """Move `slot` and its keys to master `to` while clients keep using it, as
        `redis-cli --cluster reshard` does: IMPORTING/MIGRATING, MIGRATE the keys in batches,
        then SETSLOT NODE on every master. Returns the keys moved. Blocks."""
        src = self.node_of_slot(slot)
        if src == to:
            return 0
        ids = []
        for i in range(self.masters):
            with self._client(i) as c:
                myid = c.execute_command("CLUSTER MYID")
                ids.append(myid.decode() if isinstance(myid, bytes) else str(myid))
        moved = 0
        with self._client(src) as a, self._client(to) as b:
            b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
            a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[to])
            while keys := a.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
                a.execute_command(
                    "MIGRATE", "127.0.0.1", self.ports[to], "", 0, 10_000, "KEYS", *keys
                )
                moved += len(keys)
            b.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[to])
            a.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[to])
        for i in range(self.masters):
            if i not in (src, to):
                with self._client(i) as c:
                    c.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[to])
        self.moved[slot] = to
        return moved

    def _conf(self, port: int) -> Path:
        conf = self.data_dir / f"redis-{port}.conf"
        conf.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {port}",
                    f'dir "{self.data_dir.resolve()}"',
                    "cluster-enabled yes",
                    f"cluster-config-file nodes-{port}.conf",
                    f"cluster-node-timeout {self.node_timeout_ms}",
                    # A master whose last slot moves away stays a master with no slots. By
                    # default (6.2+) it would turn into a replica of the slot's new owner, and a
                    # later `migrate_slot` to it would fail ("use SETSLOT only with masters").
                    "cluster-allow-replica-migration no",
                    f"appendonly {'yes' if self.appendonly else 'no'}",
                    f'appendfilename "appendonly-{port}.aof"',
                    "appendfsync everysec",
                    'save ""',
                    "daemonize no",
                    "protected-mode yes",
                    "loglevel warning",
                    f'logfile "redis-{port}.log"',
                ]
            )
            + "\n"
        )
        return conf

    def _spawn(self, port: int, timeout_s: float) -> subprocess.Popen[bytes]:
        conf = self._conf(port)
        proc = subprocess.Popen(
            [find_server_binary(), str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = self.data_dir / f"redis-{port}.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise RedisUnavailable(f"cluster node on port {port} exited: {tail.strip()}")
            if answers_as(port, conf):
                return proc
            time.sleep(0.05)
        proc.kill()
        raise RedisUnavailable(f"cluster node on port {port} did not answer within {timeout_s}s")

    def _spawn_new(self, timeout_s: float) -> int:
        """Start a node on a free port (another, when a program takes it first); its port."""
        port, proc = on_a_free_port(
            _free_cluster_port, lambda port: (port, self._spawn(port, timeout_s))
        )
        self.ports.append(port)
        self.procs.append(proc)
        return port

    def _client(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.ports[i], socket_timeout=10)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start the masters, give each its slots, join them; blocks until `cluster_state:ok`
        on every node. Raises RedisUnavailable; on failure nothing started is left running."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            for _ in range(self.initial):
                self._spawn_new(timeout_s)
            for i in range(self.initial):
                first, last = self.slot_range(i)
                with self._client(i) as c:
                    c.execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
            with self._client(0) as c:
                for port in self.ports[1:]:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", port)
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Block until every node is up, sees all masters, and reports `cluster_state:ok`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self._node_ok(i) for i in range(self.masters)):
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RedisUnavailable(f"the local cluster was not ok within {timeout_s}s")
            time.sleep(0.1)

    def _node_ok(self, i: int) -> bool:
        with self._client(i) as c:
            info = c.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
            return (
                str(info.get("cluster_state")) == "ok"
                and int(info.get("cluster_known_nodes", 0)) == self.masters
            )

    def stop_node(self, i: int) -> None:
        """SHUTDOWN node i (its AOF is flushed first when `appendonly`)."""
        proc = self.procs[i]
        if proc is None:
            return
        shutdown(proc, self.ports[i], nosave=not self.appendonly)
        self.procs[i] = None

    def start_node(self, i: int, timeout_s: float = 30.0) -> None:
        """Start node i again on its port, from its config and nodes file; blocks until the
        cluster is ok again."""
        if self.procs[i] is None:
            self.procs[i] = self._spawn(self.ports[i], timeout_s)
        self.wait_ok(timeout_s)

    def add_master(self, timeout_s: float = 30.0) -> int:
        """Start one more master, with no slots, and join it to the running cluster (`CLUSTER
        MEET`), as an operator adding a machine does before resharding onto it; blocks until
        every node knows it. Returns its index, for `migrate_slot(slot, to=index)`."""
        port = self._spawn_new(timeout_s)
        self.masters += 1
        with self._client(0) as c:
            c.execute_command("CLUSTER MEET", "127.0.0.1", port)
        self.wait_ok(timeout_s)
        return self.masters - 1

    def restart_node(self, i: int, down_s: float = 0.0) -> None:
        self.stop_node(i)
        time.sleep(down_s)
        self.start_node(i)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.stop_node(i)

    def flushall(self) -> None:
        for i in range(self.masters):
            with self._client(i) as c:
                c.flushall()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
