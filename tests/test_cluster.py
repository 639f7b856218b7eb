"""Integration tests on real local clusters of several worker processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import zpath as zp
from zpath.cluster import connfile
from zpath.cluster import launcher
from zpath.cluster.launcher import LocalCluster, SimulatedCluster, free_port
from zpath.config import ClusterConfig
from zpath.net import transport
from zpath.cluster.testing import connected, wait_until
from tests.conftest import assert_gone
from tests.test_channels import channel_stats

pytestmark = pytest.mark.timeout(180)


def devices(n, **kw):
    return zp.make_virtual_device_set().add_slice(devices=n, **kw).devices


def figure2(islands=(None, None, None)):
    a = zp.pmap(lambda x: x * 2., devices=devices(2, island=islands[0]))
    b = zp.pmap(lambda x: x + 1., devices=devices(2, island=islands[1]))
    c = zp.pmap(lambda x: x / 2., devices=devices(2, island=islands[2]))

    def f(v):
        x = a(v)
        y = b(x)
        z = a(c(x))
        return (y, z)
    return f(np.array([1., 2.])), (a, b, c)


def test_figure2_example(client):
    (y, z), (a, b, c) = figure2()
    assert isinstance(y, zp.Future) and y.shape == (2,) and y.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(y), [3., 5.])
    np.testing.assert_array_equal(z.result(timeout=30), [2., 4.])
    assert repr((y, z)) == "(array([3., 5.], dtype=float32), array([2., 4.], dtype=float32))"
    # the slices were spread: not every computation on the same devices
    placements = {tuple(d.id for d in comp.mesh.devices.flat) for comp in (a, b, c)}
    assert len(placements) > 1


def test_figure2_across_two_islands(client):
    (y, z), (a, b, c) = figure2(islands=(0, 1, 0))
    assert {d.island for d in b.mesh.devices.flat} == {1}
    assert {d.island for d in a.mesh.devices.flat} == {0}
    np.testing.assert_array_equal(np.asarray(y), [3., 5.])
    np.testing.assert_array_equal(np.asarray(z), [2., 4.])


def test_chain_of_100_calls(client, monkeypatch):
    inc = zp.pmap(lambda x: x + 1., devices=devices(2))
    x = np.zeros((2, 3))
    hurried = []
    hurry = transport._hurry
    monkeypatch.setattr(transport, "_hurry", lambda: hurried.append(hurry()) or hurried[-1])
    # (the first call hurries however recently the I/O thread sent something)
    monkeypatch.setattr(transport, "HURRY_IDLE_S", 0.0)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        for _ in range(100):
            x = inc(x)
        np.testing.assert_array_equal(np.asarray(x), np.full((2, 3), 100.))
        # the I/O thread was hurried for the first call (transport.HURRY_SWITCH_S),
        # and sets the interval back once it has sent what waited
        assert True in hurried
        wait_until(lambda: sys.getswitchinterval() == 0.005, timeout=10, what="the switch interval set back")
    finally:
        sys.setswitchinterval(before)


def test_chain_alternating_hosts(client):
    """Every call consumes a value that lives on the other host."""
    on0 = zp.pmap(lambda x: x * 3., devices=devices(2, host=0))
    on1 = zp.pmap(lambda x: x - 1., devices=devices(2, host=1))
    x = np.arange(4.).reshape(2, 2)
    expect = x.copy()
    for _ in range(10):
        x = on1(on0(x))
        expect = expect * 3. - 1.
    np.testing.assert_allclose(np.asarray(x), expect)


def test_inputs_from_other_hosts_and_resharding(client):
    """A value sharded on host 0 is consumed replicated, and resharded 2-D, on host 1."""
    d0, d1 = devices(2, host=0), devices(2, host=1)
    P = zp.P
    make = zp.jit(lambda x: x * 10., mesh=zp.Mesh(d0, ("i",)), in_specs=P("i"), out_specs=P("i"))
    total = zp.jit(lambda x, y: x.sum() + y.sum(), mesh=zp.Mesh(d1, ("j",)),
                   in_specs=(P(), P("j")), out_specs=P())
    col = zp.jit(lambda x: x.T, mesh=zp.Mesh(d1, ("j",)), in_specs=P(None, "j"), out_specs=P("j"))
    a = np.arange(8.).reshape(4, 2)
    x = make(a)
    np.testing.assert_array_equal(np.asarray(total(x, x)), 2 * (a * 10.).sum())
    np.testing.assert_array_equal(np.asarray(col(x)), (a * 10.).T)


def test_jit_over_a_mesh_matches_jax(client, x64):
    import jax
    P = zp.P
    mesh = zp.Mesh(np.array(devices(2)), ("data",))
    f = zp.jit(lambda x, w: jax.numpy.tanh(x @ w), mesh=mesh, in_specs=(P("data"), P()),
               out_specs=P("data"))
    x = np.random.default_rng(0).normal(size=(4, 3))
    w = np.random.default_rng(1).normal(size=(3, 5))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.tanh(x @ w), rtol=1e-12)


def test_pytrees_and_scalars(client):
    f = zp.pmap(lambda d, s: {"sum": d["a"] + d["b"] * s, "neg": -d["a"]}, devices=devices(2))
    out = f({"a": np.ones(2), "b": np.arange(2.)}, np.array([2., 3.]))
    assert set(out) == {"sum", "neg"}
    np.testing.assert_array_equal(np.asarray(out["sum"]), [1., 4.])
    np.testing.assert_array_equal(np.asarray(out["neg"]), [-1., -1.])
    g = zp.jit(lambda x: x * 2, mesh=zp.Mesh(devices(1), ("i",)))
    assert np.asarray(g(3)) == 6 and g(np.float32(1.5)).dtype == np.float32
    assert g(1) and not g(0) and g(True)            # a 0-d future's truth is its value's


def test_returns_before_the_controller_answers(client):
    """A call returns a future at once; the value arrives later."""
    slow = zp.pmap(lambda x: x @ x @ x @ x, devices=devices(1))
    x = np.eye(600)[None] * 0.5
    slow(x).result(timeout=60)  # compile once
    t = time.perf_counter()
    fut = slow(x)
    returned = time.perf_counter() - t
    assert not fut.done()
    np.testing.assert_allclose(fut.result(timeout=60)[0], np.eye(600) * 0.0625)
    fetched = time.perf_counter() - t
    assert returned < fetched


def test_trace_error_raised_at_call_site(client):
    import jax
    f = zp.pmap(lambda x: x @ np.ones((5, 5)), devices=devices(2))
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        f(np.ones((2, 3)))
    # JAX's own error for an unknown collective axis is an empty AssertionError: named here
    wrong = zp.pmap(lambda x: jax.lax.psum(x, "j"), axis_name="i", devices=devices(2))
    with pytest.raises(ValueError, match="axis name the mesh does not have; .*axis names: 'i'"):
        wrong(np.ones(2))
    unnamed = zp.pmap(lambda x: jax.lax.psum(x, "i"), devices=devices(2))
    with pytest.raises(ValueError, match="zp.pmap was given no axis_name"):
        unnamed(np.ones(2))
    with pytest.raises(TypeError, match=r"dtype <U3\) to a zpath computation"):
        f("abc")


def test_shape_mismatch_raised_before_dispatch(client):
    f = zp.pmap(lambda x: x + 1, devices=devices(2))
    with pytest.raises(ValueError, match="leading axis of size 2"):
        f(np.ones((3, 2)))
    g = zp.jit(lambda x: x, mesh=zp.Mesh(devices(2), ("i",)), in_specs=zp.P("i"))
    with pytest.raises(ValueError, match="evenly divide"):
        g(np.ones(3))


def test_remote_failure_reaches_the_future(client):
    """A computation that fails on the worker (here: an 8 TiB allocation) gives a
    RemoteError with the remote traceback; consumers fail with the same cause."""
    import jax.numpy as jnp
    huge = zp.pmap(lambda x: jnp.broadcast_to(x, (1 << 40,)), devices=devices(1))
    after = zp.pmap(lambda x: x[:3] + 1, devices=huge.mesh.devices.flat)
    bad = huge(np.ones(1))
    downstream = after(bad)
    with pytest.raises(zp.RemoteError) as info:
        bad.result(timeout=60)
    err = info.value
    assert "RESOURCE_EXHAUSTED" in str(err) and err.host is not None
    assert "Traceback" in err.remote_traceback and err.computation == "<lambda>"
    with pytest.raises(zp.RemoteError, match="RESOURCE_EXHAUSTED"):
        downstream.result(timeout=60)
    # a value computed from a failed future in a later call also fails, same cause
    with pytest.raises(zp.RemoteError, match="RESOURCE_EXHAUSTED"):
        after(bad).result(timeout=60)
    # and the cluster keeps working
    ok = zp.pmap(lambda x: x + 1, devices=devices(1))
    np.testing.assert_array_equal(np.asarray(ok(np.zeros(1))), [1.])


def test_fetch_has_a_deadline(client):
    slow = zp.pmap(lambda x: x @ x @ x @ x @ x @ x, devices=devices(1))
    fut = slow(np.ones((1, 1500, 1500)))
    with pytest.raises(zp.DeadlineExceeded, match="not fetched within"):
        fut.result(timeout=0.001)
    for bad in ("1", -1, 0, True, float("inf"), 1e12):     # refused before anything is asked
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            fut.result(timeout=bad)
    assert fut.result(timeout=np.int64(120)).shape == (1, 1500, 1500)


def test_a_fetched_value_is_read_only(client):
    """Every result() returns the one value fetched: it cannot be changed in
    place (as with JAX's np.asarray(array)); np.array() gives a copy that can."""
    fut = zp.pmap(lambda x: x + 1., devices=devices(1))(np.ones(1))
    r = fut.result(timeout=60)
    with pytest.raises(ValueError, match="read-only"):
        r[0] = 99.
    mine = np.array(fut)
    mine[0] = 99.
    np.testing.assert_array_equal(np.asarray(fut), [2.])


def test_sizes_must_be_whole_numbers(client):
    for bad in (1.5, "1", True, 0):
        with pytest.raises(ValueError, match="devices must be a whole number >= 1"):
            zp.make_virtual_device_set().add_slice(devices=bad)
    with pytest.raises(ValueError, match="island must be a whole number >= 0"):
        zp.make_virtual_device_set().add_slice(devices=1, island="0")


def test_bad_requests_get_clear_errors(client):
    with pytest.raises(zp.ResourceError, match="no host has 64 devices"):
        devices(64)
    with pytest.raises(zp.ResourceError, match="no live host on island 7"):
        devices(1, island=7)


def test_malformed_messages_do_not_stop_the_cluster(cluster, client):
    """Garbage, unsigned, wrongly signed and unknown messages to the controller
    and a worker's data port are rejected with an error reply; both keep serving."""
    import zmq

    from zpath.net import codec
    from zpath.net import messages as m
    inc = zp.pmap(lambda x: x + 1, devices=devices(1))
    ctx = zmq.Context()
    try:
        targets = [cluster.address] + [h.data_address for h in client.hosts.values()]
        for addr in targets:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            good = codec.encode(cluster.key, m.Ping(1), msg_id=7, sender="fuzz")
            bad_frames = [
                [b"garbage"],
                [os.urandom(32), b"\x01", b"\x02"],
                codec.encode(os.urandom(32), m.Ping(1), msg_id=7, sender="fuzz"),
                good[:2] + [b"\xc1"],
                [codec._sign(cluster.key, [good[1].replace(b"\x07", b"\x7f"), good[2]]),
                 good[1].replace(b"\x07", b"\x7f"), good[2]],
            ]
            for frames in bad_frames:
                s.send_multipart(frames)
            replies = 0
            while s.poll(2000):
                frames = s.recv_multipart()
                _, msg, _ = codec.decode(cluster.key, frames)
                assert isinstance(msg, m.Error) and msg.code in ("protocol", "not_registered", "bad_request")
                replies += 1
            assert replies >= 3
            s.close()
            x = inc(np.zeros(1))
            np.testing.assert_array_equal(np.asarray(x), [1.])
    finally:
        ctx.term()


def test_stacks_of_a_running_cluster_name_every_process_and_thread(cluster, client):
    """LocalCluster.stacks (what a hung test prints): every process's threads,
    the workers' executor thread among them, and the cluster keeps serving."""
    out = cluster.stacks()
    for name, p in cluster.procs:
        assert f"---- {name} (pid {p.pid})" in out, out[-3000:]
    parts = out.split("---- ")[1:]
    assert len(parts) == len(cluster.procs)
    for part in parts:
        assert "hread 0x" in part and "(most recent call first)" in part, part[-2000:]
    workers = [part for part in parts if part.startswith("worker")]
    assert workers and all("_loop" in part for part in workers), out[-3000:]
    x = zp.pmap(lambda v: v + 1, devices=devices(1))(np.zeros(1))
    np.testing.assert_array_equal(np.asarray(x), [1.])


def test_connect_via_environment_and_two_clients(cluster, monkeypatch):
    monkeypatch.setenv("ZPATH_CONTROLLER", cluster.address)
    monkeypatch.setenv("ZPATH_KEY", cluster.key.hex())
    conn = zp.init()  # connects instead of starting a cluster
    try:
        assert conn.local is None and conn.address == cluster.address
        f = zp.pmap(lambda x: x * 4, devices=devices(2))
        code = ("import numpy as np, zpath as zp\n"
                f"zp.connect({cluster.address!r})\n"
                "d = zp.make_virtual_device_set().add_slice(devices=2).devices\n"
                "print(np.asarray(zp.pmap(lambda x: x - 1, devices=d)(np.ones(2))).tolist())\n"
                "zp.shutdown()\n")
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=120, env=os.environ.copy())
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip() == "[0.0, 0.0]"
        np.testing.assert_array_equal(np.asarray(f(np.ones(2))), [4., 4.])
    finally:
        zp.shutdown()


