"""`redis:` as a Redis Cluster (a cluster URL or a list of seeds), and the tagged shard keys."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.config import config_from_dict
from sluice.errors import ConfigError
from sluice.redis.cluster import ClusterAddress, is_cluster_url, parse_cluster_url
from sluice.redis.connection import redact
from sluice.redis.keys import key_slot, shard_keys, shard_tags

METRICS = [{"name": "n", "key": ["key"], "agg": "count"}]


def _cfg(redis: Any, **source: Any) -> Any:
    return config_from_dict({"redis": redis, "source": {"shards": 3, **source}, "metrics": METRICS})


def test_a_cluster_url_is_kept_and_tags_the_shard_keys() -> None:
    cfg = _cfg("redis+cluster://127.0.0.1:7000")
    assert cfg.redis == "redis+cluster://127.0.0.1:7000" and cfg.redis_cluster
    assert cfg.source.hash_tags is True
    assert cfg.source.shard_keys() == ["events:0:{3}", "events:1:{1}", "events:2:{0}"]


def test_a_list_of_seeds_becomes_one_cluster_url() -> None:
    cfg = _cfg(["redis://:pw@10.0.0.1:7000", "redis://:pw@10.0.0.2:7001/0"])
    assert cfg.redis == "redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001"
    addr = parse_cluster_url(cfg.redis)
    assert addr == ClusterAddress((("10.0.0.1", 7000), ("10.0.0.2", 7001)), None, "pw", False)
    assert redact(cfg.redis) == "redis+cluster://:***@10.0.0.1:7000,10.0.0.2:7001"


def test_a_single_redis_keeps_the_plain_shard_keys() -> None:
    cfg = _cfg("redis://127.0.0.1:6379/0")
    assert not cfg.redis_cluster and cfg.source.hash_tags is False
    assert cfg.source.shard_keys() == ["events:0", "events:1", "events:2"]
    assert _cfg(None).source.shard_keys() == ["events:0", "events:1", "events:2"]


def test_hash_tags_can_be_set_either_way() -> None:
    plain = _cfg("redis+cluster://127.0.0.1:7000", hash_tags=False)
    assert plain.source.shard_keys() == ["events:0", "events:1", "events:2"]
    tagged = _cfg("redis://127.0.0.1:6379", hash_tags=True)
    assert tagged.source.shard_keys()[0] == "events:0:{3}"


def test_tls_and_user() -> None:
    url = "rediss+cluster://app:s%40cret@redis.example:6380"
    addr = parse_cluster_url(url)
    assert addr.tls and addr.username == "app" and addr.password == "s@cret"
    assert is_cluster_url(url) and not is_cluster_url("redis://x:1")
    assert _cfg(["rediss://app:x@h1:1", "rediss://app:x@h2:2"]).redis == (
        "rediss+cluster://app:x@h1:1,h2:2"
    )


@pytest.mark.parametrize(
    ("redis", "message"),
    [
        ("redis+cluster://127.0.0.1", "must be host:port"),
        ("redis+cluster://127.0.0.1:7000/2", "only database 0"),
        ("redis+cluster://a:1,b", "must be host:port"),
        ("http://127.0.0.1:7000", "redis\\+cluster:// for a Redis Cluster"),
        ([], "must not be empty"),
        (["127.0.0.1:7000"], "must be a redis:// or rediss:// URL"),
        (["redis://127.0.0.1"], "must name host and port"),
        (["redis://127.0.0.1:7000/3"], "only database 0"),
        (["redis://:a@h:1", "redis://:b@h:2"], "same scheme and credentials"),
    ],
)
def test_a_bad_cluster_address_names_the_field(redis: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(redis)
    assert err.value.path == "redis"


@given(st.integers(min_value=2, max_value=300))
def test_each_shard_tag_pins_its_shard_to_its_part_of_the_slots(n: int) -> None:
    keys = shard_keys("events", n, hash_tags=True)
    assert len(set(keys)) == n and len(shard_tags(n)) == n
    for i, key in enumerate(keys):
        assert key.startswith(f"events:{i}:{{")
        assert key_slot(key) * n // 16384 == i
