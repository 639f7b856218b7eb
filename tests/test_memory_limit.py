"""Per-device memory limit: a call that would exceed it waits until memory is
freed (it does not crash); one that can never fit fails at once, clearly."""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import zpath as zp
from zpath.client import api as zp_api
from zpath.cluster.testing import wait_until
from zpath.net import messages as m
from tests.conftest import connected, running_cluster

# the sizes below are of float64 values (8 bytes an element): 64-bit types on
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("x64")]
LIMIT = 100_000          # bytes per device


def status() -> m.Status:
    """The controller's status; the answer also tells that what the client sent
    before (calls, releases: one ordered connection) has been handled."""
    return zp_api.current_client().request(m.StatusRequest(False))


def until(pred, timeout: float = 20.0) -> m.Status:
    """Poll the controller's status until ``pred`` holds, and return it (the
    test fails after ``timeout``)."""
    return wait_until(lambda: st if pred(st := status()) else None, timeout=timeout, interval=0.02,
                      what="the controller's status")


@pytest.fixture(scope="module")
def limited():
    with running_cluster(islands=1, hosts_per_island=1, devices_per_host=1,
                         env={"ZPATH_DEVICE_MEMORY_LIMIT": str(LIMIT)}) as c:
        yield c


def test_calls_wait_for_memory_and_never_fitting_ones_fail(limited):
    with connected(limited):
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        make = zp.jit(lambda: np.float64(1) * np.ones(5000), mesh=zp.Mesh(d, ("i",)))   # 40 kB
        double = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d, ("i",)))
        a = make()
        b = double(a)                  # 80 kB held
        np.testing.assert_array_equal(np.asarray(b)[:2], [2., 2.])
        c = double(b)                  # would need 120 kB: waits
        d2 = double(np.ones(3))        # submitted after it: waits behind it (order kept)
        until(lambda st: st.queued == 2)
        with pytest.raises(zp.DeadlineExceeded):
            c.result(timeout=0.5)
        assert not d2.done()
        st = zp_api.current_client().request(m.StatusRequest(False))
        assert st.queued == 2 and st.running == 0
        assert [u.nbytes for u in st.devices if u.id == d[0].id] == [80_000]
        out = subprocess.run([sys.executable, "-m", "zpath", "status", limited.address], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, ZPATH_KEY=limited.key.hex()))
        assert "queued 2" in out.stdout and re.search(
            rf"device {d[0].id} \(host 0\): \d+ bytes held \(worker\), 80000 bytes placed \(controller\)",
            out.stdout), \
            out.stdout + out.stderr
        del a
        gc.collect()                   # frees 40 kB: c fits now
        np.testing.assert_array_equal(c.result(timeout=30)[:2], [4., 4.])
        np.testing.assert_array_equal(d2.result(timeout=30), [2., 2., 2.])
        big = zp.jit(lambda: np.ones(20000), mesh=zp.Mesh(d, ("i",)))                   # 160 kB
        t = time.monotonic()
        with pytest.raises(zp.ResourceError, match=f"needs 160000 bytes on device .*limit of {LIMIT}"):
            big().result(timeout=30)
        assert time.monotonic() - t < 10
        # the cluster still works
        np.testing.assert_array_equal(np.asarray(double(np.ones(1))), [2.])


def test_inputs_of_a_call_that_can_never_fit_are_freed_even_when_they_come_late(limited):
    """The values a client put for a call the controller fails are freed: when
    they came first, and when they come after the Free (Put and Free take
    different connections), in which case the worker drops them."""
    from tests.test_memory import empty, wait_for
    with connected(limited) as conn:
        client = zp_api.current_client()
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        grow = zp.jit(lambda x: np.ones(20000) * x.sum(), mesh=zp.Mesh(d, ("i",)))   # 160 kB out
        base = wait_for(conn, empty)     # what earlier tests held is freed
        for _ in range(3):
            with pytest.raises(zp.ResourceError, match="more than the per-device limit"):
                grow(np.ones(1000)).result(timeout=30)
        wait_for(conn, lambda s: s == base)
        late = []
        put = client.put
        client.put = lambda host, msg, data: late.append((host, msg, data))      # hold the Puts back
        try:
            with pytest.raises(zp.ResourceError, match="more than the per-device limit"):
                grow(np.ones(1000)).result(timeout=30)
        finally:
            client.put = put
        assert len(late) == 1
        # the controller's Free reached the worker first: a call the controller
        # sends the worker after it has run
        double = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d, ("i",)))
        np.testing.assert_array_equal(double(np.ones(1)).result(timeout=30), [2.])
        put(*late[0])
        # a call after it on the same connection: once it ran, the late Put was handled
        y = double(np.ones(3))
        np.testing.assert_array_equal(y.result(timeout=30), [2., 2., 2.])
        del y
        gc.collect()
        assert wait_for(conn, lambda s: s == base) == base     # the workers' store figures refresh


