"""Multi-tenancy: client weights, proportional share and FIFO between client
processes on one device, per-client device time in status, and queued work
cancelled when a client dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import zpath as zp
from zpath.client.connection import Client
from zpath.errors import ProtocolError
from zpath.cluster.launcher import stop_processes
from zpath.net import messages as m
from zpath.cluster.testing import connected, wait_until

pytestmark = pytest.mark.timeout(240)

# A client process: connect with a weight, keep up to DEPTH computations of a
# few milliseconds outstanding on the cluster's one device for SECONDS, print
# its client id. With SUBMIT_ONLY it submits N computations, says so and waits
# (to be killed). With AFTER_WARM it reads a line before its first call.
CLIENT = r"""
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
import zpath as zp
address, key, weight, seconds, depth = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
conn = zp.connect(address, key, name=f"w{weight:g}", weight=weight)
dev = zp.make_virtual_device_set().add_slice(devices=1).devices

def work(x):
    return jax.lax.fori_loop(0, 6, lambda i, y: jnp.tanh(y @ y), x)

f = zp.pmap(work, devices=dev)
x = np.full((1, 384, 384), 0.01, np.float32)
if os.environ.get("AFTER_WARM"):            # until told that another client compiled f
    sys.stdin.readline()
x = f(x)                                   # compiled and warm; x stays on the devices
x.result(timeout=60)
print("id", conn.client.client_id, flush=True)
if os.environ.get("SUBMIT_ONLY"):
    n = int(os.environ["SUBMIT_ONLY"])
    if os.environ.get("PROGRAM"):               # one program of n nodes, each waiting for the last
        def chain(y):
            for _ in range(n):
                y = f(y)
            return y
        futs = zp.program(chain, dispatch=os.environ["PROGRAM"])(x)
    else:
        futs = [f(x) for _ in range(n)]
    print("submitted", flush=True)
    time.sleep(600)
sys.stdin.readline()                        # all clients start together
out, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    out.append(f(x))
    if len(out) >= depth:
        out.pop(0).result(timeout=60)
for o in out:
    o.result(timeout=60)
