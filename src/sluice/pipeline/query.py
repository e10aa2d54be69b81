"""One streaming query of a pipeline, and the lifecycle every kind shares.

A pipeline runs one streaming query per fold (metrics into the slice store, `pipeline.fold`)
and per stream-to-stream stage (`pipeline.stage`). Each has:

- its **checkpoint** (`state_dir/checkpoint` for the source's fold, as a pipeline without stages
  always had; `state_dir/checkpoints/<stage>` for the others);
- its **writer epochs**: under a leadership lease (`sluice run`), each batch's epoch is the
  epoch of the term that first ran it (`pipeline.lease`), so a batch re-run after a crash or a
  failover writes with the same token (`writer_token`) and stays idempotent, while the new
  leader's own batches outrank anything the old one may still write; without a lease (tests,
  benchmarks, the demo) every batch uses the checkpoint's own epoch (`writer_epoch`);
- its **batch records**: counters, the newest batch and the freshness histogram, written once
  per token by `lua/record_batch.lua` (`sluice:{stats[:<stage>]}`);
- its **role** in the graph: its flow stage, its reader name and the readers of its input.

Construction has no side effects; `prepare()` (called by `start()`) talks to Spark and Redis.
`warm_up()` exercises the plan on a static frame, so that a standby's first real batch finds
the JVM's generated code and the Python workers ready. `start()` returns once the query runs;
batches run on Spark's threads. `stop()` stops after the batch in flight: the checkpoint makes
a batch cut short re-run on the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import ConfigError, PipelineError
from sluice.files import read_text, replace_text
from sluice.graph import (
    SPARK,
    FlowStage,
    Graph,
    KafkaSpec,
    StreamsSpec,
    graph_topology,
    reader_name,
)
from sluice.pipeline import timing
from sluice.pipeline.lease import Claim, Lease, checkpoint_id, last_planned
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import FOLDING_KEY, StatsKeys, arm_key, lease_key, stats_keys
from sluice.redis.scripts import RECORD_BATCH, script_source
from sluice.source.arm import GO, STOP, signal
from sluice.source.options import FlowOptions, SourceOptions
from sluice.source.reader import FORMAT, START_FILE
from sluice.status import freshness

log = logging.getLogger(__name__)

TOKEN_EPOCH = 10**12


def writer_token(epoch: int, batch_id: int) -> int:
    """A batch's writer token: grows across the life of a deployment (see pipeline.writer)."""
    return epoch * TOKEN_EPOCH + batch_id


def checkpoint_dir(cfg: Config, stage: str = SPARK) -> Path:
    """The source's fold keeps the checkpoint of a pipeline without stages; every other stage
    has its own under `checkpoints/` (`fold:x` as `fold-x`: Hadoop paths refuse a colon)."""
    if stage == SPARK:
        return Path(cfg.state_dir) / "checkpoint"
    return Path(cfg.state_dir) / "checkpoints" / stage.replace(":", "-")


LOG_FILE = "sluice-log.json"  # beside a checkpoint: the log its positions are in


def check_log(ckpt: Path, log: StreamsSpec | KafkaSpec) -> None:
    """Refuse a checkpoint whose positions are in another log than the config's: a Kafka
    checkpoint holds offsets per partition number, which mean nothing in another topic (read
    from them, a new topic's records before them would be skipped for good). Redis Streams
    positions are per stream key, so a renamed stream is simply a new one. A checkpoint that
    planned no batch yet just forgets the old topic and where it would have started in it."""
    if not isinstance(log, KafkaSpec):
        return
    path = ckpt / LOG_FILE
    kept = read_text(path)
    was = None if kept is None else orjson.loads(kept).get("kafka_topic")
    if was == log.topic:
        return
    if was is not None and last_planned(ckpt) >= 0:
        raise ConfigError(
            f"the checkpoint in {ckpt} holds offsets in Kafka topic {was!r}, not {log.topic!r}:"
            f" offsets are positions in one topic, and read from them {log.topic!r} would skip"
            f" records. Set the topic back to {was!r}, or give {log.topic!r} a state_dir of its"
            " own: its checkpoint then starts at `source.kafka.start`",
            "source.kafka.topic",
        )
    if was is not None:
        (ckpt / START_FILE).unlink(missing_ok=True)
    replace_text(path, orjson.dumps({"kafka_topic": log.topic}).decode())


def query_name(stage: str) -> str:
    return "sluice" if stage == SPARK else f"sluice-{stage.replace(':', '-')}"


def writer_epoch(ckpt: Path, client: Any) -> int:
    """The epoch of every batch of a query run without a lease: the checkpoint's own, taken
    from Redis once, when the checkpoint is new (`lease.checkpoint_id`), and kept beside it, so
    a restart from the same checkpoint re-runs its batches with the same writer tokens."""
    return checkpoint_id(ckpt, client)


def stop_query(q: StreamingQuery | None, grace_s: float) -> None:
    """Stop `q` after the batch in flight, waiting at most `grace_s`; the checkpoint makes any
    batch cut short re-run on the next start, so a hard stop loses nothing either."""
    if q is None:
        return
    deadline = time.monotonic() + grace_s
    while q.isActive and time.monotonic() < deadline:
        if not q.status.get("isTriggerActive", False):
            break
        time.sleep(0.05)
    if q.isActive:
        q.stop()