def test_a_call_waiting_for_memory_on_a_lost_host_fails_and_work_behind_it_goes_on(tmp_path):
    """Under a memory limit, a call waits for room on island 1; island 1's only
    host is killed: the waiting call fails with HostLost, and the call on island
    0 submitted after it (the waiting queue keeps arrival order) runs."""
    limit = 3 * 512 * 1024
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=1, log_dir=str(tmp_path),
                         env={"ZPATH_DEVICE_MEMORY_LIMIT": str(limit), "ZPATH_HOST_TIMEOUT": "3"}) as c:
        with connected(c) as conn:
            d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
            d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
            f0 = zp.pmap(lambda x: x + 1, devices=d0)
            f1 = zp.pmap(lambda x: x + 1, devices=d1)
            x = np.zeros((1, 256, 256))                     # 512 KiB
            keep = [f1(x), f1(x)]                           # 1 MiB held on island 1's device
            for k in keep:
                k.result(timeout=60)
            waiting = f1(x)                                 # 1 MiB more (input and output): waits
            behind = f0(np.ones((1, 2)))
            assert until(lambda st: st.queued == 2).queued == 2
            dict(c.procs)["worker-i1-h0"].kill()
            with pytest.raises(zp.HostLost, match="island 1"):
                waiting.result(timeout=30)
            np.testing.assert_array_equal(behind.result(timeout=30), [[2., 2.]])
            assert conn.client.request(m.StatusRequest(False)).queued == 0


def test_a_future_dropped_while_its_call_waits_is_freed_and_long_programs_do_not_wait_for_themselves(limited):
    """(a) A call waits for memory; its future is dropped before it is planned:
    once planned and run, its output is freed (nothing stays placed). (b) A
    chained program whose nodes each fit but whose intermediates together do
    not: each intermediate is released once its last reader is planned, so the
    program runs instead of waiting for room only its own end would free."""
    from tests.test_memory import empty, wait_for
    with connected(limited) as conn:
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        f = zp.pmap(lambda x: x + 1, devices=d)
        x = np.zeros((1, 4000))                        # 32 kB
        wait_for(conn, empty)
        hold, hold2 = f(x), f(x)                       # 64 kB held
        hold.result(timeout=60)
        hold2.result(timeout=60)
        waiting = f(x)                                 # 64 kB more: waits
        assert until(lambda st: st.queued == 1).queued == 1
        del waiting
        gc.collect()
        status()                                       # the release reached the controller
        del hold, hold2
        gc.collect()

        def settled():
            st = conn.client.request(m.StatusRequest(False))
            return st.queued == 0 and st.running == 0 and st.buffers == 0 and \
                all(u.nbytes == 0 for u in st.devices)
        deadline = time.monotonic() + 20
        while not settled():
            assert time.monotonic() < deadline, conn.client.request(m.StatusRequest(False))
            time.sleep(0.2)
        wait_for(conn, empty)

        @zp.program
        def chain(v):
            for _ in range(8):                         # 8 x 32 kB of intermediates > 100 kB
                v = f(v)
            return v
        np.testing.assert_array_equal(chain(x).result(timeout=60)[0, :3], [8., 8., 8.])


def test_programs_run_fused_under_a_memory_limit_when_they_fit(limited):
    """A program run again runs fused under the limit when its results and
    intermediates fit beside what is placed; one whose intermediates do not fit
    (the chain of the test above) runs as plain calls, every time."""
    from tests.test_program import _fused_records
    with connected(limited) as conn:
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        f = zp.pmap(lambda x: x + 1, devices=d)

        @zp.program
        def small(v):                                  # 2 x 8 kB of intermediates
            return f(f(f(v)))

        @zp.program
        def large(v):                                  # 7 x 32 kB of intermediates
            for _ in range(8):
                v = f(v)
            return v
        for k in range(3):
            np.testing.assert_array_equal(small(np.full((1, 1000), k)).result(timeout=60)[0, :2],
                                          [k + 3, k + 3])
            np.testing.assert_array_equal(large(np.full((1, 4000), k)).result(timeout=60)[0, :2],
                                          [k + 8, k + 8])
        assert len(_fused_records(conn, "small")) == 2       # the first run is plain
        assert not _fused_records(conn, "large")


def test_inputs_released_while_waiting_are_kept_and_a_client_leaving_with_waiting_calls(limited):
    """(a) A call waits for memory; the future of its input is dropped meanwhile:
    the input stays until the call is planned, and the call runs. (b) A client
    leaves with two calls waiting: the controller drops both, frees everything
    the client held, and serves the next client."""
    from tests.test_memory import empty, wait_for
    with connected(limited) as conn:
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        make = zp.jit(lambda: np.float64(1) * np.ones(5000), mesh=zp.Mesh(d, ("i",)))   # 40 kB
        double = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d, ("i",)))
        a = make()
        b = double(a)                            # 80 kB held
        b.result(timeout=30)
        c = double(b)                            # 120 kB: waits
        until(lambda st: st.queued == 1)
        del b                                    # released while c waits to read it
        gc.collect()
        status()                                 # the release reached the controller
        del a                                    # 40 kB freed: c fits
        gc.collect()
        np.testing.assert_array_equal(c.result(timeout=30)[:2], [4., 4.])
    with connected(limited) as conn:
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        make = zp.jit(lambda: np.float64(1) * np.ones(5000), mesh=zp.Mesh(d, ("i",)))
        double = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d, ("i",)))
        a = make()
        b = double(a)
        b.result(timeout=30)
        waiting = [double(b), double(b)]         # both wait
        assert until(lambda st: st.queued == 2).queued == 2
    with connected(limited) as conn:               # the first left (zp.shutdown: Goodbye)
        deadline = time.monotonic() + 10
        while True:
            st = conn.client.request(m.StatusRequest(False))
            if st.queued == 0 and st.buffers == 0 and all(u.nbytes == 0 for u in st.devices):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        wait_for(conn, empty)
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        double = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d, ("i",)))
        np.testing.assert_array_equal(double(np.ones(3)).result(timeout=30), [2., 2., 2.])
    del waiting
