"""`MuxClient` against a real redis-server: many callers on one connection get their own
replies, errors stay with the caller that caused them, and a lost, killed or stuck connection
fails its waiting callers with redis-py's exceptions and is made again on the next call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis import exceptions

from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.mux import MuxClient
from sluice.server.clients import AsyncClients
from tests.conftest import free_port


@pytest.fixture
def mux_kwargs(redis_server: EmbeddedRedis, r: redis.Redis) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": redis_server.port, "socket_connect_timeout": 5}


def test_concurrent_callers_get_their_own_replies_over_one_connection(
    mux_kwargs: dict[str, Any], r: redis.Redis
) -> None:
    async def scenario() -> None:
        mux = MuxClient(**mux_kwargs)

        async def caller(i: int) -> list[Any]:
            await asyncio.sleep((i % 7) / 1000)
            return await mux.execute(
                [("SET", f"k{i}", i), ("INCRBY", f"n{i % 5}", i), ("GET", f"k{i}")]
            )

        results = await asyncio.gather(*(caller(i) for i in range(300)))
        for i, (ok, incr, got) in enumerate(results):
            assert (ok, got) == (b"OK", str(i).encode())
            assert isinstance(incr, int)
        assert [int(r.get(f"n{j}") or 0) for j in range(5)] == [
            sum(i for i in range(300) if i % 5 == j) for j in range(5)
        ]
        assert await mux.execute([]) == []
        packed = b"*2\r\n$3\r\nGET\r\n$2\r\nk7\r\n"  # already RESP: sent as it is
        assert await mux.execute([packed, ("GET", "k8")]) == [b"7", b"8"]
        clients = r.client_list()
        assert len([c for c in clients if c["cmd"] in ("get", "incrby", "set")]) == 1
        await mux.aclose()

    asyncio.run(scenario())


def test_errors_reach_only_their_caller_and_noscript_is_typed(
    mux_kwargs: dict[str, Any], r: redis.Redis
) -> None:
    r.set("s", "text")

    async def scenario() -> None:
        mux = MuxClient(**mux_kwargs)
        bad = asyncio.ensure_future(mux.execute([("INCR", "s")]))
        good = asyncio.ensure_future(mux.execute([("GET", "s")]))
        with pytest.raises(exceptions.ResponseError, match="not an integer"):
            await bad
        assert await good == [b"text"]
        script = "return ARGV[1] .. '!'"
        with pytest.raises(exceptions.NoScriptError):
            await mux.execute([("EVALSHA", "0" * 40, 0)])
        loaded = await mux.script_load(script)
        assert await mux.execute([("EVALSHA", loaded, 0, "hi")]) == [b"hi!"]
        await mux.aclose()

    asyncio.run(scenario())


def test_a_killed_connection_fails_its_waiters_and_the_next_call_reconnects(
    mux_kwargs: dict[str, Any], r: redis.Redis
) -> None:
    async def scenario() -> None:
        mux = MuxClient(**mux_kwargs)
        waiting = asyncio.ensure_future(mux.execute([("BLPOP", "never", 5)]))
        await asyncio.sleep(0.2)
        assert r.client_kill_filter(_type="normal", skipme=True) >= 1
        t0 = time.monotonic()
        with pytest.raises(exceptions.ConnectionError, match="lost"):
            await waiting
        assert time.monotonic() - t0 < 2
        assert await mux.execute([("PING",)]) == [b"PONG"]
        await mux.aclose()

    asyncio.run(scenario())


def test_no_reply_within_the_timeout_drops_the_connection(
    mux_kwargs: dict[str, Any], r: redis.Redis
) -> None:
    async def scenario() -> None:
        mux = MuxClient(**{**mux_kwargs, "socket_timeout": 0.3})
        stuck = asyncio.ensure_future(mux.execute([("BLPOP", "never", 3)]))
        behind = asyncio.ensure_future(mux.execute([("PING",)]))
        t0 = time.monotonic()
        with pytest.raises(exceptions.TimeoutError, match=r"0\.3 s"):
            await stuck
        with pytest.raises(exceptions.TimeoutError):
            await behind  # queued behind it: its reply could no longer be matched
        assert 0.25 < time.monotonic() - t0 < 2
        assert await mux.execute([("PING",)]) == [b"PONG"]  # a new connection
        await mux.aclose()

    asyncio.run(scenario())


def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others(
    mux_kwargs: dict[str, Any], r: redis.Redis
) -> None:
    r.set("x", "42")

    async def scenario() -> None:
        mux = MuxClient(**mux_kwargs)
        first = asyncio.ensure_future(mux.execute([("BLPOP", "never", 1)]))
        second = asyncio.ensure_future(mux.execute([("GET", "x")]))
        await asyncio.sleep(0.1)
        first.cancel()
        assert await second == [b"42"]
        assert await mux.execute([("GET", "x"), ("PING",)]) == [b"42", b"PONG"]
        await mux.aclose()

    asyncio.run(scenario())


@pytest.fixture
def acl_user(r: redis.Redis) -> Iterator[None]:
    r.acl_setuser("mux-user", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
    yield
    r.acl_deluser("mux-user")


def test_auth_and_select(mux_kwargs: dict[str, Any], r: redis.Redis, acl_user: None) -> None:
    async def scenario() -> None:
        mux = MuxClient(**mux_kwargs, username="mux-user", password="pw", db=3)
        assert await mux.execute([("SET", "in3", "yes")]) == [b"OK"]
        assert redis.Redis(port=mux_kwargs["port"], db=3).get("in3") == b"yes"
        assert r.get("in3") is None
        await mux.aclose()
        wrong = MuxClient(**mux_kwargs, username="mux-user", password="nope")
        with pytest.raises(exceptions.AuthenticationError):
            await wrong.execute([("PING",)])

    asyncio.run(scenario())


def test_nothing_listening_is_a_connection_error() -> None:
    async def scenario() -> None:
        mux = MuxClient(port=free_port(), socket_connect_timeout=2)
        with pytest.raises(exceptions.ConnectionError, match="Error connecting"):
            await mux.execute([("PING",)])

    asyncio.run(scenario())


def test_async_clients_pick_the_mux_for_a_single_redis(redis_url: str) -> None:
    from sluice.redis.connection import client_for

    async def scenario() -> Any:
        return AsyncClients(client_for(redis_url)).get()

    assert isinstance(asyncio.run(scenario()), MuxClient)
