"""Islands of several worker processes: SPMD with collectives across hosts, gang
order, many clients, disjoint subsets running concurrently."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import zpath as zp
from zpath.cluster.launcher import LocalCluster
from zpath.net import messages as m
from tests.conftest import assert_gone, connected, running_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def island():
    """One island of two hosts (one JAX runtime), two devices per host."""
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=2) as c:
        yield c


@pytest.fixture
def client(island):
    with connected(island) as conn:
        yield conn


def whole_island():
    devs = zp.make_virtual_device_set().add_slice(devices=4).devices
    assert {d.host for d in devs} == {0, 1}
    return devs


def test_psum_across_hosts(client):
    import jax
    devs = whole_island()
    f = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=devs)
    x = np.arange(8.).reshape(4, 2) + 1
    np.testing.assert_array_equal(np.asarray(f(x)), np.broadcast_to(x.sum(0), (4, 2)))
    # all_gather and a chain of collectives fed by futures
    g = zp.pmap(lambda x: jax.lax.all_gather(x, "i").sum(0) * jax.lax.axis_index("i"),
                axis_name="i", devices=devs)
    y = g(f(x))
    expect = np.stack([4 * x.sum(0) * i for i in range(4)])
    np.testing.assert_array_equal(np.asarray(y), expect)


def _niceness(pid: int) -> dict[int, tuple[str, int]]:
    """Each thread of process ``pid``: (its kernel name, its niceness)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:     # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out[int(tid)] = (name, int(stat[stat.rindex(")") + 2:].split()[16]))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is read from Linux's /proc")
def test_collectives_network_thread_runs_at_a_higher_niceness(island, client):
    """A worker of a multi-host island lowers the priority of gloo's network
    thread only (ZPATH_COLLECTIVES_NICE, default 10): the one thread that the
    collectives' set-up started, none of the worker's own and not its main thread."""
    test_psum_across_hosts(client)      # (the island has run collectives)
    workers = [p.pid for name, p in island.procs if name.startswith("worker")]
    assert len(workers) == 2
    for pid in workers:
        threads = _niceness(pid)
        main_nice = threads[pid][1]
        raised = {tid: name for tid, (name, nice) in threads.items() if nice == min(19, main_nice + 10)}
        assert len(raised) == 1, threads
        assert not any(n.startswith(("zpath-", "ZMQbg")) for n in raised.values()), raised
        assert all(nice == main_nice for tid, (_, nice) in threads.items() if tid not in raised), threads


def test_jit_2x2_mesh_matmul_matches_jax(client, x64):
    import jax
    import jax.numpy as jnp
    devs = whole_island()
    P = zp.P
    mesh = zp.Mesh(np.array(devs).reshape(2, 2), ("data", "model"))
    f = zp.jit(lambda x, w: jnp.tanh(x @ w), mesh=mesh,
               in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 6)), rng.normal(size=(6, 4))
    with jax.enable_x64(True):
        expect = np.asarray(jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w))
    np.testing.assert_allclose(np.asarray(f(x, w)), expect, rtol=1e-13)


def test_subsets_of_the_island(client):
    """A collective on one device of each host, and a computation on one host
    only, consuming values that live on the other devices."""
    import jax
    devs = whole_island()
    pair = [devs[0], devs[2]]               # device 0 of each host
    total = zp.pmap(lambda x: jax.lax.psum(x, "p"), axis_name="p", devices=pair)
    local = zp.pmap(lambda x: x * 10, devices=devs[2:])   # host 1 only
    a = total(np.array([1., 2.]))
    b = local(a)
    np.testing.assert_array_equal(np.asarray(b), [30., 30.])


