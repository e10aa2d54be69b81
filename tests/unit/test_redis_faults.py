"""Which Redis errors may clear by themselves (`is_transient`): the server answers those 503 and
the rest 500."""

from __future__ import annotations

import pytest
from redis import exceptions

from sluice.redis.loading import is_transient


@pytest.mark.parametrize(
    "error",
    [
        exceptions.ConnectionError("Connection refused"),
        exceptions.TimeoutError("Timeout reading from socket"),
        exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        exceptions.ResponseError("LOADING Redis is loading the dataset in memory"),
        exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        exceptions.ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"),
        exceptions.ReadOnlyError("READONLY You can't write against a read only replica."),
        exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
        exceptions.ResponseError("BUSY Redis is busy running a script."),
        exceptions.ResponseError("MASTERDOWN Link with MASTER is down"),
        exceptions.SlotNotCoveredError("slot 7 is not covered"),
        # As redis-py raises them: its own class, the code dropped from the message.
        exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        exceptions.ReadOnlyError("You can't write against a read only replica."),
        exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        exceptions.ClusterDownError("The cluster is down"),
        exceptions.MasterDownError("Link with MASTER is down"),
        exceptions.MovedError("3999 127.0.0.1:6381"),
        exceptions.ClusterError("TTL exhausted."),
        # A script's command refused so: Redis wraps the reply in the script's error
        exceptions.ResponseError(
            "Error running script (call to f_66924cae): @user_script:19: @user_script: 19:"
            " -OOM command not allowed when used memory > 'maxmemory'."
        ),
    ],
)
def test_not_now(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        exceptions.ResponseError(
            "WRONGTYPE Operation against a key holding the wrong kind of value"
        ),
        exceptions.ResponseError("ERR wrong number of arguments for 'hmget' command"),
        exceptions.DataError("Invalid input of type: 'NoneType'."),
        exceptions.NoPermissionError("NOPERM this user has no permissions"),
        exceptions.AuthenticationError("invalid username-password pair"),
        exceptions.ResponseError("BUSYGROUP Consumer Group name already exists"),
        exceptions.ResponseError("BUSYKEY Target key name already exists."),
        exceptions.ClusterCrossSlotError("Keys in request don't hash to the same slot"),
        exceptions.RedisClusterException("Keys in request don't hash to the same slot"),
        exceptions.ResponseError(
            "Error running script (call to f_66924cae): @user_script:19: @user_script: 19:"
            " -WRONGTYPE Operation against a key holding the wrong kind of value"
        ),
    ],
)
def test_never(error: BaseException) -> None:
    assert not is_transient(error)


def test_a_script_s_refused_command_is_raised_as_redis_py_raises_it_plainly() -> None:
    from sluice.redis.loading import unwrapped_script_error

    oom = exceptions.ResponseError(
        "Error running script (call to f_66924cae): @user_script:19: @user_script: 19:"
        " -OOM command not allowed when used memory > 'maxmemory'."
    )
    plain = unwrapped_script_error(oom, "XADD, in produce.lua")
    assert isinstance(plain, exceptions.OutOfMemoryError)
    assert str(plain).endswith("used memory > 'maxmemory'. (XADD, in produce.lua)")
    wrong = exceptions.ResponseError(
        "Error running script (call to f_66924cae): @user_script:19: @user_script: 19:"
        " -WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    assert unwrapped_script_error(wrong) is wrong  # no class of its own: as it is
