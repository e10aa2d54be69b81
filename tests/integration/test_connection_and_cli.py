"""Redis connections (embedded server, URLs, passwords, clear errors) and the CLI commands that
need no Spark. Real redis-server processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from click.testing import CliRunner

from sluice.cli import main
from sluice.config import load_config
from sluice.errors import RedisUnavailable
from sluice.redis.connection import check_reachable, client_for, open_redis, redact
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.source.loadgen import run_load
from tests.conftest import free_port, wait_until


def test_embedded_server_keeps_its_aof_under_state_dir(tmp_path: Path) -> None:
    with open_redis(None, tmp_path) as handle:
        handle.client.set("k", "v")
        info = handle.client.info("persistence")
        assert info["aof_enabled"] == 1
        assert handle.url.startswith("redis://127.0.0.1:")
        # A second process on the same state_dir joins the running server instead of another.
        with open_redis(None, tmp_path) as second:
            assert second.url == handle.url
            assert second.client.get("k") == b"v"
        assert handle.client.ping()  # the joiner does not stop a server it does not own
    assert (tmp_path / "redis" / "appendonly.aof").exists()
    assert not (tmp_path / "redis" / "redis.port").exists()
    with open_redis(None, tmp_path) as again:  # restarted from the AOF
        assert again.client.get("k") == b"v"


def test_embedded_server_answers_on_a_unix_socket_beside_its_data() -> None:
    """`local_url` is the server's socket (mode 700) for processes on this machine; a joiner
    finds it too; a state_dir too deep for a socket's path gets TCP for both."""
    short = Path(tempfile.mkdtemp(prefix="sluice-"))  # pytest's own paths may be too deep
    try:
        with open_redis(None, short) as handle:
            assert handle.local_url == f"unix://{short.resolve()}/redis/redis.sock?db=0"
            sock = short / "redis" / "redis.sock"
            assert stat.S_IMODE(sock.stat().st_mode) == 0o700
            handle.client.set("k", "v")
            with client_for(handle.local_url) as local:
                assert local.get("k") == b"v"
                assert "U" in local.client_info()["flags"]  # a Unix socket's client
            with open_redis(None, short) as second:
                assert second.local_url == handle.local_url
    finally:
        shutil.rmtree(short, ignore_errors=True)
    deep = short / ("d" * 60) / ("e" * 60)
    with open_redis(None, deep) as handle:
        assert handle.local_url == handle.url
        assert not (deep / "redis" / "redis.sock").exists()
        assert handle.client.ping()
    shutil.rmtree(short, ignore_errors=True)


def test_unreachable_url_fails_clearly() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailable, match=r"cannot reach redis at redis://127\.0\.0\.1") as e:
        check_reachable(url, timeout_s=0.5)
    assert ".." not in str(e.value)  # redis-py's message ends in a period of its own


def test_password_urls(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("requirepass", "pw")
        good = f"redis://:pw@127.0.0.1:{server.port}/0"
        bad = f"redis://:wrong@127.0.0.1:{server.port}/0"
        check_reachable(good)
        with pytest.raises(RedisUnavailable, match=r"redis://:\*\*\*@127.0.0.1.*credentials"):
            check_reachable(bad)
        redis.Redis.from_url(good).config_set("requirepass", "")
    assert redact(good) == f"redis://:***@127.0.0.1:{server.port}/0"
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def _config_file(tmp_path: Path, redis_url: str) -> Path:
    path = tmp_path / "sluice.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "redis": redis_url,
                "state_dir": str(tmp_path / "state"),
                "source": {
                    "format": "jsonl",
                    "shards": 2,
                    "schema": {"ts": "long", "card": "string", "amount": "double"},
                },
                "metrics": [
                    {
                        "name": "txn_count",
                        "key": ["card"],
                        "agg": "count",
                        "slice": "10s",
                        "retention": "1h",
                    },
                    {
                        "name": "amount_sum",
                        "key": ["card"],
                        "agg": "sum",
                        "value": "amount",
                        "slice": "10s",
                        "retention": "1h",
                    },
                ],
            }
        )
    )
    return path