print("done", flush=True)
zp.shutdown()
"""


def _spawn(cluster, weight: float, seconds: float, depth: int = 32, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, cluster.address, cluster.key.hex(), str(weight),
                             str(seconds), str(depth)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, **(env or {})))


def _stop(procs: list[subprocess.Popen]) -> None:
    stop_processes(procs, grace=10)


def _client_id(p: subprocess.Popen) -> int:
    line = p.stdout.readline()
    assert line.startswith("id "), f"client process said {line!r}"
    return int(line.split()[1])


def _shares(cluster, weights: list[float], seconds: float, warm: bool = True) -> dict[float, float]:
    """Run one client process per weight, all backlogged at once; return each
    weight's share of the device time measured while all of them were busy.
    ``warm``: a first client compiles the program on the worker, so no measured
    client is charged the compilation (the clients share the compiled program);
    a policy that keeps no account of device time (fifo) needs none."""
    # (the measured clients start meanwhile, and make their first call after it)
    first = _spawn(cluster, 1.0, 0) if warm else None
    procs = [_spawn(cluster, w, seconds, env={"AFTER_WARM": "1"} if warm else None) for w in weights]
    try:
        if first is not None:
            _client_id(first)
            first.stdin.write("go\n")
            first.stdin.flush()
            assert first.wait(60) == 0
            for p in procs:
                p.stdin.write("warm\n")
                p.stdin.flush()
        ids = {_client_id(p): w for p, w in zip(procs, weights)}
        go = time.time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(60) == 0
    finally:
        _stop(procs + ([first] if first is not None else []))
    with connected(cluster) as conn:
        recs = [r for r in conn.client.request(m.TimelineRequest(100_000)).records if r.client in ids]
    # the interval in which every client had work: from the start signal to
    # the first last end, trimmed by 15% at each side (each client's first,
    # compiling computation ran before the signal and is charged to it; the
    # scheduler evens that out right after the signal)
    last = min(max(r.end for r in recs if r.client == c) for c in ids)
    assert last - go > seconds / 2, (go, last)
    lo, hi = go + 0.15 * (last - go), last - 0.15 * (last - go)
    used = {w: 0.0 for w in weights}
    for r in recs:
        used[ids[r.client]] += max(0.0, min(r.end, hi) - max(r.start, lo)) * len(r.devices)
    total = sum(used.values())
    return {w: u / total for w, u in used.items()}


@pytest.fixture(scope="module")
def one_device():
    from zpath.cluster.testing import running_cluster
    with running_cluster(islands=1, hosts_per_island=1, devices_per_host=1) as c:
        yield c


def test_proportional_share_follows_weights(one_device):
    shares = _shares(one_device, [1.0, 3.0], seconds=8)
    assert shares[3.0] == pytest.approx(0.75, abs=0.08), shares


def test_fifo_ignores_weights(zpath_cluster):
    cluster = zpath_cluster(islands=1, hosts_per_island=1, devices_per_host=1, policy="fifo")
    with connected(cluster) as conn:
        assert conn.client.request(m.StatusRequest(False)).policy == "fifo"
    shares = _shares(cluster, [1.0, 3.0], seconds=6, warm=False)
    # both keep the same number of computations waiting: about equal turns
    assert shares[3.0] == pytest.approx(0.5, abs=0.12), shares


def test_status_lists_clients_with_weight_and_device_time(one_device):
    conn = zp.connect(one_device.address, one_device.key, name="weighted", weight=2.5)
    try:
        dev = zp.make_virtual_device_set().add_slice(devices=1).devices
        f = zp.pmap(lambda x: x * 2., devices=dev)
        x = np.ones((1, 1000))
        for _ in range(5):
            x = f(x)
        np.testing.assert_array_equal(np.asarray(x), np.full((1, 1000), 32.))
        ask = lambda: conn.client.request(m.StatusRequest(False))    # noqa: E731
        # the value can be fetched before the worker's ExecDone reached the controller
        wait_until(lambda: ask().running == 0, timeout=10)
        st = ask()
        assert st.policy == "share"
        me = [c for c in st.clients if c.id == conn.client.client_id]
        assert len(me) == 1 and me[0].name == "weighted" and me[0].weight == 2.5
        assert me[0].device_seconds > 0 and me[0].running == 0 and me[0].queued == 0
        out = subprocess.run([sys.executable, "-m", "zpath", "status", one_device.address],
                             env=dict(os.environ, ZPATH_KEY=one_device.key.hex()),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "scheduling policy: share" in out.stdout
        assert f"client {conn.client.client_id} weighted: weight 2.5, device time" in out.stdout
    finally:
        zp.shutdown()


def test_bad_weights_are_refused(one_device):
    for w in (0, -1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="weight"):
            zp.connect(one_device.address, one_device.key, weight=w)
    # the controller checks too (a client that skips the API's check)
    with pytest.raises(ProtocolError, match="weight must be"):
        Client(one_device.address, one_device.key, weight=-1.0, timeout=10)


@pytest.fixture(scope="module")
def quick_to_drop_clients():
    """One device; a client silent for 2 s counts as gone."""
    from zpath.cluster.testing import running_cluster
    with running_cluster(islands=1, hosts_per_island=1, devices_per_host=1,
                         env={"ZPATH_CLIENT_TIMEOUT": "2"}) as c:
        yield c


@pytest.mark.parametrize("program", ["", "parallel", "sequential"])
def test_killed_client_has_its_queued_work_cancelled(quick_to_drop_clients, program):
    """Calls, or the nodes of one program (held for their turn, or in sequential
    mode for their predecessors), of a client killed meanwhile never run. (The
    cases share a cluster: each leaves it with nothing running, queued or stored.)"""
    cluster = quick_to_drop_clients
    p = _spawn(cluster, 1.0, 0, env={"SUBMIT_ONLY": "2000", "PROGRAM": program})
    try:
        cid = _client_id(p)
        assert p.stdout.readline().strip() == "submitted"
        with connected(cluster) as conn:
            ask = lambda: conn.client.request(m.StatusRequest(False))   # noqa: E731
            # most wait at the controller (once its I/O thread has sent them)
            wait_until(lambda: any(c.id == cid and c.queued > 0 for c in ask().clients), timeout=30)
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            wait_until(lambda: not any(c.id == cid for c in ask().clients), timeout=30)
            wait_until(lambda: ask().running == 0 and ask().queued == 0, timeout=30)
            ran = [r for r in conn.client.request(m.TimelineRequest(100_000)).records
                   if r.client == cid]
            assert 1 <= len(ran) < 2000, len(ran)          # the queued ones never ran
            wait_until(lambda: all(s.shards == 0 for s in ask().stores), timeout=30)
            assert ask().buffers == 0
            # the device still serves others
            dev = zp.make_virtual_device_set().add_slice(devices=1).devices
            np.testing.assert_array_equal(np.asarray(zp.pmap(lambda x: x + 1., devices=dev)(np.zeros((1, 3)))),
                                          np.ones((1, 3)))
    finally:
        _stop([p])