@dataclass(frozen=True)
class Role:
    """Where one streaming query sits in the graph: its flow stage, its reader name and the
    readers of each input shard, and the flow stage of the store it feeds (a fold's)."""

    stage: FlowStage
    reader: str = ""
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    store: FlowStage | None = None

    @classmethod
    def of(cls, graph: Graph, stage: str, inputs: list[str], store: str | None = None) -> Role:
        return cls(
            graph.flow[stage],
            reader_name(stage),
            graph.shard_readers(inputs),
            graph.flow[store] if store is not None else None,
        )

    @classmethod
    def single(cls, cfg: Config) -> Role:
        """The source's fold, in a pipeline without stages."""
        return cls.of(graph_topology(cfg), SPARK, [cfg.source.stream], "store")

    @property
    def recorded_shards(self) -> frozenset[str] | None:
        """The input shards whose undecodable entries this reader records as dead letters:
        those it reads first, so that an entry read by several readers is recorded once (each
        still counts it in its own books). None: every shard it reads."""
        mine = frozenset(s for s, names in self.readers.items() if names[:1] == (self.reader,))
        return None if len(mine) == len(self.readers) else mine

    @property
    def stats(self) -> StatsKeys:
        return stats_keys(self.stage.name)

    def source_options(self, base: SourceOptions, cfg: Config, ckpt: Path) -> SourceOptions:
        """`base` read by this role: its reader, the readers it shares the input with, its
        flow valve and its checkpoint."""
        flow = FlowOptions(
            cfg.backpressure,
            cfg.spark.trigger,
            self.stage.name,
            self.stage.upstreams,
            self.stage.inputs,
            # A stream read by others too: its own backlog, not the slowest reader's.
            own_level=any(len(r) > 1 for r in self.readers.values()),
        )
        return dataclasses.replace(
            base, reader=self.reader, readers=self.readers, flow=flow, checkpoint=str(ckpt)
        )


