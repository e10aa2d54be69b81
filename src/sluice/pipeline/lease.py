"""Leadership: which `sluice run` process runs the streaming queries, and with which epoch.

One lease per streaming query, in Redis (`sluice:{lease}:q:<query>`, `lua/lease.lua`). A process
takes the leases of all its queries at once, or none: it is then the **leader**, or a
**standby** that keeps a warm Spark session and takes over when the leases lapse (see
`pipeline.run`). Every acquisition is a new leadership *term* with a new epoch from the
deployment's epoch counter (`sluice:epoch`), so a later term always has a higher epoch.

Fencing. A leader that is paused (GC, SIGSTOP, a partition) can wake up after another process
took over. Three things keep it from doing harm:

1. Before each batch commits, the leader checks that it still holds the lease (`check`), and
   fails the batch if not: Spark neither commits it nor releases its input.
2. The epoch a batch writes with is fixed the first time the batch runs (`batch_epoch`): the
   epoch of the term that first ran it, recorded in `sluice:{lease}:terms:<query>` atomically
   with a check that the caller holds the lease. A batch that a new leader re-runs from the
   shared checkpoint (the same batch id and offsets) therefore writes with the same writer
   token as the attempt the old leader may still be finishing, and the store's per-token
   idempotency counts it once; every batch the new leader plans writes with its own, higher
   epoch, so the old leader's late writes lose to them. A process that lost its lease gets no
   epoch for a batch it has not run yet.
3. Spark creates each offset and commit log entry at most once, so two processes cannot both
   plan or commit one batch id.

Safety rests on the owner recorded in Redis, not on clocks: times only decide when a lapsed
lease may be taken. The holder counts its lease as valid for `ttl * VALID_SHARE` after it *sent*
a renewal (its own monotonic clock), a margin against the other hosts' clocks.

A dead leader is seen sooner than its lease lapses. The holder renews over a connection of its
own, named in the lease (`CLIENT SETNAME`); when its process dies, even by SIGKILL, the kernel
closes that connection, and a standby that finds the name gone from `CLIENT LIST` in GONE_POLLS
looks in a row takes the lease at once (seed 001's "route around the unhealthy node"). That is
safe for the same reason as above: a leader that was only cut off for a moment finds its lease
taken at its next renewal or lease check, and stands by. A host that vanishes without closing
its connections, or a Redis where `CLIENT LIST` is not allowed, waits for the ttl.

On a Redis Cluster the named connection goes to the master of the `{lease}` slot, and a standby
looks for it in `CLIENT LIST` of every master: a holder whose lease slot just moved (resharding,
a failover) is still found where its connection is, and follows the slot at its next call.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import AskError, MovedError

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.errors import LeaderConflict, LeaseLost
from sluice.pipeline.audit import logged_batches
from sluice.redis.keys import EPOCH_KEY, lease_key, terms_key
from sluice.redis.scripts import LEASE, script_source

log = logging.getLogger(__name__)

GONE_POLLS = 2  # looks in a row that must miss the holder's connection before taking over
RENEW_SHARE = 0.25  # renew every quarter of the lease's ttl
VALID_SHARE = 0.75  # the holder's own view: valid this share of the ttl after sending a renewal
CKPT_ID_FILE = "sluice-epoch"  # the checkpoint's id (and the epoch of batches from before terms)
ACQUIRE_TRIES = 8


@dataclass(frozen=True)
class Holder:
    """A lease's last holder, as recorded in Redis."""

    owner: str
    host: str
    pid: int
    conn: str
    epoch: int
    checkpoint: str
    ckpt: int
    acquired_ms: int
    renewed_ms: int
    expires_ms: int

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> Holder:
        return cls(
            owner=raw.get("owner", ""),
            host=raw.get("host", ""),
            pid=int(raw.get("pid") or 0),
            conn=raw.get("conn", ""),
            epoch=int(raw.get("epoch") or 0),
            checkpoint=raw.get("checkpoint", ""),
            ckpt=int(raw.get("ckpt") or 0),
            acquired_ms=int(raw.get("acquired_ms") or 0),
            renewed_ms=int(raw.get("renewed_ms") or 0),
            expires_ms=int(raw.get("expires_ms") or 0),
        )

    def live(self, now_ms: int) -> bool:
        return self.expires_ms > now_ms


