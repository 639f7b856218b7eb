"""Socket helpers: the outbox that hands messages to an I/O thread."""
from __future__ import annotations

import os
import select
import threading
import time
import types

import pytest

from zpath.net import transport
from zpath.net.transport import Outbox, backoff

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slow_pipe_reads(monkeypatch):
    """Make the outbox's pipe reads slow, so producers run inside drain() and
    every interleaving of put() and drain() happens many times."""
    def slow_read(fd: int, n: int) -> bytes:
        time.sleep(0.0002)
        return os.read(fd, n)
    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    proxy.read = slow_read
    monkeypatch.setattr(transport, "os", proxy)


def test_outbox_never_strands_an_item(slow_pipe_reads):
    """Four producers race a consumer that sleeps in select() until woken. Every
    item must be drained; an item left behind with no wake byte would make the
    consumer time out (this is how two workers once waited on each other)."""
    box = Outbox()
    n_threads, per_thread = 4, 3000
    got: list[tuple] = []

    def produce(t: int) -> None:
        for i in range(per_thread):
            box.put(t, i)
            if i % 50 == 0:
                time.sleep(0.001)   # let the consumer catch up and sleep in select()

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    while len(got) < n_threads * per_thread:
        ready, _, _ = select.select([box.fd], [], [], 2.0)
        assert ready, f"stranded: {n_threads * per_thread - len(got)} items never woke the consumer"
        got.extend(box.drain())
    for th in threads:
        th.join()
    assert sorted(got) == sorted((t, i) for t in range(n_threads) for i in range(per_thread))
    # order is kept per producer
    for t in range(n_threads):
        assert [i for tt, i in got if tt == t] == list(range(per_thread))
    box.close()


def test_backoff_is_capped_and_jittered():
    values = [backoff(a, base=0.1, cap=1.0) for a in range(20)]
    assert all(0 < v <= 1.0 for v in values)
    assert len(set(values)) > 1