SECOND_PROCESS = """
import sys, numpy as np, zpath as zp
for address in (sys.argv[1], None):    # by address, then the newest local cluster
    c = zp.connect(address)
    assert c.address == sys.argv[1], c.address
    d = zp.make_virtual_device_set().add_slice(devices=2).devices
    print(np.asarray(zp.pmap(lambda x: x - 1, devices=d)(np.ones(2))).tolist())
    zp.shutdown()
"""


def test_a_second_process_of_the_user_connects_without_a_key(cluster, tmp_path):
    """zp.connect(address) and zp.connect() in another process find the key in
    the cluster's connection file; a stale file of a dead cluster, newer, is
    ignored."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    shutil.copy(cluster.connection_file, run)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(20)
    stale = run / f"cluster-{dead.pid}.json"
    fd = os.open(stale, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "key": cluster.key.hex(), "pid": dead.pid,
                   "create_time": time.time(), "started": time.time() + 10}, f)
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZPATH_KEY", "ZPATH_KEY_FILE", "ZPATH_CONTROLLER")}
    env["ZPATH_RUNTIME_DIR"] = str(run)
    other = subprocess.run([sys.executable, "-c", SECOND_PROCESS, cluster.address], capture_output=True,
                           text=True, timeout=120, env=env)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split("\n")[:2] == ["[0.0, 0.0]", "[0.0, 0.0]"]
    assert not stale.exists()
    # `zpath status` with no address and no state file: the newest local cluster
    status = subprocess.run([sys.executable, "-m", "zpath", "status"], capture_output=True, text=True,
                            timeout=60, env=dict(env, HOME=str(tmp_path)))
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"controller {cluster.address}: 2 host(s)"), status.stdout


def test_init_and_shutdown_leave_no_process(tmp_path):
    cache = tmp_path / "compile-cache"
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    conn = zp.init(islands=1, hosts_per_island=2, devices_per_host=1,
                   env={"ZPATH_COMPILE_CACHE": str(cache)})
    pids = conn.local.pids
    conn_file = conn.local.connection_file
    try:
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
        # they share this machine's GPUs: memory as needed, unless told otherwise
        workers = [p for p in pids if "zpath.worker" in psutil.Process(p).cmdline()]
        assert len(workers) == 2
        assert all(psutil.Process(p).environ().get("XLA_PYTHON_CLIENT_PREALLOCATE") == preallocate
                   for p in workers)
        assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == preallocate
        # how another process of this user finds it (tests/test_connfile.py)
        assert os.path.dirname(conn_file) == connfile.runtime_dir(ClusterConfig.from_env().runtime_dir)
        assert stat.S_IMODE(os.stat(conn_file).st_mode) == 0o600
        assert connfile.find(os.path.dirname(conn_file), conn.address).key == conn.key.hex()
        d0, d1 = devices(1, host=0), devices(1, host=1)
        x = zp.pmap(lambda v: v + 1, devices=d0)(np.ones(1))
        np.testing.assert_array_equal(np.asarray(zp.pmap(lambda v: v * 2, devices=d1)(x)), [4.])
        # the workers' compilation cache (JAX process 0 of the island writes it)
        assert len(os.listdir(cache)) >= 1
    finally:
        zp.shutdown()
    assert_gone(pids)
    assert not os.path.exists(conn.local.dir)
    assert not os.path.exists(conn_file)
    with pytest.raises(zp.Closed):
        zp.make_virtual_device_set()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
def test_zpath_up_cli_runs_and_stops_on_a_signal(tmp_path, sig, code):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ZPATH_KEY", None)
    env.pop("ZPATH_KEY_FILE", None)
    env.pop("ZPATH_CONTROLLER", None)
    port = free_port("127.0.0.1")
    state = tmp_path / "state.json"
    proxy = sig == signal.SIGTERM        # once with --ifrt-proxy: it stops with the cluster
    p = subprocess.Popen([sys.executable, "-m", "zpath", "up", "--islands", "1", "--devices-per-host", "1",
                          "--log-dir", str(tmp_path), "--state", str(state), "--controller-port", str(port)]
                         + (["--ifrt-proxy", "0"] if proxy else []),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = served = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and address is None:
            line = p.stdout.readline()
            if not line:
                break
            if line.startswith("IFRT proxy:"):
                served = line.split("JAX_BACKEND_TARGET=", 1)[1].split()[0]
            if line.startswith("zpath cluster up:"):
                address = line.split(":", 1)[1].strip()
        assert address, p.stderr.read()
        assert address == f"tcp://127.0.0.1:{port}"          # --controller-port is used
        # the proxy serves loopback only when given a port alone
        assert (served is not None and served.startswith("grpc://127.0.0.1:")) == proxy, served
        children = psutil.Process(p.pid).children(recursive=True)
        assert len(children) == 2 + proxy
        status = subprocess.run([sys.executable, "-m", "zpath", "status", address], capture_output=True,
                                text=True, timeout=60,
                                env=dict(env, ZPATH_KEY_FILE=str(tmp_path / "cluster.key")))
        assert status.returncode == 0, status.stderr
        assert "1 host(s)" in status.stdout and "island 0 host 0" in status.stdout
        # no address and no key: both come from the state file
        status = subprocess.run([sys.executable, "-m", "zpath", "status", "--state", str(state)],
                                capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr
        assert f"controller {address}: 1 host(s)" in status.stdout
        p.send_signal(sig)
        assert p.wait(30) == code
        assert_gone([c.pid for c in children])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()


def test_workers_exit_when_the_controller_dies(tmp_path):
    """No orphans: killing the controller makes the workers exit (once they
    have heard nothing from it for ZPATH_CONTROLLER_TIMEOUT, here 3 s)."""
    c = LocalCluster(islands=1, hosts_per_island=1, devices_per_host=1, log_dir=str(tmp_path),
                     env={"ZPATH_CONTROLLER_TIMEOUT": "3"})
    try:
        (_, ctl), (name, worker) = c.procs
        assert worker.poll() is None
        ctl.kill()
        worker.wait(40)
        with open(tmp_path / f"{name}.log") as f:
            assert "no word from the controller for 3s: exiting" in f.read()
    finally:
        pids = c.pids
        c.stop()
        assert_gone(pids)


def run_script(script: str) -> subprocess.CompletedProcess:
    """``python -c script`` that starts its own local cluster (not one named
    by ZPATH_CONTROLLER), logs not kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZPATH_CONTROLLER", "ZPATH_KEEP_LOGS")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_script_that_never_calls_shutdown_leaves_nothing(tmp_path):
    """zp.init() in a script that ends with an uncaught exception: its
    processes stop and its temporary directory (logs, the cluster key) goes."""
    script = ("import zpath as zp, sys\n"
              "c = zp.init(islands=1, hosts_per_island=1, devices_per_host=1)\n"
              "print(c.local.dir, *c.local.pids, flush=True)\n"
              "raise RuntimeError('the script fails')\n")
    r = run_script(script)
    assert r.returncode == 1 and "the script fails" in r.stderr, r.stderr
    where, *pids = r.stdout.split()
    assert_gone([int(p) for p in pids])
    assert not os.path.exists(where)