def test_a_collective_after_a_computation_whose_output_another_host_awaits(client):
    """Host 0 computes y alone (slowly), host 1 reads it (a piece of y goes to
    host 1) and a cheap collective of both hosts follows on both. Host 0 must
    send y's piece before it is held up in that collective: XLA:CPU runs a cheap
    computation inside its call, so a worker that stored y (which sends the
    piece) only once the collective's call returned would wait there for host
    1, which waits for y, until the input timeout (300 s)."""
    import jax
    import jax.numpy as jnp
    devs = whole_island()
    pair = [devs[0], devs[2]]               # device 0 of each host
    total = zp.pmap(lambda x: jax.lax.psum(x, "p"), axis_name="p", devices=pair)

    def slow(x):
        m = jnp.full((200, 200), 1e-3)
        return x + 0. * jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ a), m).sum()

    first = zp.pmap(slow, devices=devs[:1])          # host 0 only
    then = zp.pmap(lambda x: x * 10, devices=devs[2:3])   # host 1 only
    # each compiled and run once (a first call is settled another way)
    np.testing.assert_array_equal(total(np.array([1., 2.])).result(timeout=60), [3., 3.])
    np.testing.assert_array_equal(then(first(np.array([1.]))).result(timeout=60), [10.])
    for _ in range(3):
        y = first(np.array([1.]))
        z = then(y)
        s = total(np.array([1., 2.]))
        np.testing.assert_array_equal(z.result(timeout=60), [10.])
        np.testing.assert_array_equal(s.result(timeout=60), [3., 3.])


def test_cross_island_call_is_rejected(island):
    """A computation may not span hosts that share no runtime: a clear error."""
    c = LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1)
    pids = c.pids
    try:
        zp.connect(c.address, c.key)
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        with pytest.raises(ValueError, match=r"span islands \[0, 1\]: a computation runs on one island"):
            zp.pmap(lambda x: x + 1, devices=d0 + d1)       # at placement, before any call
        with pytest.raises(ValueError, match="span islands"):
            zp.jit(lambda x: x + 1, mesh=zp.Mesh(d0 + d1, ("i",)))
        with pytest.raises(zp.ResourceError, match="no host has 2 devices .*no island has several hosts"):
            zp.make_virtual_device_set().add_slice(devices=2)
    finally:
        zp.shutdown()
        c.stop()
        assert_gone(pids)


def _timeline(client, names):
    recs = client.client.request(m.TimelineRequest(1000)).records
    return [r for r in recs if r.name in names]


def test_disjoint_subsets_run_concurrently(client):
    """Two collectives on disjoint halves of the island overlap in time on both hosts."""
    import jax
    import jax.numpy as jnp
    devs = whole_island()

    def heavy(x):
        def body(i, a):
            return jnp.tanh(a @ a) * 0.5
        y = jax.lax.fori_loop(0, 12, body, x)
        return jax.lax.psum(y.sum(), "h")

    def left(x):
        return heavy(x)

    def right(x):
        return heavy(x)

    f = zp.pmap(left, axis_name="h", devices=[devs[0], devs[2]])
    g = zp.pmap(right, axis_name="h", devices=[devs[1], devs[3]])
    x = np.random.default_rng(0).normal(size=(2, 400, 400)) * 0.05
    f(x).result(timeout=120), g(x).result(timeout=120)    # compile
    for _ in range(3):
        a, b = f(x), g(x)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    recs = _timeline(client, {"left", "right"})
    overlaps = 0
    for host in (0, 1):
        mine = [r for r in recs if r.host == host]
        lefts = [r for r in mine if r.name == "left"][-3:]
        rights = [r for r in mine if r.name == "right"][-3:]
        for lr, rr in zip(lefts, rights, strict=True):
            assert lr.ok and rr.ok
            if min(lr.end, rr.end) > max(lr.start, rr.start):
                overlaps += 1
    # run one after the other they would never overlap; require a clear share of
    # the 6 pairs (robust to a loaded machine delaying one side)
    assert overlaps >= 2, recs


CLIENT = textwrap.dedent("""
    import sys, numpy as np, jax, zpath as zp
    zp.connect(sys.argv[1])
    me = int(sys.argv[2])
    devs = zp.make_virtual_device_set().add_slice(devices=4).devices
    full = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=devs)
    # overlapping subsets, each spanning both hosts
    sub_a = zp.pmap(lambda x: jax.lax.psum(x, "i") * 2, axis_name="i", devices=[devs[0], devs[2]])
    sub_b = zp.pmap(lambda x: jax.lax.pmax(x, "i"), axis_name="i", devices=[devs[1], devs[2], devs[3]])
    outs = []
    for k in range(200):
        v = float(me * 1000 + k)
        if k % 3 == 0:
            outs.append((full(np.full(4, v)), 4 * v))
        elif k % 3 == 1:
            outs.append((sub_a(np.array([v, 1.])), 2 * (v + 1)))
        else:
            outs.append((sub_b(np.array([v, v + 5, 1.])), v + 5))
    bad = [(k, o.result(timeout=120)[0], e) for k, (o, e) in enumerate(outs) if o.result(timeout=120)[0] != e]
    print("BAD", bad[:5]) if bad else print("OK", len(outs))
    zp.shutdown()
""")


