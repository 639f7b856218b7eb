"""Failures: a worker killed with SIGKILL is noticed within seconds, what depends
on it fails with HostLost naming the host, the controller and the other islands
keep serving, a new worker can join; a client killed with SIGKILL has its
buffers freed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import zpath as zp
from zpath.client import api as zp_api
from zpath.client.connection import Client
from zpath.cluster.testing import wait_until
from zpath.config import ClientConfig
from zpath.net import messages as m
from tests.conftest import running_cluster
from tests.test_memory import empty, wait_for

pytestmark = pytest.mark.timeout(240)


def status_of(client: Client) -> m.Status:
    return client.request(m.StatusRequest(False))


@pytest.fixture
def fragile(tmp_path):
    """Two single-host islands; hosts are declared lost after 3 s of silence and
    clients after 3 s."""
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=1, log_dir=str(tmp_path),
                         env={"ZPATH_HOST_TIMEOUT": "3", "ZPATH_CLIENT_TIMEOUT": "3"}) as c:
        yield c


def test_killed_worker_fails_its_futures_and_the_rest_keeps_working(fragile):
    import jax
    import jax.numpy as jnp
    conn = zp.connect(fragile.address, fragile.key)
    try:
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        victim_host = d1[0].host
        victim = next(p for name, p in fragile.procs if name == "worker-i1-h0")
        slow = zp.pmap(lambda x: jax.lax.fori_loop(0, 3000, lambda i, a: jnp.tanh(a @ a), x),
                       devices=d1)
        inc = zp.pmap(lambda x: x + 1, devices=d1)
        fetched = inc(np.ones(1))
        fetched.result(timeout=60)                                         # its value is here
        unfetched = inc(np.ones(1))                                        # lives only there
        x = np.eye(400)[None] * 0.01
        running = slow(x)                                                  # in flight when killed
        then = zp.pmap(lambda v: v * 2, devices=d0)(running)               # waits for a piece from it
        # the controller has both: the slow one sent to its worker, the other
        # sent or held back until that piece comes
        wait_until(lambda: (st := status_of(conn.client)).running >= 1 and st.running + st.queued >= 2,
                   timeout=30, interval=0.05, what="the slow call in flight and the next one waiting")
        assert not running.done()
        from zpath.net import channels
        planted = os.path.join(channels.SHM_DIR, f"{fragile.shm_prefix}-{victim.pid}-999")
        with open(planted, "wb") as f:        # a segment it made, as a sender would
            f.write(b"x" * 4096)
        t = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        lost = f"host {victim_host} .*island 1.* was lost"
        for fut in (running, then, unfetched):
            with pytest.raises(zp.HostLost, match=lost):
                fut.result(timeout=60)
        assert not os.path.exists(planted)    # the controller removed the lost host's segments
        np.testing.assert_array_equal(fetched.result(), [2.])              # already fetched: kept
        with pytest.raises(zp.HostLost, match=lost):                       # but it is gone there
            zp.pmap(lambda v: v * 2, devices=d0)(fetched).result(timeout=60)
        with pytest.raises(zp.HostLost, match=lost):                       # a new call there
            inc(np.ones(1)).result(timeout=60)
        assert time.monotonic() - t < 30, "loss not noticed within a few seconds"
        # the controller and the other island keep serving
        ok = zp.pmap(lambda v: v - 1, devices=d0)
        np.testing.assert_array_equal(ok(np.ones(1)).result(timeout=60), [0.])
        st = conn.client.request(m.StatusRequest(False))
        assert [h.rank for h in st.lost] == [victim_host]
        assert victim_host not in [h.rank for h in st.hosts]
        with pytest.raises(zp.ResourceError):
            zp.make_virtual_device_set().add_slice(devices=1, island=1)
        status = subprocess.run([sys.executable, "-m", "zpath", "status", fragile.address],
                                capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, ZPATH_KEY=fragile.key.hex()))
        assert f"host {victim_host} local-i1-h0 LOST" in status.stdout, status.stdout + status.stderr
        # a restarted worker joins as a new host and is used
        fragile.add_worker(1)
        d_new = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        assert d_new[0].host != victim_host
        np.testing.assert_array_equal(
            zp.pmap(lambda v: v * 5, devices=d_new)(ok(np.ones(1))).result(timeout=60), [0.])
    finally:
        zp.shutdown()


def test_a_value_with_a_copy_elsewhere_is_fetched_from_it_after_its_host_is_lost(fragile):
    """A value read on another island has a copy there: once its own host is
    lost, fetching it reads that copy, whether the fetch was already waiting on
    the lost host (a stopped worker: declared lost after 3 s of silence) or
    starts afterwards. A value with no copy left fails with HostLost."""
    conn = zp.connect(fragile.address, fragile.key)
    victim = next(p for name, p in fragile.procs if name == "worker-i1-h0")
    try:
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        inc = zp.pmap(lambda x: x + 1, devices=d1)
        double = zp.pmap(lambda v: v * 2, devices=d0)
        waiting, later = inc(np.full(1, 1.)), inc(np.full(1, 2.))
        only_there = inc(np.full(1, 3.))
        for x in (waiting, later):
            double(x).result(timeout=60)           # x now has a copy on island 0 too
        victim.send_signal(signal.SIGSTOP)         # it answers nothing from now on
        np.testing.assert_array_equal(waiting.result(timeout=60), [2.])
        assert [h.rank for h in conn.client.request(m.StatusRequest(False)).lost] == [d1[0].host]
        np.testing.assert_array_equal(later.result(timeout=60), [3.])
        with pytest.raises(zp.HostLost, match=f"host {d1[0].host} .* was lost"):
            only_there.result(timeout=60)
    finally:
        victim.send_signal(signal.SIGKILL)
        zp.shutdown()


def test_killed_client_has_its_buffers_freed(fragile):
    conn = zp.connect(fragile.address, fragile.key)
    try:
        wait_for(conn, empty)
        code = ("import numpy as np, zpath as zp, time\n"
                f"zp.connect({fragile.address!r})\n"
                "d = zp.make_virtual_device_set().add_slice(devices=1).devices\n"
                "keep = [zp.pmap(lambda x: x * 3, devices=d)(np.ones((1, 1000))) for _ in range(5)]\n"
                "[k.result(timeout=60) for k in keep]\n"
                "print('held', flush=True)\n"
                "time.sleep(600)\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, ZPATH_KEY=fragile.key.hex()))
        try:
            assert p.stdout.readline().strip() == "held", p.stderr.read()
            wait_for(conn, lambda s: sum(v[0] for v in s.values()) == 5)
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            wait_for(conn, empty, timeout=30)
            clients = conn.client.request(m.StatusRequest(False)).clients
            assert len(clients) == 1         # only this test's connection is left
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()
    finally:
        zp.shutdown()


def _outcome(fut, timeout):
    try:
        return fut.result(timeout=timeout)
    except Exception as e:      # noqa: BLE001 (the test looks at which)
        return e


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_client_fails_what_waits_when_the_controller_goes(sig, monkeypatch):
    """A stopped controller tells its clients; a killed one is noticed by its
    silence (ZPATH_CONTROLLER_TIMEOUT, 2 s here): what waits fails with Broken,
    well before its own deadline, and so does every later use."""
    with running_cluster(islands=1, hosts_per_island=1, devices_per_host=1,
                         env={"ZPATH_CONTROLLER_TIMEOUT": "2"}) as c:
        zp.connect(c.address, c.key, config=ClientConfig(controller_timeout_s=2.0))
        try:
            d = zp.make_virtual_device_set().add_slice(devices=1).devices
            inc = zp.pmap(lambda x: x + 1., devices=d)
            done = inc(np.zeros(1))
            np.testing.assert_array_equal(done.result(timeout=30), [1.])
            client = zp_api.current_client()
            put, client.put = client.put, lambda *a: None
            try:
                never = inc(np.zeros(1))                 # its input never leaves: it never runs
            finally:
                client.put = put
            import threading
            got: list = []
            waiter = threading.Thread(target=lambda: got.append(_outcome(never, 60)))
            waiter.start()                               # a fetch that waits
            wait_until(lambda: never._fetch is not None, timeout=10, interval=0.01, what="the fetch started")
            controller = dict(c.procs)["controller"]
            t = time.monotonic()
            controller.send_signal(sig)
            controller.wait(10)
            waiter.join(30)
            assert got and isinstance(got[0], zp.Broken), got
            assert ("shut down" if sig == signal.SIGTERM else "no answer") in str(got[0])
            assert time.monotonic() - t < 10
            with pytest.raises(zp.Broken):
                inc(done)
            np.testing.assert_array_equal(done.result(), [1.])     # fetched before: kept
        finally:
            zp.shutdown()


def test_a_hung_host_loses_its_whole_island(tmp_path):
    """A host of a 2-host island that hangs (SIGSTOP: no connection reset tells
    the other one) is lost, and so is the other host, which shares its JAX
    runtime: nothing is left waiting on a collective that cannot finish."""
    from zpath.cluster.testing import pause_host
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=1, log_dir=str(tmp_path),
                         env={"ZPATH_HOST_TIMEOUT": "3"}) as c:
        conn = zp.connect(c.address, c.key)
        try:
            import jax
            both = zp.make_virtual_device_set().add_slice(devices=2).devices
            total = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=both)
            np.testing.assert_array_equal(total(np.ones(2)).result(timeout=60), [2., 2.])
            survivor = [d for d in both if d.host == 0]
            inc = zp.pmap(lambda x: x + 1, devices=survivor)
            pause_host(c, 1)
            t = time.monotonic()
            with pytest.raises(zp.HostLost, match="was lost"):
                total(np.ones(2)).result(timeout=60)
            with pytest.raises(zp.HostLost, match="host 0 .*shares island 0's JAX runtime with host 1"):
                inc(np.ones(1)).result(timeout=60)
            assert time.monotonic() - t < 30
            st = conn.client.request(m.StatusRequest(False))
            assert sorted(h.rank for h in st.lost) == [0, 1] and st.running == 0
        finally:
            zp.shutdown()


def test_a_host_killed_mid_collective_is_named_by_hostlost_on_the_running_call(tmp_path):
    """A host of a 2-host island is killed while collectives run: the other
    host's collective fails at once (gloo: connection reset), the controller
    pings the killed one, and the running call fails with HostLost naming it
    (its rank and its name, as ``zpath status`` shows them), long before the
    heartbeat timeout (30 s here)."""
    import jax
    import jax.numpy as jnp
    from zpath.cluster.testing import kill_host
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=1, log_dir=str(tmp_path),
                         env={"ZPATH_HOST_TIMEOUT": "30"}) as c:
        conn = zp.connect(c.address, c.key)
        try:
            both = zp.make_virtual_device_set().add_slice(devices=2).devices
            step = zp.pmap(lambda x: jax.lax.psum(jnp.tanh(x @ x.T), "i")[:1] + x[:1], axis_name="i",
                           devices=both)
            x = np.ones((2, 500, 500), np.float32) * 1e-3
            step(x).result(timeout=60)
            names = {h.rank: h.name for h in conn.client.request(m.StatusRequest(False)).hosts}
            assert names == {0: "local-i0-h0", 1: "local-i0-h1"}     # ranks as the launcher numbered them
            running = [step(x) for _ in range(100)]     # some 10 ms each
            running[0].result(timeout=60)          # they run
            kill_host(c, 1)
            t = time.monotonic()
            with pytest.raises(zp.HostLost) as lost:
                for r in running:
                    r.result(timeout=60)
            assert str(lost.value).startswith(f"host 1 ({names[1]}, island 0) was lost: a collective "
                                              "with it failed"), lost.value
            assert time.monotonic() - t < 20          # not the heartbeat's 30 s
            st = conn.client.request(m.StatusRequest(False))
            assert sorted(h.rank for h in st.lost) == [0, 1]
        finally:
            zp.shutdown()


CLIENT_WITHOUT_ITS_PUT = r'''
import sys, time
import numpy as np, zpath as zp
from zpath.client import api as zp_api
zp.connect(sys.argv[1], key=sys.argv[2], name="victim")
d = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices     # the device the test uses
f = zp.pmap(lambda x: x * 2, devices=d)
f(np.ones((1, 4))).result(timeout=60)
client = zp_api.current_client()
client.put = lambda *a: None           # its input never leaves: the call waits for it
y = f(np.ones((1, 4)))
print("submitted", flush=True)
time.sleep(600)
'''


def test_a_client_that_dies_before_its_input_arrives_does_not_hold_the_device(fragile):
    """A client's call reaches the worker, but its input never does (the client
    died first): once the client is gone the call fails there, instead of
    holding the device (and everything behind it) until the input deadline."""
    conn = zp.connect(fragile.address, fragile.key)
    child = None
    try:
        d = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        inc = zp.pmap(lambda x: x + 1, devices=d)
        inc(np.zeros(1)).result(timeout=60)
        child = subprocess.Popen([sys.executable, "-c", CLIENT_WITHOUT_ITS_PUT, fragile.address,
                                  fragile.key.hex()], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "submitted"
        # its call is at the worker (sent there, waiting for its input)
        wait_until(lambda: any(cl.name == "victim" and cl.running == 1 for cl in status_of(conn.client).clients),
                   timeout=30, interval=0.05, what="the victim's call at the worker")
        blocked = inc(np.zeros(1))              # behind the waiting call on the same device
        child.kill()
        child.wait(10)
        t = time.monotonic()
        np.testing.assert_array_equal(blocked.result(timeout=60), [1.])
        assert time.monotonic() - t < 20        # the client timeout (3 s), not the input deadline
    finally:
        if child is not None:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            child.stdout.close()
        zp.shutdown()


def test_futures_dropped_before_their_host_is_lost_stay_freed(fragile):
    """Computations whose futures were dropped are running when their host is
    lost: failing them does not bring their released outputs back."""
    import gc

    import jax
    import jax.numpy as jnp
    conn = zp.connect(fragile.address, fragile.key)
    try:
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        slow = zp.pmap(lambda x: jax.lax.fori_loop(0, 3000, lambda i, a: jnp.tanh(a @ a), x), devices=d1)
        x = np.eye(300)[None] * 0.01
        for _ in range(3):
            slow(x)                              # dropped at once
        gc.collect()
        # their releases reach the controller while they still run
        st = wait_until(lambda: s if (s := status_of(conn.client)).buffers == 0 or s.running < 1 else None,
                        timeout=30, interval=0.05, what="the releases at the controller (or the calls done)")
        assert st.running >= 1 and st.buffers == 0, st
        next(p for name, p in fragile.procs if name == "worker-i1-h0").kill()
        deadline = time.monotonic() + 30
        while not conn.client.request(m.StatusRequest(False)).lost:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        st = conn.client.request(m.StatusRequest(False))
        assert st.buffers == 0 and st.running == 0, st
    finally:
        zp.shutdown()


def test_a_client_that_gave_up_on_a_stalled_controller_says_goodbye(monkeypatch):
    """The controller stalls (SIGSTOP) past the client's patience: the client
    fails with Broken and says goodbye (and stops its heartbeats), so once the
    controller runs again it frees what that client held rather than keep it
    for a client that will never use it."""
    from zpath.client.connection import Client
    with running_cluster(islands=1, hosts_per_island=1, devices_per_host=1) as c:
        zp.connect(c.address, c.key, name="impatient", config=ClientConfig(controller_timeout_s=2.0))
        other = None
        try:
            d = zp.make_virtual_device_set().add_slice(devices=1).devices
            held = zp.pmap(lambda x: x + 1., devices=d)(np.zeros(1))
            held.result(timeout=30)
            controller = dict(c.procs)["controller"]
            controller.send_signal(signal.SIGSTOP)
            wait_until(lambda: psutil.Process(controller.pid).status() == psutil.STATUS_STOPPED,
                       timeout=10, interval=0.01, what="the controller stopped")
            # the request waits for an answer until the client gives up on
            # the silent controller (2 s), and fails then
            t = time.monotonic()
            with pytest.raises(zp.Broken, match="no answer"):
                zp.make_virtual_device_set().add_slice(devices=1)
            assert time.monotonic() - t < 30
            controller.send_signal(signal.SIGCONT)
            other = Client(c.address, c.key, name="other")        # while "impatient" is still open
            deadline = time.monotonic() + 10
            while True:
                st = other.request(m.StatusRequest(False))
                if [cl.name for cl in st.clients] == ["other"] and st.buffers == 0:
                    break
                assert time.monotonic() < deadline, st
                time.sleep(0.2)
        finally:
            if other is not None:
                other.close()
            zp.shutdown()


def test_a_client_the_controller_dropped_fails_at_once(fragile, monkeypatch):
    """A client silent past ZPATH_CLIENT_TIMEOUT (a process stopped with
    Ctrl-Z, say; here its heartbeats are turned off) is dropped and what it
    held is freed. When it speaks again, the controller's not_registered
    answer breaks it: its futures and later calls fail with Broken at once
    rather than wait out their fetch deadlines."""
    import zpath.client.connection as zc
    breaks = []
    second_break = threading.Event()
    real_break = zc.Client._break

    def counted_break(self, *a, **k):
        breaks.append(a)
        if len(breaks) > 1:
            second_break.set()
        return real_break(self, *a, **k)
    monkeypatch.setattr(zc.Client, "_break", counted_break)
    conn = zp.connect(fragile.address, fragile.key, name="sleepy")
    other = None
    try:
        d = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        inc = zp.pmap(lambda x: x + 1., devices=d)
        held = inc(np.ones(1))
        assert held.result(timeout=30) == 2.
        held2 = inc(held)        # not fetched: it waits on the worker
        # the controller has that call (a request on the same connection is
        # answered after it); only now does "sleepy" fall silent: on a loaded
        # machine the first call's compile can outlast the client timeout
        status_of(conn.client)
        monkeypatch.setattr(zc, "HEARTBEAT_S", 3600.0)
        # another client (its requests keep it known to the controller) sees
        # the controller drop "sleepy" once its 3 s client timeout has passed
        other = Client(fragile.address, fragile.key, name="other")
        wait_until(lambda: [cl.name for cl in status_of(other).clients] == ["other"], timeout=30,
                   interval=0.1, what="the controller dropping the silent client")
        t0 = time.monotonic()
        late = inc(np.ones(1))   # the controller answers not_registered
        with pytest.raises(zp.Broken, match="dropped this client"):
            late.result(timeout=60)
        with pytest.raises(zp.Broken, match="dropped this client"):
            held2.result(timeout=60)
        assert time.monotonic() - t0 < 10
        with pytest.raises(zp.Broken):
            inc(np.ones(1))
        del held, held2, late          # releases are not sent by a broken client
        quiet_from = time.monotonic()
        # nothing it put stays on the workers, the value of the call the
        # controller refused included (ClientGone: the worker drops that Put)
        wait_until(lambda: (st := status_of(other)).stores and all(h.shards == 0 for h in st.stores)
                   and st.buffers == 0, timeout=10, interval=0.2, what="the stores emptied")
        # nothing more happens to it: no second break within a window of at
        # least 1 s (a check that something does not happen), most of it spent
        # above while the stores emptied
        assert not second_break.wait(max(0.0, quiet_from + 1.0 - time.monotonic())), breaks
        assert len(breaks) == 1, breaks     # once: no goodbye, no answer, no second break
    finally:
        if other is not None:
            other.close()
        zp.shutdown()