def test_a_forked_child_that_exits_leaves_the_parents_cluster_alone():
    """The exit hook that stops a zp.init() cluster runs only in the process
    that started it, not in a child it forked."""
    script = ("import os, numpy as np, zpath as zp\n"
              "c = zp.init(islands=1, hosts_per_island=1, devices_per_host=1)\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    raise SystemExit(0)\n"
              "os.waitpid(pid, 0)\n"
              "d = zp.make_virtual_device_set().add_slice(devices=1).devices\n"
              "y = zp.pmap(lambda x: x + 1, devices=d)(np.ones(1)).result(timeout=60)\n"
              "print(os.path.exists(c.local.key_file), y[0])\n")
    r = run_script(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "2.0"], r.stdout


def test_a_cluster_started_by_a_forked_child_is_stopped_when_the_child_exits():
    """A child forked after its parent's cluster was shut down starts its own
    with zp.init() and ends without zp.shutdown(): its own exit hook stops it."""
    script = ("import os, zpath as zp\n"
              "zp.init(islands=1, hosts_per_island=1, devices_per_host=1)\n"
              "zp.shutdown()\n"
              "r, w = os.pipe()\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    c = zp.init(islands=1, hosts_per_island=1, devices_per_host=1)\n"
              "    os.write(w, ' '.join([c.local.dir, *map(str, c.local.pids)]).encode())\n"
              "    raise SystemExit(0)\n"
              "os.close(w)\n"
              "os.waitpid(pid, 0)\n"
              "print(os.read(r, 4096).decode())\n")
    r = run_script(script)
    assert r.returncode == 0, r.stderr[-3000:]
    where, *pids = r.stdout.split()
    assert_gone([int(p) for p in pids])
    assert not os.path.exists(where)


