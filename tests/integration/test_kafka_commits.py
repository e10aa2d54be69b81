"""The Kafka log's group commits (`sluice.source.kafka_commits`), on a real broker (tansu) and a
real Redis: a release never waits on the group coordinator, a failed commit is tried again with
no batch to carry it, the group ends at the readers' floor in Redis (a stale commit that lands
last included), and `close` returns in bounded time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, TopicPartition

from sluice.graph import KafkaSpec
from sluice.source.kafka import KafkaLog, reader_hash
from sluice.source.kafka_commits import CLOSE_WAIT_S, Committer
from sluice.source.options import SourceOptions
from sluice.testing.kafka import KafkaBroker
from tests.conftest import free_port, wait_until

FIELDS = (("ts", "long", True), ("card", "string", False))
COMMITS_LOGGER = "sluice.source.kafka_commits"


def _log(
    redis_url: str,
    r: redis.Redis,
    spec: KafkaSpec,
    reader: str = "",
    readers: tuple[str, ...] = ("",),
    commit_timeout_s: float = 10.0,
) -> KafkaLog:
    opts = SourceOptions(
        url=redis_url, log=spec, format="json", fields=FIELDS, time_field="ts",
        max_events_per_batch=None, max_string_bytes=256, reader=reader, readers={"*": readers},
    )  # fmt: skip
    return KafkaLog(opts, r, commit_timeout_s=commit_timeout_s)


def _group_offsets(spec: KafkaSpec) -> list[int]:
    """The group's committed offsets of partitions 0 and 1, read back by a consumer of its own
    (-1001: none)."""
    c = Consumer({"bootstrap.servers": spec.bootstrap, "group.id": spec.group_id})
    try:
        got = c.committed([TopicPartition(spec.topic, p) for p in (0, 1)], timeout=10)
        return [tp.offset for tp in got]
    finally:
        c.close()


def _redis_offsets(r: redis.Redis, topic: str, reader: str) -> list[int]:
    return [int(r.hget(reader_hash(topic, p), reader) or -1) for p in (0, 1)]


@pytest.fixture
def nowhere(r: redis.Redis, redis_url: str) -> Iterator[KafkaLog]:
    """A log whose broker (and so group coordinator) is a loopback port nothing listens on; its
    commits wait 30 s for the coordinator."""
    spec = KafkaSpec(f"127.0.0.1:{free_port()}", "nowhere", "sluice-nowhere")
    log = _log(redis_url, r, spec, commit_timeout_s=30.0)
    yield log
    log.close()


def test_a_release_returns_at_once_while_the_coordinator_cannot_be_reached(
    nowhere: KafkaLog, r: redis.Redis
) -> None:
    for end in ({"0": 5, "1": 7}, {"0": 9, "1": 8}):  # the second while the first commit waits
        t0 = time.monotonic()
        nowhere.release(end)
        assert time.monotonic() - t0 < 1.0
        assert _redis_offsets(r, "nowhere", "") == [end["0"], end["1"]]  # Redis holds them


def test_close_returns_in_bounded_time_while_a_commit_waits_for_the_coordinator(
    nowhere: KafkaLog,
) -> None:
    nowhere.release({"0": 5, "1": 7})
    commits = nowhere._commits
    assert commits is not None
    t0 = time.monotonic()
    nowhere.close()
    assert time.monotonic() - t0 < CLOSE_WAIT_S + 1.5  # not the commit's 30 s
    assert nowhere._commits is None
    assert commits._thread.is_alive()  # the commit in flight was abandoned, not waited for


def test_a_failed_commit_is_tried_again_and_lands_with_no_other_release(
    r: redis.Redis, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No broker at first: the commit fails, and fails again after a backoff, with one warning.
    The broker comes up on that port; the commit lands with no other release, one info says so."""
    caplog.set_level(logging.DEBUG, COMMITS_LOGGER)
    port = free_port()
    spec = KafkaSpec(f"127.0.0.1:{port}", "later", "sluice-later",
                     options=(("reconnect.backoff.max.ms", "200"),))  # fmt: skip
    log = _log(redis_url, r, spec, commit_timeout_s=1.0)
    try:
        log.release({"0": 3, "1": 4})
        commits = log._commits
        assert commits is not None
        wait_until(lambda: commits.failures >= 2, 30, "two failed commits")
        with KafkaBroker(tmp_path / "broker.log", port=port) as broker:
            broker.create_topic("later", partitions=2)
            wait_until(lambda: _group_offsets(spec) == [3, 4], 60, "the retried commit", 0.2)
            wait_until(lambda: commits.failures == 0, 10, "the run of failures to end")
            log.close()
    finally:
        log.close()
    records = [x for x in caplog.records if x.name == COMMITS_LOGGER]
    warnings = [x.getMessage() for x in records if x.levelno == logging.WARNING]
    infos = [x.getMessage() for x in records if x.levelno == logging.INFO]
    assert warnings == ["kafka offsets not committed; trying again in the background"]
    assert infos == ["kafka offsets committed again"]