# fused programs (chains of collectives on overlapping subsets, one gang-order
# place per run) interleaved with plain calls
CLIENT_FUSED = textwrap.dedent("""
    import sys, numpy as np, jax, zpath as zp
    from zpath.net import messages as m
    conn = zp.connect(sys.argv[1])
    me = int(sys.argv[2])
    devs = zp.make_virtual_device_set().add_slice(devices=4).devices
    full = zp.pmap(lambda x: jax.lax.psum(x, "i") / 4 + 1., axis_name="i", devices=devs)
    sub = zp.pmap(lambda x: jax.lax.psum(x, "i") / 2 + 1., axis_name="i", devices=[devs[1], devs[2]])

    @zp.program
    def chain(x):
        for _ in range(6):
            x = full(x)
        return x

    @zp.program
    def chain_sub(x):
        for _ in range(6):
            x = sub(x)
        return x
    outs = []
    x, y = np.full(4, float(me)), np.full(2, float(me))
    for k in range(30):
        x, y = chain(x), chain_sub(y)
        outs.append((full(np.full(4, float(k))), k + 1.))
    bad = [(k, o.result(timeout=120)[0], e) for k, (o, e) in enumerate(outs) if o.result(timeout=120)[0] != e]
    want = float(me) + 180.
    if np.asarray(x).tolist() != [want] * 4 or np.asarray(y).tolist() != [want] * 2:
        bad.append(("chains", np.asarray(x).tolist(), np.asarray(y).tolist(), want))
    fused = sum(r.name.endswith("fused)") and r.client == conn.client.client_id
                for r in conn.client.request(m.TimelineRequest(100_000)).records)
    print("BAD", bad[:5]) if bad else print("OK", fused)
    zp.shutdown()
""")


# the same on an island of one device per host, with a node that reads an
# earlier value than the last one made
CLIENT_FUSED_ONE = textwrap.dedent("""
    import sys, numpy as np, jax, zpath as zp
    from zpath.net import messages as m
    conn = zp.connect(sys.argv[1])
    me = int(sys.argv[2])
    devs = zp.make_virtual_device_set().add_slice(devices=2).devices
    inc = zp.pmap(lambda x: jax.lax.psum(x, "i") / 2 + 1., axis_name="i", devices=devs)

    @zp.program
    def chain(x):
        a = inc(x)
        b = inc(inc(a))
        c = inc(inc(a))         # reads a, not the last one launched
        return inc(b), c
    outs, bad = [], []
    x = np.full(2, float(me))
    for k in range(30):
        x, c = chain(x)
        outs.append((c, float(me) + 4 * k + 3))
        outs.append((inc(np.full(2, float(k))), k + 1.))
    bad = [(k, o.result(timeout=120)[0], e) for k, (o, e) in enumerate(outs) if o.result(timeout=120)[0] != e]
    if np.asarray(x).tolist() != [float(me) + 120.] * 2:
        bad.append(("chain", np.asarray(x).tolist()))
    fused = sum(r.name.endswith("fused)") and r.client == conn.client.client_id
                for r in conn.client.request(m.TimelineRequest(100_000)).records)
    print("BAD", bad[:5]) if bad else print("OK", fused)
    zp.shutdown()
""")