def test_a_failed_start_says_where_its_logs_are(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(zp.ZpathError, match="cannot listen on") as e:
            LocalCluster(islands=1, hosts_per_island=1, devices_per_host=1, controller_port=port)
    where = str(e.value).rsplit("(logs in ", 1)[1].rstrip(")")
    assert os.path.isfile(os.path.join(where, "controller.log"))
    import shutil
    shutil.rmtree(where)


def test_zpath_down_removes_only_a_directory_zpath_up_made(tmp_path):
    from zpath.cluster import state as cluster_state
    mine = tmp_path / "my-logs"
    mine.mkdir()
    (mine / "cluster.key").write_text("00")
    path = tmp_path / "state.json"
    cluster_state.write_state(str(path), {"address": "tcp://127.0.0.1:1", "log_dir": str(mine),
                                          "own_log_dir": True, "launcher_pid": 0, "procs": []})
    assert "kept its log directory" in cluster_state.down(str(path))[-1]
    assert mine.is_dir() and not path.exists()


def _flock_held(path: str, pid: int) -> bool:
    """Whether process ``pid`` holds a flock on ``path`` (Linux: /proc/locks)."""
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()       # 1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END
            if fields[1] == "FLOCK" and int(fields[4]) == pid and int(fields[5].rsplit(":", 1)[1]) == inode:
                return True
    return False


def test_zpath_up_outlives_a_lost_worker_and_refuses_a_second_up(tmp_path):
    """`zpath up` keeps the cluster up when a worker dies (its host is lost,
    the rest serves); a second `zpath up` with the same state file is refused
    even while the first is still starting; after the first is killed,
    `zpath status` says it is not running and `zpath down` removes its
    temporary directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPATH_")}
    env.update(PYTHONUNBUFFERED="1", ZPATH_HOST_TIMEOUT="3")
    state = tmp_path / "state.json"
    up = [sys.executable, "-m", "zpath", "up", "--islands", "2", "--devices-per-host", "1",
          "--state", str(state)]
    p = subprocess.Popen(up, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    children: list = []
    log_dir = None
    try:
        # the first one takes the lock (it makes the file, then locks it)
        wait_until(lambda: p.poll() is not None or _flock_held(str(state) + ".lock", p.pid), 60,
                   interval=0.02, what="the first `zpath up` holding the state file's lock")
        assert p.poll() is None, p.stderr.read()
        second = subprocess.run(up, capture_output=True, text=True, timeout=60, env=env)
        assert second.returncode == 1 and "another `zpath up` is running" in second.stderr, second.stderr
        address = None
        while address is None:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if line.startswith("zpath cluster up:"):
                address = line.split(":", 1)[1].strip()
        children = psutil.Process(p.pid).children(recursive=True)
        victim = next(c for c in children if "--island" in c.cmdline() and
                      c.cmdline()[c.cmdline().index("--island") + 1] == "1")
        victim.kill()

        def status() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "zpath", "status", "--state", str(state)],
                                  capture_output=True, text=True, timeout=60, env=env)
        deadline = time.monotonic() + 30
        while "LOST" not in (st := status()).stdout:      # (each try takes a while: a poll)
            assert time.monotonic() < deadline, st.stdout + st.stderr
        lines = st.stdout.splitlines()      # (ranks follow the order the workers registered in)
        assert st.returncode == 0 and "1 host(s)" in lines[0], st.stdout
        assert any(ln.strip().startswith("island 0 host") and "LOST" not in ln for ln in lines), st.stdout
        assert any(ln.strip().startswith("island 1 host") and ln.endswith("LOST") for ln in lines), st.stdout
        assert p.poll() is None
        log_dir = json_state(state)["log_dir"]
        p.kill()                  # as if it crashed: no clean stop
        p.wait(10)
        assert_gone([c.pid for c in children], timeout=30)
        st = status()
        assert st.returncode == 1 and "is not running" in st.stderr, st.stderr
        down = subprocess.run([sys.executable, "-m", "zpath", "down", "--state", str(state)],
                              capture_output=True, text=True, timeout=60, env=env)
        assert down.returncode == 0 and "removed its log directory" in down.stdout, down.stdout
        assert not os.path.exists(log_dir) and not state.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for c in children:
            if c.is_running():
                c.kill()
        p.stdout.close()
        p.stderr.close()
        if log_dir and os.path.isdir(log_dir):       # the test failed before `zpath down`
            import shutil
            shutil.rmtree(log_dir)


def json_state(path) -> dict:
    import json
    with open(path) as f:
        return json.load(f)


def test_a_worker_stopped_while_registering_exits_cleanly():
    """SIGTERM while a worker waits for the controller's answer to its
    registration: it stops at once with exit code 0, not after the
    registration timeout with an error that the controller did not answer."""
    import zmq
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)         # takes the registration, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPATH_")}
    env["ZPATH_KEY"] = "00112233445566778899aabbccddeeff"
    p = subprocess.Popen([sys.executable, "-m", "zpath.worker", "--controller", f"tcp://127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert silent.poll(60_000), "the worker never tried to register"
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0, p.stderr.read()
        assert time.monotonic() - t < 10
        assert "did not answer" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
        silent.close(0)
        ctx.term()


def test_local_workers_allocate_gpu_memory_as_needed_unless_told_otherwise():
    """A local cluster's workers share the machine's GPUs: JAX's default (75%
    of a GPU's memory taken by each process at its start) would leave the
    second none, so they allocate as needed, unless the environment says."""
    env = launcher.local_worker_env({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true "
                                     "--xla_force_host_platform_device_count=8"}, 2)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=2"
    env = launcher.local_worker_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "A": "b"}, 1)
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "A": "b",
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def test_a_port_to_listen_on_later_is_free_and_below_the_range_of_outgoing_connections(monkeypatch):
    """listen_port: free, below ip_local_port_range (no connection made
    meanwhile is given it), at random; a taken one is passed over; with no
    room below that range, any free port."""
    import random

    low = launcher._outgoing_ports_low()
    ports = {launcher.listen_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1 and all(launcher.LISTEN_PORT_MIN <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))       # (free: nothing was left bound)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    first = taken.getsockname()[1]
    second = launcher.free_port("127.0.0.1")
    picks = iter([first, second])

    class Rng(random.Random):
        def randrange(self, a, b):
            return next(picks)

    try:
        monkeypatch.setattr(launcher, "_outgoing_ports_low", lambda: 65536)
        assert launcher.listen_port("127.0.0.1", Rng()) == second
    finally:
        taken.close()
    monkeypatch.setattr(launcher, "_outgoing_ports_low", lambda: launcher.LISTEN_PORT_MIN)
    assert launcher.listen_port("127.0.0.1") > 0


def test_a_controller_port_taken_before_it_listens_is_chosen_again(monkeypatch):
    """The launcher starts the workers while the controller starts, at a port
    free when chosen; if another process takes it first, the launch starts
    again (here on a port the controller picks itself)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = iter([port])
    monkeypatch.setattr(launcher, "_free_port_or_zero", lambda host: next(ports, 0))
    try:
        with SimulatedCluster(1, devices_per_host=1) as c:
            pids = c.pids
            assert c.address.startswith("tcp://127.0.0.1:") and not c.address.endswith(f":{port}")
            assert "cannot listen" in c.log_tail("controller")
            with connected(c):
                assert len(zp.make_virtual_device_set().add_slice(devices=1).devices) == 1
    finally:
        taken.close()
    assert_gone(pids)


def test_small_leaves_a_computation_reads_from_another_island_cross_as_one_message(client, cluster):
    """Forty small leaves made on island 0 and read by one computation on
    island 1 cross the DCN as one message (a bucket), not one per leaf."""
    d0, d1 = devices(1, island=0), devices(1, island=1)
    make = zp.pmap(lambda x: [x * k for k in range(40)], devices=d0)
    total = zp.pmap(lambda leaves: sum(leaves), devices=d1)
    leaves = make(np.ones((1, 8), np.float32))
    channel_stats(cluster, reset=True)
    np.testing.assert_allclose(np.asarray(total(leaves)), np.full((1, 8), float(sum(range(40)))))
    stats = channel_stats(cluster)
    sent, got = stats[d0[0].host], stats[d1[0].host]
    assert (sent.sent_dcn, sent.bytes_dcn, got.recv_tcp) == (1, 40 * 8 * 4, 1)
    assert sorted(p.nbytes for p in sent.sent) == [32] * 40