def test_the_group_ends_at_the_readers_floor_in_redis(
    r: redis.Redis, redis_url: str, kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    spec = KafkaSpec(kafka_broker.bootstrap, kafka_topic, f"sluice-{kafka_topic}")
    a = _log(redis_url, r, spec, "a", ("a", "b"))
    b = _log(redis_url, r, spec, "b", ("a", "b"))
    try:
        for x, y in [(2, 3), (1, 5), (6, 6), (4, 8), (7, 9)]:
            a.release({"0": x, "1": y})
            b.release({"0": y - 1, "1": x + 1})
        floor = [min(p) for p in zip(_redis_offsets(r, kafka_topic, "a"),
                                     _redis_offsets(r, kafka_topic, "b"), strict=True)]  # fmt: skip
        assert floor == [7, 8]  # a at (7, 9), b at (8, 8): offsets never move back
        wait_until(lambda: _group_offsets(spec) == floor, 30, "the group at the floor", 0.2)
    finally:
        a.close()
        b.close()


def test_a_partition_read_again_from_its_start_moves_its_offsets_back(
    r: redis.Redis, redis_url: str, kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    """A topic created again is read from its start (the batch's `from`): the reader's offset
    in Redis and the group's go back with it, so the lag counts the new topic's records again
    instead of reading 0 until the new topic passes the old offsets."""
    spec = KafkaSpec(kafka_broker.bootstrap, kafka_topic, f"sluice-{kafka_topic}")
    log = _log(redis_url, r, spec)
    try:
        log.release({"0": 40, "1": 50})
        wait_until(lambda: _group_offsets(spec) == [40, 50], 30, "the group at 40, 50", 0.2)
        log.release({"0": 3, "1": 60}, reset=["0"])
        assert _redis_offsets(r, kafka_topic, "") == [3, 60]
        wait_until(lambda: _group_offsets(spec) == [3, 60], 30, "the group at 3, 60", 0.2)
        log.release({"0": 2, "1": 55})  # no reset: they never move back
        assert _redis_offsets(r, kafka_topic, "") == [3, 60]
    finally:
        log.close()


def test_a_floor_read_across_a_reset_does_not_put_the_old_offset_back(
    kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    """The thread reads the floor (40, 50) after its commit; partition 0 is reset to 3 before
    that read returns. The read's 40 is not kept for partition 0: the group ends at (3, 60)."""
    spec = KafkaSpec(kafka_broker.bootstrap, kafka_topic, f"sluice-{kafka_topic}")
    floor, hold, held, go = {0: 40, 1: 50}, [True], threading.Event(), threading.Event()

    def floors() -> dict[int, int]:
        got = dict(floor)
        if hold[0]:
            hold[0] = False
            held.set()
            assert go.wait(30)
        return got

    commits = Committer(spec, floors)
    try:
        commits.offer({0: 40, 1: 50})
        assert held.wait(30)  # committed, and its floor read holds (40, 50)
        floor.update({0: 3, 1: 60})
        commits.offer({0: 3, 1: 60}, reset=[0])
        go.set()
        wait_until(lambda: _group_offsets(spec) == [3, 60], 30, "the group at 3, 60", 0.2)
        assert commits._wanted == {0: 3, 1: 60}
    finally:
        go.set()
        commits.close()


def test_a_commit_in_flight_across_a_reset_is_followed_by_the_reset_offset(
    kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    """The thread took (40, 50) to commit; partition 0 is reset to 3 before that commit goes.
    The commit of 40 is not taken as partition 0's committed offset, so 3 is committed after."""
    spec = KafkaSpec(kafka_broker.bootstrap, kafka_topic, f"sluice-{kafka_topic}")
    floor = {0: 40, 1: 50}
    commits = Committer(spec, lambda: dict(floor))
    step, raced = commits._step, list[dict[int, int]]()

    def reset_first(client: Any, due: dict[int, int], since: dict[int, int]) -> None:
        if due.get(0) == 40 and not raced:
            raced.append(due)
            floor.update({0: 3, 1: 60})
            commits.offer({0: 3, 1: 60}, reset=[0])
        step(client, due, since)

    commits._step = reset_first  # type: ignore[method-assign]
    try:
        commits.offer({0: 40, 1: 50})
        wait_until(lambda: _group_offsets(spec) == [3, 60], 30, "the group at 3, 60", 0.2)
        assert raced == [{0: 40, 1: 50}]
    finally:
        commits.close()


def test_a_stale_commit_landing_last_is_made_good(
    r: redis.Redis, redis_url: str, kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    """Two readers: `a` takes the floor while `b` is behind, and its commit reaches the broker
    only after `b` moved the floor to the end and committed it. The thread takes the floor again
    after that commit, so the group still ends at the end, not at `a`'s stale floor."""
    spec = KafkaSpec(kafka_broker.bootstrap, kafka_topic, f"sluice-{kafka_topic}")
    a = _log(redis_url, r, spec, "a", ("a", "b"))
    b = _log(redis_url, r, spec, "b", ("a", "b"))
    first, end = {"0": 2, "1": 3}, {"0": 6, "1": 5}
    try:
        a.release(first)  # b has released nothing: no floor yet
        commits = a._commits
        assert commits is not None
        step, raced, landed = commits._step, list[dict[int, int]](), threading.Event()

        def lands_late(client: Any, due: dict[int, int], since: dict[int, int]) -> None:
            if due and not raced:  # b releases the rest, and commits it, before a's commit
                raced.append(due)
                b.release(end)
                wait_until(lambda: _group_offsets(spec) == [6, 5], 30, "b's commit", 0.2)
                step(client, due, since)
                landed.set()
                return
            step(client, due, since)

        commits._step = lands_late  # type: ignore[method-assign]
        b.release(first)
        wait_until(lambda: _group_offsets(spec) == [2, 3], 30, "the first floor", 0.2)
        a.release(end)  # its floor is b's `first`
        assert landed.wait(30)
        assert raced == [{0: 2, 1: 3}]
        wait_until(lambda: _group_offsets(spec) == [6, 5], 30, "the group at the end", 0.2)
    finally:
        a.close()
        b.close()