def _run_clients(cluster: LocalCluster, n: int, timeout: float,
                 script: str = CLIENT) -> list[subprocess.CompletedProcess]:
    """Run ``script`` in ``n`` client processes against ``cluster``. If one
    fails or does not end, every thread's stack in the cluster's processes is
    printed (pytest shows it with the failure): what a hang waits on."""
    env = dict(os.environ, ZPATH_KEY=cluster.key.hex())
    procs = [subprocess.Popen([sys.executable, "-c", script, cluster.address, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    out = []
    try:
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(cluster.stacks())
                raise
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
            if p.returncode != 0 and sum(r.returncode != 0 for r in out) == 1:    # the first
                print(cluster.stacks())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_three_clients_interleaved_collectives(island):
    """3 clients x 200 collective computations on one 2-host island, on
    overlapping device subsets: no deadlock, every result correct."""
    for r in _run_clients(island, 3, timeout=240):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == "OK 200", r.stdout + r.stderr[-3000:]


def test_clients_running_fused_programs_and_calls_on_one_island(island):
    """2 clients x 30 runs of two fused programs of 6 collectives each (on
    the whole island and on a subset spanning both hosts) between plain
    collective calls: no deadlock, every result correct, runs fused."""
    for r in _run_clients(island, 2, timeout=240, script=CLIENT_FUSED):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("OK "), r.stdout + r.stderr[-3000:]
        assert int(r.stdout.split()[1]) >= 50, r.stdout      # 58 runs after the 2 that define


def test_fused_programs_of_collectives_on_one_device_per_host():
    """2 clients x 30 runs of a fused program of 6 collectives on an island of
    2 hosts with one device each, between plain collective calls: no
    deadlock, every result correct, runs fused."""
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=1) as c:
        for r in _run_clients(c, 2, timeout=240, script=CLIENT_FUSED_ONE):
            assert r.returncode == 0, r.stderr[-3000:]
            assert r.stdout.startswith("OK "), r.stdout + r.stderr[-3000:]
            assert int(r.stdout.split()[1]) >= 25, r.stdout      # 29 runs after the one that defines


def _two_collectives():
    import jax
    devs = zp.make_virtual_device_set().add_slice(devices=4).devices
    one = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=devs)
    two = zp.pmap(lambda x: jax.lax.all_gather(jax.lax.psum(x * 2, "i"), "i"), axis_name="i",
                  devices=devs)
    return one(np.ones((4, 1000))), two(np.ones((4, 3)))


def test_gang_order_control(client):
    """The submissions of the next test complete under the real gang order."""
    a, b = _two_collectives()
    np.testing.assert_array_equal(a.result(timeout=60), np.full((4, 1000), 4.))
    np.testing.assert_array_equal(b.result(timeout=60), np.full((4, 4, 3), 8.))


class _BrokenGangCluster(LocalCluster):
    """A local cluster whose controller breaks the gang order (tests/controller_broken_gang.py)."""

    def _spawn(self, name, argv, env, stdin=subprocess.DEVNULL):
        if name == "controller":         # [python, -m, zpath.controller, *arguments]
            argv = [sys.executable, os.path.join(os.path.dirname(__file__), "controller_broken_gang.py"),
                    *argv[3:]]
        return super()._spawn(name, argv, env, stdin)


def test_broken_gang_order_deadlocks(tmp_path):
    """The same submissions with the gang order deliberately broken (host 1 gets
    multi-host computations pairwise swapped) do not complete: the collectives of
    the two hosts no longer match, and the hosts hang or abort inside gloo. So
    the order is what prevents the deadlock. Runs in its own cluster, then killed."""
    c = _BrokenGangCluster(islands=1, hosts_per_island=2, devices_per_host=2, log_dir=str(tmp_path))
    pids = c.pids
    try:
        zp.connect(c.address, c.key)
        a, b = _two_collectives()
        # hung (deadline), aborted inside gloo (RemoteError), or hung so hard
        # under load that the host stopped answering pings (HostLost)
        with pytest.raises((zp.DeadlineExceeded, zp.RemoteError, zp.HostLost)) as info:
            a.result(timeout=15)
            b.result(timeout=15)
        if isinstance(info.value, zp.RemoteError):   # aborted rather than hung
            assert "gloo" in str(info.value).lower(), info.value
        logs = "".join(open(tmp_path / f).read() for f in os.listdir(tmp_path) if f.endswith(".log"))
        assert "out of gang order" in logs
    finally:
        zp.shutdown()
        c.stop(grace=2)
        assert_gone(pids)