class StreamQuery(ABC):
    """The shared lifecycle (see the module docstring). Subclasses build the streaming
    DataFrame (`frame`) and process each micro-batch (`process_batch`)."""

    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        role: Role,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.spark = spark
        self.role = role
        self.clock = clock
        self.name = role.stage.name
        self.ckpt = checkpoint_dir(cfg, self.name)
        self.query: StreamingQuery | None = None
        self.lease: Lease | None = None  # set by `pipeline.standby` while this process leads
        self.lease_owner: str | None = None  # set by `pipeline.run`: fences the source
        self.epoch: int | None = None  # the checkpoint's, for batches run without a lease
        self.timings = timing.BatchTimings(redis.client, self.name)
        self._epochs: dict[int, int] = {}
        self._started_s: float | None = None  # monotonic time of start(), until its first batch
        self._frame: DataFrame | None = None
        self._record: Any = None
        self._stop = threading.Event()
        self._armed: tuple[str, StreamingQuery] | None = None  # (its key, the query), see `arm`
        self._arming: str | None = None  # the key while `arm` builds the frame
        self._arms = 0
        self._let_go = False  # the running query was armed, then let go

    @property
    def claim(self) -> Claim:
        return Claim(self.name, self.ckpt)

    def prepare(self) -> None:
        """Check what needs Spark. Idempotent; raises ConfigError for a config that Spark
        refuses, or that its checkpoint cannot be read with (`check_log`)."""
        if self._record is None:
            check_log(self.ckpt, self.base_options().log)
            self._record = self.redis.client.register_script(script_source(RECORD_BATCH))

    def warm_up(self) -> None:
        """Build the streaming frame (Spark resolves the source's schema in a Python worker)
        and keep it for `start`. Subclasses also run their plan on a static frame. Writes
        nothing; safe to call again (a standby repeats it to keep its Python workers)."""
        self.prepare()
        if self._frame is None:
            self._frame = self.frame()

    def token(self, batch_id: int) -> int:
        """The writer token of batch `batch_id` (see the module docstring)."""
        epoch = self._epochs.get(batch_id)
        if epoch is None:
            if self.epoch is None:
                self.epoch = writer_epoch(self.ckpt, self.redis.client)
            epoch = self.epoch
        return writer_token(epoch, batch_id)

    @abstractmethod
    def base_options(self) -> SourceOptions:
        """The source this query reads, before its role is applied."""

    def source_options(self) -> SourceOptions:
        return self.role.source_options(self.base_options(), self.cfg, self.ckpt)

    def read_stream(self, session: SparkSession | None = None) -> DataFrame:
        opts = self.source_options()
        if self.lease_owner is not None:
            opts = dataclasses.replace(opts, lease=(lease_key(self.name), self.lease_owner))
        if self._arming is not None:
            opts = dataclasses.replace(opts, armed=self._arming)
        spark_opts = opts.to_spark()
        return (session or self.spark).readStream.format(FORMAT).options(**spark_opts).load()

    @abstractmethod
    def frame(self) -> DataFrame:
        """The streaming DataFrame each micro-batch of which `process_batch` gets."""

    @abstractmethod
    def process_batch(self, df: DataFrame, batch_id: int) -> dict[str, Any]:
        """foreachBatch body; returns the batch record. Safe to re-run with the same id."""

    def _on_batch(self, df: DataFrame, batch_id: int) -> None:
        """foreachBatch: under a lease, fix the batch's epoch first and check the lease last,
        so a process that lost it neither writes a batch it had not started nor commits one
        (LeaseLost fails the batch; Spark then commits nothing)."""
        q = self.query
        if q is not None:  # the previous batch's time breakdown, now that Spark reported it
            self.timings.publish_last(q)
        if self._started_s is not None:  # how long a (re)start or takeover took to a batch
            since_ms = round((time.monotonic() - self._started_s) * 1000)
            log.info("first batch", extra={"stage": self.name, "batch": batch_id,
                                           "since_start_ms": since_ms,
                                           "armed": self._let_go})  # fmt: skip
            self._started_s = None
        lease = self.lease
        if lease is not None:
            self._epochs[batch_id] = lease.batch_epoch(self.claim, batch_id)
            while len(self._epochs) > 16:
                del self._epochs[min(self._epochs)]
        self.process_batch(df, batch_id)
        if lease is not None:
            t0 = time.perf_counter()
            lease.check(self.name)
            self.timings.add(batch_id, lease=(time.perf_counter() - t0) * 1000)

    def start(self) -> StreamingQuery:
        """Start the streaming query (non-blocking); an armed one (`arm`) is let go instead."""
        self._started_s = time.monotonic()
        self.prepare()
        if self.lease is None:
            self.token(0)  # take the checkpoint's epoch now, not in the first batch
        else:
            self.lease.begin(self.claim)
        self._stop.clear()
        armed, self._armed = self._armed, None
        if armed is not None:
            key, query = armed
            if query.isActive:
                signal(self.redis.client, key, GO)  # Spark reads the checkpoint from here on
                self.query, self._let_go = query, True
                return query
            log.warning("the armed query had ended; starting it now", extra={"stage": self.name})
        frame = self._frame if self._frame is not None else self.frame()
        self.query, self._let_go = self._launch(frame), False
        return self.query

    def arm(self) -> bool:
        """Start the query ahead of a takeover (a standby's, `source.arm`): Spark starts the
        source's planner and waits, before it reads the checkpoint, until `start` lets it go.
        Again after an armed query ended (PipelineError if it failed: the caller waits before
        it tries again); idempotent otherwise (returns whether it started one). Needs
        `lease_owner`."""
        if self._armed is not None:
            query = self._armed[1]
            if query.isActive:
                return False
            err = query.exception()
            self.disarm()  # its planner may still wait: let it go away
            if err is not None:
                raise PipelineError(f"the armed query failed: {str(err).splitlines()[0]}")
        assert self.lease_owner is not None, "only a process under a lease arms its queries"
        self._arms += 1
        key = arm_key(self.lease_owner, self.name, self._arms)
        self.prepare()
        self._arming = key
        try:
            frame = self.frame()
        finally:
            self._arming = None
        self._armed = (key, self._launch(frame))
        return True

    def disarm(self) -> None:
        """Drop an armed query: Spark ends it, then its planner is told to exit."""
        armed, self._armed = self._armed, None
        if armed is None:
            return
        key, query = armed
        with contextlib.suppress(Exception):  # ending anyway; the planner exits with its JVM
            query.stop()
        with contextlib.suppress(Exception):
            signal(self.redis.client, key, STOP)

    def _launch(self, frame: DataFrame) -> StreamingQuery:
        return (
            frame.writeStream.queryName(query_name(self.name))
            .foreachBatch(self._on_batch)
            .option("checkpointLocation", str(self.ckpt))
            .trigger(processingTime=f"{self.cfg.spark.trigger} milliseconds")
            .start()
        )

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop after the batch in flight, waiting at most `grace_s`; drop an armed query."""
        self._stop.set()
        self.disarm()
        stop_query(self.query, grace_s)
        self.query = None

    def record(self, rec: dict[str, Any], counters: list[Any]) -> None:
        """Record a finished batch, once per writer token: its counters (plus one `dead_<r>`
        per dead-letter reason) and its freshness observation."""
        counters = list(counters)
        for reason, n in rec.get("dead_by_reason", {}).items():
            counters += [f"dead_{reason}", n]
        wait_ms = freshness.observation(rec)
        if wait_ms is not None:
            counters += ["|", *freshness.increments(wait_ms)]
        self._record(keys=list(self.role.stats), args=[rec["token"], orjson.dumps(rec), *counters])


def record_folding(client: Any, metrics: list[str], now_ms: int) -> None:
    """When the store first folded each metric (the first start wins). A backfill warns when
    its seam is older than that: events in between are in neither side (docs/offline.md)."""
    pipe = client.pipeline(transaction=False)
    for name in dict.fromkeys(metrics):
        pipe.hsetnx(FOLDING_KEY, name, now_ms)
    pipe.execute()