def checkpoint_id(ckpt: Path, client: Any) -> int:
    """The id of checkpoint `ckpt`: an epoch taken once, when the checkpoint is new, and kept
    in a file beside Spark's own files. Created with a hard link, which fails if the file
    exists, so two processes starting on one new checkpoint agree on its id.

    It is also the epoch of the batches the checkpoint planned before leadership terms were
    recorded (an upgrade from a Sluice without leases).
    """
    ckpt.mkdir(parents=True, exist_ok=True)
    path = ckpt / CKPT_ID_FILE
    if not path.exists():
        tmp = path.with_name(f"{CKPT_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.write_text(str(int(client.incr(EPOCH_KEY))))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: its id is the checkpoint's
        finally:
            tmp.unlink(missing_ok=True)
    return int(path.read_text().strip())


def last_planned(ckpt: Path) -> int:
    """The newest batch in the checkpoint's offset log, or -1 for a new checkpoint."""
    return max(logged_batches(ckpt, "offsets"), default=-1)


@dataclass(frozen=True)
class Claim:
    """One streaming query a process would lead, and its checkpoint."""

    query: str
    checkpoint: Path


class Lease:
    """The leases of one process's streaming queries, taken, renewed and released together.

    Not thread-safe except `valid`, `check` and `batch_epoch`, which Spark's batch threads
    call while the keeper renews. Every call that talks to Redis may raise redis errors; the
    callers treat those as "cannot tell" (a standby waits, a leader stops committing once its
    lease is no longer `valid`).
    """

    def __init__(
        self,
        client: Any,
        claims: Sequence[Claim],
        ttl_ms: int,
        clock: Clock = SYSTEM_CLOCK,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        if not claims:
            raise ValueError("a lease needs at least one query")
        self.client = client
        self.claims = list(claims)
        self.ttl_ms = ttl_ms
        self.clock = clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        nonce = secrets.token_hex(4)
        self.owner = f"{self.host}:{self.pid}:{nonce}"
        self.conn = f"sluice-lease-{nonce}"
        self.keys = [lease_key(c.query) for c in self.claims]
        self.epoch: int | None = None  # the current term's, while leading
        self._ckpt_ids: dict[str, int] = {}
        self._valid_until = 0.0  # monotonic seconds
        self.lost = threading.Event()  # set once another process is known to hold a lease
        self._script = client.register_script(script_source(LEASE))
        self._cluster = isinstance(client, redis.RedisCluster)
        self._named: Any = None
        self._named_script: Any = None
        self._name_connection()
        self._missing: dict[str, int] = {}  # holder -> looks in a row its connection was gone
        self._lock = threading.Lock()

    def _name_connection(self) -> None:
        """The named connection's client, to the lease keys' node (see the module docstring)."""
        self._named = _named_client(self.client, self.conn, self.keys[0])
        self._named_script = (
            self._named.register_script(script_source(LEASE)) if self._named else None
        )

    @property
    def renew_every_s(self) -> float:
        return self.ttl_ms * RENEW_SHARE / 1000

    def ckpt_id(self, claim: Claim) -> int:
        if claim.query not in self._ckpt_ids:
            self._ckpt_ids[claim.query] = checkpoint_id(claim.checkpoint, self.client)
        return self._ckpt_ids[claim.query]

    # -- taking and keeping -----------------------------------------------------------------

    def try_acquire(self) -> Holder | None:
        """Take every lease if none is held by another live process: None when taken (a new
        term, `epoch` set), else the live holder. Raises LeaderConflict when that holder runs
        the same query from another checkpoint (see `conflict`)."""
        epoch = 0  # first ask whether the leases are free: no epoch is taken for a busy lease
        gone = ""
        for _ in range(ACQUIRE_TRIES):
            sent = self.clock.monotonic_s()
            where = [x for c in self.claims for x in (c.checkpoint.resolve(), self.ckpt_id(c))]
            conn = self.conn if self._named is not None else ""
            reply = self._call("acquire", self.ttl_ms, self.owner, epoch, self.host, self.pid,
                               conn, gone, *map(str, where))  # fmt: skip
            code = int(reply[0])
            if code == 1:
                with self._lock:
                    self._valid_until = sent + self.ttl_ms * VALID_SHARE / 1000
                    if epoch:
                        self.epoch = epoch
                self.lost.clear()
                return None
            if code == 0:
                holder = Holder.from_fields(_pairs(reply[2:]))
                self.conflict(self.claims[int(reply[1]) - 1], holder)
                if gone or not self._gone(holder):
                    return holder
                log.info("the leader's connection closed; taking over",
                         extra={"leader": f"{holder.host}:{holder.pid}"})  # fmt: skip
                gone = holder.owner
                continue
            newest = int(reply[1])
            epoch = int(self.client.incr(EPOCH_KEY))
            if epoch <= newest:
                epoch = int(self.client.incrby(EPOCH_KEY, newest - epoch + 1))
        raise LeaseLost(self.claims[0].query, "the epoch counter kept moving while taking it")

    def _gone(self, holder: Holder) -> bool:
        """Whether `holder`'s lease connection was missing from `CLIENT LIST` in GONE_POLLS
        looks in a row (False when it names none, or Redis refuses the command)."""
        if not holder.conn:
            return False
        try:
            names = {c.get("name") for c in self._connections()}
        except Exception as e:  # noqa: BLE001 - e.g. CLIENT not allowed: wait for the ttl
            log.debug("cannot list connections", extra={"error": str(e)})
            return False
        if holder.conn in names:
            self._missing.pop(holder.owner, None)
            return False
        self._missing = {holder.owner: self._missing.get(holder.owner, 0) + 1}
        return self._missing[holder.owner] >= GONE_POLLS

    def _connections(self) -> list[dict[str, Any]]:
        """`CLIENT LIST` of the lease's Redis: of every master, on a cluster."""
        if not self._cluster:
            return list(self.client.client_list(_type="normal"))
        per_node = self.client.client_list(
            _type="normal", target_nodes=redis.RedisCluster.PRIMARIES
        )
        if isinstance(per_node, list):  # a cluster of one master answers as a node does
            return per_node
        return [c for conns in per_node.values() for c in conns]

    def probe(self) -> None:
        """Raise LeaderConflict when a live lease of these queries is held from another
        checkpoint; reads only (a process checks this before it starts Spark)."""
        now = self.clock.now_ms()
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.hgetall(key)
        for claim, raw in zip(self.claims, pipe.execute(), strict=True):
            if raw:
                holder = Holder.from_fields(_pairs([x for kv in raw.items() for x in kv]))
                if holder.live(now):
                    self.conflict(claim, holder)

    def conflict(self, claim: Claim, holder: Holder) -> None:
        """Raise LeaderConflict when live `holder` leads `claim`'s query from another
        checkpoint: a different `state_dir` on the same Redis."""
        mine = self.ckpt_id(claim)
        if holder.ckpt in (0, mine):
            return
        raise LeaderConflict(
            f"another `sluice run` (host {holder.host}, pid {holder.pid}) leads query"
            f" `{claim.query}` on this Redis, from checkpoint {holder.checkpoint}; this"
            f" process's checkpoint is {claim.checkpoint.resolve()}. One Redis holds one"
            " pipeline's store and books: two checkpoints would count its events twice. For a"
            " standby, give this process the same `state_dir` (on storage both hosts share);"
            " otherwise stop the other process first, or give this pipeline a Redis of its own"
        )

    def renew(self) -> bool:
        """Extend every lease by the ttl; False when one is no longer ours."""
        sent = self.clock.monotonic_s()
        ok = int(self._call("renew", self.ttl_ms, self.owner)) == 1
        with self._lock:
            if ok:
                self._valid_until = sent + self.ttl_ms * VALID_SHARE / 1000
            else:
                self._valid_until = 0.0
        if not ok:
            self.lost.set()
        return ok

    def release(self) -> None:
        """Let the leases lapse now (a clean stop), so a standby takes over without waiting
        for the ttl. Never raises: at worst the leases lapse on their own."""
        with self._lock:
            self._valid_until = 0.0
            self.epoch = None
        try:
            self._call("release", self.owner)
        except Exception as e:  # noqa: BLE001 - the lease lapses by itself anyway
            log.debug("could not release the lease", extra={"error": str(e)})

    def valid(self) -> bool:
        """This process's own view: a renewal was sent less than `ttl * VALID_SHARE` ago."""
        with self._lock:
            return self.clock.monotonic_s() < self._valid_until

    # -- what the batches ask ---------------------------------------------------------------

    def check(self, query: str) -> None:
        """Before a batch of `query` commits: raise LeaseLost unless this process still leads.
        One round trip; a lease past its own validity is renewed first (a pause may have
        outlasted it while nobody took it over)."""
        if not self.valid():
            try:
                ok = self.renew()
            except Exception as e:  # noqa: BLE001 - cannot renew: not safe to commit
                raise LeaseLost(query, f"could not renew it: {e}") from None
            if not ok:
                raise LeaseLost(query, "another process holds it")
            return
        try:
            owner = self.client.hget(lease_key(query), "owner")
        except Exception as e:  # noqa: BLE001 - cannot tell: not safe to commit
            raise LeaseLost(query, f"could not read it: {e}") from None
        if owner is None or owner.decode() != self.owner:
            self.lost.set()
            raise LeaseLost(query, "another process holds it")

    def begin(self, claim: Claim) -> None:
        """Before this process starts `claim`'s query as its leader: keep the epochs of its
        checkpoint's batches from now on. The batches the checkpoint planned before (up to the
        newest in its offset log) keep the epochs they were written with: the previous term's,
        or the checkpoint's own for a checkpoint from before leases. Raises LeaseLost."""
        ckpt = self.ckpt_id(claim)
        args = [
            "begin",
            self.clock.now_ms(),
            self.owner,
            ckpt,
            ckpt,
            last_planned(claim.checkpoint),
        ]
        if int(self._script(keys=[lease_key(claim.query), terms_key(claim.query)], args=args)) < 0:
            self.lost.set()
            raise LeaseLost(claim.query, "another process holds it")

    def batch_epoch(self, claim: Claim, batch: int) -> int:
        """The epoch batch `batch` of `claim`'s query writes with (see the module docstring):
        the term's that first ran it. Raises LeaseLost when this process no longer leads."""
        ckpt = self.ckpt_id(claim)
        args = ["epoch", self.clock.now_ms(), self.owner, batch, ckpt, ckpt]
        reply = int(self._script(keys=[lease_key(claim.query), terms_key(claim.query)], args=args))
        if reply == -2:
            self.begin(claim)  # the terms were lost (Redis lost recent writes): keep them anew
            reply = int(self._script(keys=[lease_key(claim.query), terms_key(claim.query)],
                                     args=args))  # fmt: skip
        if reply < 0:
            self.lost.set()
            raise LeaseLost(claim.query, "another process holds it")
        return reply

    def _call(self, op: str, *args: Any) -> Any:
        """Run `op` on every lease, over the named connection when there is one. On a cluster
        whose `{lease}` slot moved (or whose master failed over), the named connection follows
        it first."""
        if self._named_script is None:
            return self._script(keys=self.keys, args=[op, self.clock.now_ms(), *args])
        try:
            return self._named_script(keys=self.keys, args=[op, self.clock.now_ms(), *args])
        except (MovedError, AskError, redis.ConnectionError):
            if not self._cluster:  # one Redis: the caller retries (a reconnect is automatic)
                raise
        old = self._named
        self.client.nodes_manager.initialize()  # the slot map as it is now
        self._name_connection()
        self._named.ping()  # connected (and named) before the standbys look for it
        old.connection_pool.disconnect()  # its name must not be found on the old master
        log.info("the lease's slot moved; its connection follows", extra={"node": self._where()})
        return self._named_script(keys=self.keys, args=[op, self.clock.now_ms(), *args])

    def _where(self) -> str:
        kw = self._named.connection_pool.connection_kwargs if self._named else {}
        return f"{kw.get('host')}:{kw.get('port')}"


def _named_client(client: Any, name: str, key: str) -> Any:
    """A client like `client` whose connections carry `name` (set again on every reconnect),
    for the holder's own calls: to `key`'s master on a cluster. None for a client of neither
    kind (the lease then waits for the ttl)."""
    if isinstance(client, redis.RedisCluster):
        node = client.get_node_from_key(key)
        pool = node.redis_connection.connection_pool if node.redis_connection else None
        if pool is None:
            return None
        kw = pool.connection_kwargs
        # The node's own pool also carries the cluster client's hooks; a plain connection
        # needs only where and how to connect.
        kwargs = {k: kw[k] for k in _CONNECT_KWARGS if k in kw}
        return redis.Redis(
            connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class, max_connections=2,
                client_name=name, **kwargs,
            )
        )  # fmt: skip
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    kwargs = {**pool.connection_kwargs, "client_name": name}
    return redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, max_connections=2, **kwargs
        )
    )


