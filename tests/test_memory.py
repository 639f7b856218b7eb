"""Buffers are freed when their futures are dropped and when a client leaves;
worker-reported shard counts and bytes come back to where they started."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import zpath as zp
from zpath.net import messages as m

pytestmark = pytest.mark.timeout(180)


def stores(conn) -> dict[int, tuple[int, int]]:
    st = conn.client.request(m.StatusRequest(False))
    return {s.rank: (s.shards, s.nbytes) for s in st.stores}


def wait_for(conn, pred, timeout: float = 20.0) -> dict[int, tuple[int, int]]:
    """Poll worker-reported store sizes (they refresh every second) until pred holds."""
    deadline = time.monotonic() + timeout
    while True:
        s = stores(conn)
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"store sizes never satisfied the condition: {s}")
        time.sleep(0.2)


def empty(s):
    return all(v == (0, 0) for v in s.values())


def test_dropped_futures_and_intermediates_are_freed(client):
    conn = client
    wait_for(conn, empty)
    d0 = zp.make_virtual_device_set().add_slice(devices=2, host=0).devices
    d1 = zp.make_virtual_device_set().add_slice(devices=2, host=1).devices
    inc = zp.pmap(lambda x: x + 1., devices=d0)
    dbl = zp.pmap(lambda x: x * 2., devices=d1)
    x = np.zeros((2, 1000))
    for _ in range(20):
        x = dbl(inc(x))            # every step crosses hosts
    np.testing.assert_array_equal(np.asarray(x)[:, 0], np.full(2, 2.0 ** 21 - 2))
    # only the last value is held: its 2 float32 shards on host 1 (4000 bytes each);
    # intermediates, their copies on the other host and the put input are gone
    held = wait_for(conn, lambda s: s[1] == (2, 8000) and s[0] == (0, 0))
    assert held[1] == (2, 8000)
    del x
    gc.collect()
    wait_for(conn, empty)


def test_workers_report_bytes_per_device(client):
    conn = client
    wait_for(conn, empty)
    devs = zp.make_virtual_device_set().add_slice(devices=2, host=1).devices
    f = zp.pmap(lambda x: x * 3., devices=devs)
    y = f(np.ones((2, 500)))                   # one 2000-byte float32 shard on each device
    np.testing.assert_array_equal(np.asarray(y), np.full((2, 500), 3.))

    def held() -> dict[int, tuple[int, int]]:
        st = conn.client.request(m.StatusRequest(False))
        return {d.id: (d.held, d.nbytes) for d in st.devices}

    ids = [d.id for d in devs]
    deadline = time.monotonic() + 20
    while any(held()[d] != (2000, 2000) for d in ids):
        assert time.monotonic() < deadline, held()
        time.sleep(0.2)
    assert all(v == (0, 0) for d, v in held().items() if d not in ids), held()
    del y
    gc.collect()
    deadline = time.monotonic() + 20
    while any(v != (0, 0) for v in held().values()):
        assert time.monotonic() < deadline, held()
        time.sleep(0.2)


def test_a_client_that_leaves_has_its_buffers_freed(cluster, client):
    wait_for(client, empty)
    code = ("import numpy as np, zpath as zp, sys\n"
            f"zp.connect({cluster.address!r})\n"
            "d = zp.make_virtual_device_set().add_slice(devices=2).devices\n"
            "keep = [zp.pmap(lambda x: x * 3, devices=d)(np.ones((2, 500))) for _ in range(10)]\n"
            "[k.result(timeout=60) for k in keep]\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"
            "zp.shutdown()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, ZPATH_KEY=cluster.key.hex()))
    try:
        assert p.stdout.readline().strip() == "held", p.stderr.read()
        held = wait_for(client, lambda s: sum(v[0] for v in s.values()) == 20)
        assert sum(v[1] for v in held.values()) == 10 * 2 * 500 * 4      # float32
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(60) == 0
        wait_for(client, empty)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()
