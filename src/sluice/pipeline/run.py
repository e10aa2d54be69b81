"""The whole pipeline `sluice run` runs: one streaming query per fold and stage, supervised.

A config without `stages:` is one query, the source's fold, exactly as before stages existed.
With stages, every stream-to-stream stage and every stream folded by metrics is its own query in
the same Spark application (each with its own checkpoint, reader offsets, writer tokens and
batch records), and one supervisor restarts whichever fails.

Only the process that holds the leases of its queries runs them; a second `sluice run` on the
same config stands by with a warm Spark session and takes over when the leases lapse (see
`pipeline.standby` and `pipeline.lease`).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from pyspark.sql import SparkSession

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import ConfigError
from sluice.graph import Graph, fold_stage, graph_topology, store_stage
from sluice.pipeline.definitions import check_definitions
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.lease import Claim, Lease
from sluice.pipeline.query import Role, StreamQuery, checkpoint_dir
from sluice.pipeline.schemas import resolve_schemas
from sluice.pipeline.stage import StageQuery
from sluice.pipeline.standby import Roles
from sluice.redis.connection import RedisHandle
from sluice.status.coverage import new_metric_notes
from sluice.status.roles import query_names

log = logging.getLogger(__name__)

POLL_SHARE = 0.125  # a standby looks at the lease every eighth of its ttl ...
MAX_POLL_S = 0.1  # ... and at least this often (a dead leader is seen in two looks)


def build_queries(
    cfg: Config,
    redis: RedisHandle,
    spark: SparkSession,
    clock: Clock = SYSTEM_CLOCK,
    only: tuple[str, ...] = (),
) -> tuple[Graph, list[StreamQuery]]:
    """The graph, resolved against Spark, and its queries (stages first, then the folds),
    prepared; with `only`, just the queries named there (other applications run the rest).
    Raises ConfigError naming the field for anything Spark refuses."""
    check_only(cfg, only)
    graph = resolve_schemas(graph_topology(cfg), spark)
    queries: list[StreamQuery] = []
    for st in graph.stages:
        if only and st.name not in only:
            continue
        role = Role.of(graph, st.name, st.from_)
        queries.append(StageQuery(cfg, graph, st, role, redis, spark, clock))
    for stream in graph.folds:
        name = fold_stage(cfg, stream)
        if only and name not in only:
            continue
        role = Role.of(graph, name, [stream], store_stage(cfg, stream))
        queries.append(FoldQuery(graph.fold_config(stream), redis, spark, clock, role=role))
    for q in queries:
        try:
            q.prepare()
        except ConfigError as e:
            raise _config_path(cfg, graph, q, e) from None
    return graph, queries


def check_only(cfg: Config, only: tuple[str, ...]) -> None:
    """Raise ConfigError for a `--stage` that names no query of `cfg` (needs no Spark)."""
    names = query_names(cfg)
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(
            f"--stage: no query named {', '.join(unknown)}; this config has {', '.join(names)}"
        )


def refuse_other_checkpoint(cfg: Config, client: Any, only: tuple[str, ...] = ()) -> None:
    """Raise LeaderConflict when another process leads these queries from another checkpoint
    (another `state_dir` on the same Redis). Needs no Spark: `sluice run` checks
    it first, so a refused process says so in a second."""
    claims = [Claim(n, checkpoint_dir(cfg, n)) for n in query_names(cfg) if not only or n in only]
    if claims:
        Lease(client, claims, cfg.lease.ttl).probe()


def _config_path(cfg: Config, graph: Graph, q: StreamQuery, e: ConfigError) -> ConfigError:
    """A fold's config lists only its own metrics: name the metric as the user's file does."""
    m = re.match(r"metrics\[(\d+)\](.*)", e.path)
    if m is None or not isinstance(q, FoldQuery):
        return e
    metric = q.cfg.metrics[int(m.group(1))]
    i = cfg.metrics.index(metric)
    message = str(e).split(": ", 1)[1] if str(e).startswith("config error") else str(e)
    return ConfigError(message, f"metrics[{i}]{m.group(2)}")


class Pipeline:
    """The running graph. `prepare()` builds its queries (talks to Spark and Redis; raises
    ConfigError); `run_forever()` stands by or leads (`pipeline.standby`) until
    `request_stop()`, then every query stops and the lease is released. It raises
    LeaderConflict when another checkpoint leads the same queries."""

    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
        only: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.spark = spark
        self.clock = clock
        self.only = only
        self.graph: Graph | None = None
        self.queries: list[StreamQuery] = []
        self.lease: Lease | None = None
        self.roles: Roles | None = None
        self._stop = threading.Event()

    def prepare(self) -> None:
        if self.lease is None:
            self.graph, self.queries = build_queries(
                self.cfg, self.redis, self.spark, self.clock, self.only
            )
            check_definitions(self.redis.client, self.cfg)  # before any slice is written
            for note in new_metric_notes(self.redis.client, self.cfg):
                log.warning(note)
            claims = [q.claim for q in self.queries]
            self.lease = Lease(self.redis.client, claims, self.cfg.lease.ttl, self.clock)
            for q in self.queries:
                q.lease_owner = self.lease.owner

    def run_forever(self) -> None:
        self.prepare()
        assert self.lease is not None
        poll_s = min(MAX_POLL_S, self.cfg.lease.ttl * POLL_SHARE / 1000)
        self.roles = Roles(self.queries, self.lease, self.redis.client, self.clock, self._stop,
                           poll_s)  # fmt: skip
        self.roles.run()

    def request_stop(self) -> None:
        self._stop.set()