_CONNECT_KWARGS = (
    "host", "port", "username", "password", "credential_provider", "socket_timeout",
    "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options", "ssl_keyfile",
    "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data",
    "ssl_check_hostname", "ssl_password",
)  # fmt: skip


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    items = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
    return dict(zip(items[::2], items[1::2], strict=True))


class Keeper(threading.Thread):
    """Renews a held lease every `lease.renew_every_s` until `stop()`; calls `on_lost` once
    when a renewal finds another owner, or when the lease outlived its validity because
    Redis could not be reached or `stalled` (the work the lease stands for has stopped: see
    `standby.JvmProbe`) said why not to renew."""

    def __init__(
        self,
        lease: Lease,
        on_lost: Callable[[str], None],
        stalled: Callable[[], str | None] = lambda: None,
    ) -> None:
        super().__init__(name="sluice-lease", daemon=True)
        self.lease = lease
        self.on_lost = on_lost
        self.stalled = stalled
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()

    def run(self) -> None:
        while not self._done.wait(self.lease.renew_every_s):
            stalled = self.stalled()
            if stalled is not None:  # not renewed: the lease lapses and a standby takes over
                if self.lease.valid():
                    continue
                reason = stalled
            else:
                try:
                    if self.lease.renew():
                        continue
                    reason = "another process holds it"
                except Exception as e:  # noqa: BLE001 - retried until the lease is not valid
                    if self.lease.valid():
                        log.debug("lease renewal failed", extra={"error": str(e)})
                        continue
                    reason = f"could not renew it in time: {e}"
            self.lease.lost.set()
            if not self._done.is_set():
                self.on_lost(reason)
            return