def test_cli_query_and_status(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    now = time.time_ns() // 1_000_000
    s = now // 10_000 * 10_000
    r.hset(slice_hash_key("txn_count", encode_key(["c1"])), mapping={str(s): "1:4"})
    cfg = _config_file(tmp_path, redis_url)
    runner = CliRunner()
    out = runner.invoke(
        main, ["query", "-c", str(cfg), "txn_count", "--key", "c1", "--window", "1m"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["value"] == 4
    # A sum of doubles past the largest double is not a number JSON can carry: null, as over
    # HTTP, never `Infinity` (which no JSON parser takes).
    r.hset(slice_hash_key("amount_sum", encode_key(["c1"])), mapping={str(s): "1:inf"})
    out = runner.invoke(
        main, ["query", "-c", str(cfg), "amount_sum", "--key", "c1", "--window", "1m"]
    )
    assert out.exit_code == 0 and "Infinity" not in out.output, out.output
    assert json.loads(out.output)["value"] is None
    out = runner.invoke(main, ["query", "-c", str(cfg), "nope", "--key", "c1", "--window", "1m"])
    assert out.exit_code != 0 and "unknown metric 'nope'" in out.output
    out = runner.invoke(main, ["status", "-c", str(cfg)])
    assert out.exit_code == 0 and "backlog (entries)" in out.output
    out = runner.invoke(main, ["status", "-c", str(cfg), "--json"])
    assert json.loads(out.output)["backlog"]["entries"] == 0


def test_cli_status_shows_each_stage_throttle(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A throttled ingest task, as a producer publishes it, in the table and in --json."""
    from sluice.clock import SYSTEM_CLOCK
    from sluice.config import load_config
    from sluice.flow.board import Board
    from sluice.source.admission import ingest_valve

    path = _config_file(tmp_path, redis_url)
    valve = ingest_valve(load_config(path), r)
    valve.try_admit(1_000_000)  # publishes its state; measures a rate far above min_rate
    Board(r).send(valve.task.id, "overload", "spark/test", 60_000_000, SYSTEM_CLOCK.now_ms())
    valve.task._next_tick = 0  # look at the signals now
    valve.try_admit(1)
    assert valve.task.controller.backpressured
    runner = CliRunner()
    out = runner.invoke(main, ["status", "-c", str(path)])
    assert out.exit_code == 0, out.output
    assert "backpressure: stepwise, high 50.0 MB, low 500.0 KB" in out.output
    ingest_row = next(line for line in out.output.splitlines() if line.startswith("ingest"))
    ctl = valve.task.controller
    assert ctl.rate is not None and ctl.origin_rate is not None
    assert "throttled" in ingest_row and f"{ctl.origin_rate:,.0f}" in ingest_row
    out = runner.invoke(main, ["status", "-c", str(path), "--json"])
    flow = json.loads(out.output)["flow"]
    assert flow["stages"]["ingest"]["backpressure"] is True
    assert flow["stages"]["ingest"]["rate"] == ctl.rate == ctl.origin_rate * 0.5
    assert flow["timeline"][0]["task"] == valve.task.id


def test_cli_produce_is_seeded_and_bounded(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = _config_file(tmp_path, redis_url)
    runner = CliRunner()
    args = ["produce", "-c", str(cfg), "--rate", "2000", "--duration", "1", "--seed", "3"]
    started = time.monotonic()
    out = runner.invoke(main, args)
    assert out.exit_code == 0, out.output
    assert time.monotonic() - started < 10
    result = json.loads(out.output.strip().splitlines()[-1])
    assert 1000 <= result["events"] <= 2600
    stored = sum(int(f[b"n"]) for s in ("events:0", "events:1") for _, f in r.xrange(s))
    assert stored == result["events"]

    def cards() -> list[str]:
        return [
            json.loads(line)["card"]
            for _, fields in r.xrange("events:0")
            for line in fields[b"d"].split(b"\n")
        ]

    first = cards()
    r.flushall()
    runner.invoke(main, args)
    second = cards()
    n = min(len(first), len(second))
    assert n > 100 and first[:n] == second[:n]  # the same seed: the same keys in the same order


def test_a_load_over_a_full_input_ends_on_time_and_reports_what_it_could_not_send(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Nothing drains the input and it is over its high watermark: the load makes what it may,
    waits `drain_s` for admission, then returns with those events reported as unsent, none of
    them written."""
    cfg = load_config(_config_file(tmp_path, redis_url))
    cfg = cfg.model_copy(update={"backpressure": cfg.backpressure.model_copy(
        update={"high_watermark": 20_000, "low_watermark": 5_000})})  # fmt: skip
    for s in ("events:0", "events:1"):
        r.xadd(s, {"d": b"x" * 30_000, "n": 1})
    entries = {s: r.xlen(s) for s in ("events:0", "events:1")}
    started = time.monotonic()
    out = run_load(cfg, r, 200.0, 0.5, seed=1, drain_s=1.0)
    assert time.monotonic() - started < 10, out
    assert out["events"] == 0 and out["unsent"] > 0, out
    assert {s: r.xlen(s) for s in entries} == entries  # nothing written after the report


def test_produce_stopped_by_ctrl_c_prints_its_summary(redis_url: str, tmp_path: Path) -> None:
    cfg = _config_file(tmp_path, redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "produce", "-c", str(cfg), "--rate", "500",
         "--duration", "60"],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # its first progress line: it is producing
        assert first.startswith("produced"), first
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["events"] > 0 and summary["seconds"] < 30, summary
    assert "Aborted" not in err and "Traceback" not in err, err


def test_cli_config_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("metrics:\n  - {name: x, key: [card], agg: median}\n")
    out = CliRunner().invoke(main, ["status", "-c", str(path)])
    assert out.exit_code != 0
    assert "metrics[0].agg" in out.output and "unknown agg 'median'" in out.output
    out = CliRunner().invoke(main, ["status", "-c", str(tmp_path / "missing.yaml")])
    assert out.exit_code != 0 and "not found" in out.output


def test_cli_unreachable_redis(tmp_path: Path) -> None:
    cfg = _config_file(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    out = CliRunner().invoke(main, ["status", "-c", str(cfg)])
    assert out.exit_code != 0 and "cannot reach redis" in out.output


def _start_at(server: EmbeddedRedis, barrier: Any, errors: list[BaseException]) -> None:
    barrier.wait()
    try:
        server.start()
    except BaseException as e:  # noqa: BLE001 - the test reports it
        errors.append(e)


def test_processes_starting_the_embedded_server_at_once_share_one(tmp_path: Path) -> None:
    """`sluice run` and `sluice serve` started together on one state_dir: they take turns
    (a lock beside the data), so one server starts and the others join it. Without the turns
    each wrote its own port into the one redis.conf, and one waited on a port no server had."""
    for attempt in range(3):
        data_dir = tmp_path / f"redis-{attempt}"
        servers = [EmbeddedRedis(data_dir) for _ in range(4)]
        barrier = threading.Barrier(len(servers))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_start_at, args=(s, barrier, errors)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            assert not errors, errors
            assert len({s.port for s in servers}) == 1
            assert sum(s.owned for s in servers) == 1
            assert redis.Redis.from_url(servers[0].url).ping()
        finally:
            for s in servers:
                s.stop()
        assert not (data_dir / "redis.port").exists()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(servers[0].url, socket_connect_timeout=1).ping()


def test_the_last_process_using_the_embedded_server_stops_it(tmp_path: Path) -> None:
    """`sluice run` started the server and stops while a backfill (another process) still
    writes through it: the server stays until that one stops too, and then it goes."""
    data_dir = tmp_path / "redis"
    owner = EmbeddedRedis(data_dir).start()
    url = owner.url
    redis.Redis.from_url(url).set("written", "before")
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sluice.redis.embedded import EmbeddedRedis;"
         f" s = EmbeddedRedis({str(data_dir)!r}).start(); print(s.url, flush=True);"
         " sys.stdin.readline(); s.stop()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == url  # joined, not started another
        owner.stop()
        assert redis.Redis.from_url(url).ping()  # still used by the child: left running
        assert (data_dir / "redis.port").exists()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
    with pytest.raises(redis.ConnectionError):  # the last one out stopped it
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert not (data_dir / "redis.port").exists()
    # Started again on its data: the last one out flushed the AOF first.
    with EmbeddedRedis(data_dir) as again:
        assert again.owned
        assert redis.Redis.from_url(again.url).get("written") == b"before"


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def test_a_killed_embedded_server_is_started_again_on_its_port(tmp_path: Path) -> None:
    """`kill -9` of the embedded server under a process that keeps it (`sluice run`, `serve`):
    within seconds it answers again on the same URL, which every client of it (Spark's
    executors among them) holds, with its data from the AOF."""
    with open_redis(None, tmp_path, durability="strict") as handle:
        server = handle.embedded
        assert server is not None and server.keep and server.pid is not None
        handle.client.set("written", "before")
        first = server.pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: server.pid != first and _answers(handle.url), 30, "the server back", 0.1)
        assert redis.Redis.from_url(handle.url).get("written") == b"before"
        assert (tmp_path / "redis" / "redis.port").read_text() == str(server.port)
    assert not _answers(handle.url)  # the last user stopped it, the keeper did not restart it


def _servers_on(data_dir: Path) -> list[int]:
    """The redis-server processes whose working directory is `data_dir`."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and b"redis-server" in (proc / "cmdline").read_bytes()
                and (Path(os.readlink(proc / "cwd")).resolve() == data_dir.resolve())
            ):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def test_a_process_starting_after_the_server_died_uses_its_port(tmp_path: Path) -> None:
    """A server killed with no keeper, while a client was connected (its closing connections
    hold the port for a minute): the next process on the state_dir starts it on the port its
    users hold, not on a new one they would never find."""
    data_dir = tmp_path / "redis"
    dead = EmbeddedRedis(data_dir).start()
    assert dead.pid is not None
    connected = redis.Redis.from_url(dead.url)
    assert connected.ping()
    os.kill(dead.pid, signal.SIGKILL)
    dead.proc.wait()  # type: ignore[union-attr]
    again = EmbeddedRedis(data_dir).start()
    try:
        assert again.owned and again.port == dead.port and _answers(again.url)
    finally:
        again.stop()  # `dead`'s user still holds it
        assert _answers(again.url)
        dead.stop()  # the last user: it stops the server another started on its port
        connected.close()
    assert not _answers(again.url)


def test_a_keeper_and_a_starting_process_never_run_two_servers(tmp_path: Path) -> None:
    """The server dies under a process that keeps it, and another process starts on the
    state_dir at once: whichever is first starts it, on its port, and there is one server."""
    data_dir = tmp_path / "redis"
    with EmbeddedRedis(data_dir, keep=True) as kept:
        assert kept.pid is not None and kept.port is not None
        connected = redis.Redis.from_url(kept.url)
        assert connected.ping()
        os.kill(kept.pid, signal.SIGKILL)
        other = EmbeddedRedis(data_dir).start()
        try:
            assert other.port == kept.port
            time.sleep(2.5)  # the keeper's turns come and go
            assert len(_servers_on(data_dir)) == 1 and _answers(kept.url)
        finally:
            other.stop()
            connected.close()
    assert _servers_on(data_dir) == []


def test_a_frozen_embedded_server_is_waited_for_never_started_twice(tmp_path: Path) -> None:
    """A server that accepts connections but does not answer (stopped, busy, loading): a second
    server on its data would corrupt it. A keeper leaves it alone; a process starting on the
    state_dir waits for it and says so if it never answers."""
    data_dir = tmp_path / "redis"
    with EmbeddedRedis(data_dir, keep=True) as server:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisUnavailable, match="accepts connections but does not"):
                EmbeddedRedis(data_dir).start(timeout_s=1.5)
            time.sleep(1.5)  # more than a keeper's period
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert server.proc is not None and server.proc.poll() is None
        with EmbeddedRedis(data_dir) as joined:
            assert not joined.owned and joined.port == server.port


def test_ctrl_c_while_a_command_starts_ends_it_as_sigint_does(tmp_path: Path) -> None:
    """A Ctrl-C before a command installs its own handling (here: `backfill` waiting on a
    Redis that accepted its connection and never answers) prints one line and exits 130, not
    click's `Aborted!` with status 1."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        cfg = _config_file(tmp_path, f"redis://127.0.0.1:{port}/0")
        (tmp_path / "events.jsonl").write_text("")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "backfill", "-c", str(cfg), "--input",
             str(tmp_path / "events.jsonl"), "--until", "1000"],
            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            silent.settimeout(60)
            conn, _ = silent.accept()  # the command runs, and waits on its first reply
            with conn:
                os.killpg(proc.pid, signal.SIGINT)
                _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "backfill: stopped by SIGINT", err
    assert "Aborted" not in err and "Traceback" not in err, err


def _signalled_at_import(module: str, args: list[str],
                         cwd: Path) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """The `sluice` command (its console entry point, `sluice.launch:main`) with `args`, sent a
    real SIGINT by itself at the moment Python starts importing `module`."""
    code = (
        "import os, signal, sys\n"
        "class Signal:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Signal())\n"
        f"sys.argv = ['sluice', *{args!r}]\n"
        "from sluice.launch import main\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_ctrl_c_while_the_command_line_is_imported_is_one_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    """In the second the command line takes to import, a Ctrl-C ends `sluice` as SIGINT does:
    one line, status 130."""
    done = _signalled_at_import("sluice.status.dead_letters", ["--help"], tmp_path)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stderr == "sluice: stopped by SIGINT\n"
    assert "Usage" not in done.stdout


def test_ctrl_c_before_spark_starts_stops_run_without_starting_spark(tmp_path: Path) -> None:
    """`sluice run` asked to stop while it opens its config and Redis stops there: no JVM is
    started only to be stopped."""
    cfg = _config_file(tmp_path, "")
    text = yaml.safe_load(cfg.read_text())
    del text["redis"]  # the embedded one, under state_dir
    cfg.write_text(yaml.safe_dump(text))
    done = _signalled_at_import("sluice.pipeline.spark", ["run", "-c", str(cfg)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "stopping after the batch in flight" in done.stderr
    assert "stopped before the pipeline started" in done.stderr
    assert "pipeline starting" not in done.stderr and "Traceback" not in done.stderr
