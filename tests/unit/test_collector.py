"""The cyclic collector kept off the hot paths (`sluice.collector`): pauses that nest and
overlap, and a process's objects frozen once."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from sluice import collector
from sluice.collector import paused, settle
from sluice.source.xrange import _parse


def test_the_collector_is_held_off_while_a_reply_is_parsed_and_restored_after() -> None:
    """`paused` (the walk's and the hiredis fallback's parse): off inside, nested and from two
    threads at once; on again after the last pause if it was on, left off if it was off."""
    assert gc.isenabled()
    started, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            started.set()
            release.wait(5)

    t = threading.Thread(target=other)
    with paused():
        assert not gc.isenabled()
        t.start()
        assert started.wait(5)
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still runs
    release.set()
    t.join(5)
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off: a pause does not turn it on
    finally:
        gc.enable()
    raw = b"*1\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$4\r\ncard\r\n$4\r\na\r\nb\r\n"  # a CRLF: hiredis
    assert _parse(raw) == [[b"1-0", [b"card", b"a\r\nb"]]]
    assert gc.isenabled()


def test_a_process_settles_once_and_a_forked_one_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """`settle` freezes what the process holds the first time only; a child forked after it
    (as Spark's daemon forks its workers) settles again in its own process."""
    gc.unfreeze()
    collector._settled["pid"] = 0
    try:
        settle()
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        kept = [[i] for i in range(1000)]  # made after: not frozen by a second call
        settle()
        # Frozen objects still die (the count may fall); the kept lists were not frozen.
        assert gc.get_freeze_count() < frozen + 500
        assert id(kept[0]) in {id(o) for o in gc.get_objects()}
        # The child only counts its freeze: a collection there could run finalizers that talk
        # over sockets it shares with this process (a Spark session's, in the full suite).
        calls: list[int] = []
        monkeypatch.setattr(collector, "freeze", lambda: calls.append(os.getpid()))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            settle()
            settle()
            os.write(w, b"1" if calls == [os.getpid()] else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        assert calls == [] and kept
    finally:
        gc.unfreeze()
        collector._settled["pid"] = 0
