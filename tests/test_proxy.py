"""The IFRT proxy (zpath/proxy/): unmodified JAX, with JAX_PLATFORMS=proxy, on
a zpath cluster. The server runs in this process on a cluster of the module; the
JAX clients are subprocesses."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import types

import grpc
import jax
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zpath as zp
from tests.test_channels import channel_stats
from zpath.client.connection import Client
from zpath.client.futures import Future
from zpath.cluster.testing import assert_gone, running_cluster, wait_until
from zpath.net import messages as m
from zpath.proxy import backend, launch, programs, schema
from zpath.proxy.launch import is_loopback
from zpath.proxy.server import PROTOCOL_MAX, ProxyServer, cluster_platform

pytestmark = pytest.mark.timeout(120)

CLIENT = textwrap.dedent('''
    import gc, json, sys
    import zpath.proxy
    zpath.proxy.initialize()
    import jax, jax.numpy as jnp, numpy as np
    out = {"devices": [d.id for d in jax.devices()], "platform": jax.devices()[0].platform}
    x = jnp.asarray(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    y, s = jax.jit(lambda a, b: (jnp.sin(a) * b, a.sum()))(x, np.float32(2))
    out["y"], out["s"] = np.asarray(y).tolist(), float(s)
    z = jax.device_put(np.arange(3, dtype=np.int32), jax.devices()[-1])
    w = jax.jit(lambda t: t * 3)(z)
    out["w"], out["w_devices"] = np.asarray(w).tolist(), [d.id for d in w.devices()]
    out["x_again"] = np.asarray(x).tolist()           # an input stays readable
    # SPMD over the devices of two hosts of one island: NamedSharding, collectives, pmap
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    a = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    sa = jax.device_put(a, NamedSharding(mesh, P("x", "y")))
    sy, ss = jax.jit(lambda t: (t * 2, jnp.sum(t, axis=0)),
                     out_shardings=(NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P("y"))))(sa)
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x", "y"),
                                 out_specs=P(None, "y")))(sa)
    pm = jax.pmap(lambda t: jax.lax.psum(t, "i") * t, axis_name="i", devices=jax.devices())(a[:, :2])
    out["spmd"] = [np.asarray(v).tolist() for v in (sy, ss, psum, pm)] + [str(sy.sharding.spec)]
    del sa, sy, ss, psum, pm
    # the paper's Figure 2 with plain jax.pmap: values move between the two hosts' devices
    d = jax.devices()
    fa = jax.pmap(lambda v: v * 2., devices=d[0:2])
    fb = jax.pmap(lambda v: v + 1., devices=d[2:4])
    fc = jax.pmap(lambda v: v / 2., devices=d[2:4])
    fx = fa(np.array([1., 2.], np.float32))
    fy, fz = fb(fx), fa(fc(fx))
    out["figure2"] = [np.asarray(fy).tolist(), np.asarray(fz).tolist(), sorted(v.id for v in fy.devices())]
    moved = jax.device_put(fx, jax.sharding.NamedSharding(Mesh(np.array(d[2:4]), ("i",)), P("i")))
    out["moved"] = [np.asarray(moved).tolist(), sorted(v.id for v in moved.devices())]
    del fx, fy, fz, moved
    try:
        jax.jit(jnp.sin).lower(x).compile().cost_analysis()
        out["unsupported"] = None
    except Exception as e:
        out["unsupported"] = f"{type(e).__name__}: {e}"
    del x, y, s, z, w
    gc.collect()
    print("RESULT " + json.dumps(out), flush=True)
    if len(sys.argv) > 1:          # hold values on the cluster until killed
        keep = [jnp.asarray(np.full(1000, i, np.float32)) * 2 for i in range(3)]
        print("HOLDING " + json.dumps([float(k[0]) for k in keep]), flush=True)
        sys.stdin.read()
''')


@pytest.fixture(scope="module")
def cluster():
    """One island of two hosts of two devices: SPMD over hosts."""
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=2) as c:
        yield c


@pytest.fixture(scope="module")
def proxy(cluster):
    """The IFRT proxy process, started for the module's cluster as `zpath up
    --ifrt-proxy` and zp.init(ifrt_proxy=) start it, and stopped by pid."""
    yield from _serve(cluster)


def _serve(cluster):
    served = launch.start_proxy(cluster, "127.0.0.1:0")
    (name, p), = [(n, q) for n, q in cluster.procs if n == launch.PROCESS_NAME]
    status = Client(cluster.address, cluster.key, name="ifrt-proxy-test")
    try:
        yield Proxy(served, p, status)
    finally:
        status.close()
        cluster.procs.remove((name, p))
        _stop(p)


@dataclasses.dataclass
class Proxy:
    address: str
    process: subprocess.Popen
    client: Client          # for the controller's status


def _env(server: Proxy) -> dict[str, str]:
    # no IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS: zpath.proxy.initialize() sets it
    env = dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{server.address}")
    env.pop("IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS", None)
    return env


def _start_client(server: Proxy, *argv: str, script: str = CLIENT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *argv], env=_env(server), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stop(p: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM (to its process group when ``group``), then SIGKILL."""
    kill = (lambda sig: os.killpg(p.pid, sig)) if group else p.send_signal
    if p.poll() is None:
        kill(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            kill(signal.SIGKILL)
            p.wait(10)


def _line(p: subprocess.Popen, tag: str) -> str:
    """The next line of the client's output that starts with ``tag`` (its
    output so far when it ends without one)."""
    seen = []
    for line in p.stdout:
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]
        seen.append(line)
    _stop(p, group=True)
    pytest.fail(f"the JAX client ended without {tag}:\n{''.join(seen)}\n{p.stderr.read()[-4000:]}")


def _held(client: Client) -> tuple[int, int]:
    st = client.request(m.StatusRequest(False))
    return st.buffers, sum(s.shards for s in st.stores)


def test_unmodified_jax_runs_on_the_cluster_and_a_dropped_client_is_freed(proxy):
    before = _held(proxy.client)
    p = _start_client(proxy, "hold")
    try:
        out = json.loads(_line(p, "RESULT"))
        devices = sorted(proxy.client.devices)
        assert out["devices"] == devices and out["platform"] == "cpu"
        x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
        np.testing.assert_allclose(out["y"], np.sin(x) * 2, rtol=1e-6)
        assert out["s"] == 15.0 and out["x_again"] == x.tolist()
        assert out["w"] == [0, 3, 6] and out["w_devices"] == [devices[-1]]
        # what the server does not do comes back to the user as an error naming it
        assert "UNIMPLEMENTED" in out["unsupported"] and "cost_analysis" in out["unsupported"]
        a = np.arange(16.0, dtype=np.float32).reshape(4, 4)
        sy, ss, psum, pm, spec = out["spmd"]
        assert sy == (a * 2).tolist() and ss == a.sum(0).tolist() and spec == "P('x', 'y')"
        assert psum == (a[:2] + a[2:]).tolist() and pm == (a[:, :2].sum(0) * a[:, :2]).tolist()
        assert out["figure2"] == [[3.0, 5.0], [2.0, 4.0], devices[2:4]]
        assert out["moved"] == [[2.0, 4.0], devices[2:4]]
        assert json.loads(_line(p, "HOLDING")) == [0.0, 2.0, 4.0]
        # the arrays the client dropped are freed: only the three results it
        # keeps are on the workers (their inputs, put there, were dropped too)
        wait_until(lambda: _held(proxy.client)[0] == before[0] + 3, timeout=30,
                   what="only the kept arrays on the cluster")
        os.killpg(p.pid, signal.SIGKILL)          # the client dies without a word
        p.wait(10)
        wait_until(lambda: _held(proxy.client) == before, timeout=30, what="its buffers freed")
        assert proxy.process.poll() is None       # the server goes on
    finally:
        _stop(p, group=True)
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()


BETWEEN_ISLANDS = textwrap.dedent('''
    import json, sys
    import zpath.proxy
    zpath.proxy.initialize()
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    first, second = json.loads(sys.argv[1])
    by_id = {d.id: d for d in jax.devices()}
    on = lambda ids: NamedSharding(Mesh(np.array([by_id[i] for i in ids]), ("i",)), P("i"))
    a = np.arange(1 << 16, dtype=np.float32).reshape(2, -1)
    # computed on the first island (a value only put there stays in the proxy
    # until a computation needs it), then put on the second
    x = jax.jit(lambda t: t * 2, out_shardings=on(first))(jax.device_put(a, on(first)))
    y = jax.device_put(x, on(second))
    z = jax.jit(lambda t: t + 1)(y)                    # computed where it landed
    print("RESULT " + json.dumps([np.asarray(y).sum().item(), np.asarray(z)[:, :3].tolist(),
                                  sorted(d.id for d in y.devices())]), flush=True)
''')


def test_device_put_between_islands_goes_worker_to_worker_over_dcn(monkeypatch):
    """Milestone 3 between islands: jax.device_put to another island's devices
    moves the shards from the first island's workers to the second's over DCN
    (their channel counters show it), not through the proxy. The cluster and
    its proxy come from zp.init(ifrt_proxy=PORT), and zp.shutdown() stops both."""
    monkeypatch.delenv("ZPATH_CONTROLLER", raising=False)
    cluster = zp.init(islands=2, hosts_per_island=1, devices_per_host=2, ifrt_proxy="0")
    local = cluster.local
    pids = local.pids
    try:
        assert cluster.ifrt_proxy.startswith("127.0.0.1:")
        assert [n for n, _ in local.procs].count(launch.PROCESS_NAME) == 1
        devices = cluster.client.devices
        islands: dict[int, list[int]] = {}
        for d in sorted(devices.values(), key=lambda d: d.id):
            islands.setdefault(d.island, []).append(d.id)
        first, second = islands.values()
        host_of = {d.id: d.host for d in devices.values()}
        channel_stats(local, reset=True)
        p = _start_client(Proxy(cluster.ifrt_proxy, None, cluster.client), json.dumps([first, second]),
                          script=BETWEEN_ISLANDS)
        try:
            total, head, placed = json.loads(_line(p, "RESULT"))
        finally:
            _stop(p, group=True)
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
        a = np.arange(1 << 16, dtype=np.float32).reshape(2, -1)
        assert total == float(a.sum() * 2) and head == (a[:, :3] * 2 + 1).tolist() and placed == second
        stats = channel_stats(local)
        sender, receiver = stats[host_of[first[0]]], stats[host_of[second[0]]]
        # both halves (128 KiB each) left the first island's worker over DCN,
        # addressed to the second island's worker
        dcn = [piece for piece in sender.sent if piece.channel == "DCN"]
        assert sender.sent_dcn >= 1 and sender.bytes_dcn >= a.nbytes and len(dcn) >= 2
        assert {piece.dst_host for piece in dcn} == {host_of[second[0]]}
        assert receiver.sent_dcn == 0 and receiver.recv_tcp >= 1
    finally:
        zp.shutdown()
    assert_gone(pids)                 # the proxy included


# ---- the pieces, without a cluster -------------------------------------------------

def test_descriptors_are_found_inside_other_bytes():
    fd = descriptor_pb2.FileDescriptorProto(name="a/b.proto", package="p", dependency=["c.proto"])
    fd.message_type.add(name="M").field.add(name="f", number=1, type=9, label=1)
    data = b"\x0a\x09a/b.proto junk" + fd.SerializeToString() + b"\xff\xff trailing bytes"
    assert schema.find_descriptor(data, "a/b.proto") == fd
    with pytest.raises(schema.SchemaError, match="x.proto"):
        schema.find_descriptor(data, "x.proto")


def test_the_installed_jaxlib_carries_the_service():
    s = schema.load()
    methods = {md.name for md in s.pool.FindServiceByName(schema.SERVICE_NAME).methods}
    assert {"GetVersion", "IfrtSession", "HostBufferStore", "HostBufferLookup", "HostBufferDelete"} <= methods
    assert "loaded_executable_execute_request" in s.IfrtRequest.DESCRIPTOR.fields_by_name


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, message):
        raise _Aborted(code, message)


def _version(server, lo: int, hi: int) -> int:
    req = server.s.GrpcGetVersionRequest()
    req.min_version.protocol_version, req.max_version.protocol_version = lo, hi
    req.max_version.ifrt_serdes_version_number = 3
    return server._get_version(req, _Context()).version.protocol_version


def test_version_negotiation():
    server = ProxyServer.__new__(ProxyServer)
    server.s = schema.load()
    assert _version(server, 16, PROTOCOL_MAX) == PROTOCOL_MAX
    assert _version(server, 16, PROTOCOL_MAX + 5) == PROTOCOL_MAX
    with pytest.raises(_Aborted) as e:
        _version(server, PROTOCOL_MAX + 1, PROTOCOL_MAX + 5)
    assert e.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION and "zpath serves" in e.value.args[1]


def test_serves_the_platform_the_workers_registered():
    def client(*platforms):
        return types.SimpleNamespace(devices={i: m.DeviceInfo(i, i, 0, 0, i, p) for i, p in enumerate(platforms)})
    assert cluster_platform(client("cuda", "cuda")) == "cuda"
    assert cluster_platform(client("sim", "sim")) == "cpu" and cluster_platform(client()) == "cpu"
    with pytest.raises(OSError, match=r"platforms \['cpu', 'cuda'\]: say which one"):
        cluster_platform(client("cpu", "cuda"))


class _FakeClient:
    devices = {i: m.DeviceInfo(i, i // 2, 0, i % 2, i, "cpu") for i in range(4)}

    def __init__(self):
        self.posted, self.registered = [], []
        self.ids = iter(range(100, 200))

    def new_buffer_id(self):
        return next(self.ids)

    new_call_id = new_buffer_id

    def post(self, msg):
        self.posted.append(msg)

    def register_program(self, digest, name, blob):
        self.registered.append(name)

    def track(self, fut):
        pass

    def release(self, buffer):
        pass


def _answer(session, **request):
    s = session.s
    req = s.IfrtRequest(**request)
    req.request_metadata.op_id = 7
    got = []
    session.handle(req, got.append)
    wait_until(lambda: got, timeout=10, what="an answer")
    assert got[0].response_metadata.op_id == 7
    return got[0]


def test_a_request_the_server_does_not_do_is_answered_naming_it():
    s = schema.load()
    session = backend.Session(1, s, _FakeClient(), "cpu", None)
    resp = _answer(session, remap_arrays_request=s.RemapArraysRequest())
    assert resp.response_metadata.status.code == backend.UNIMPLEMENTED
    assert "remap_arrays_request" in resp.response_metadata.status.message
    resp = _answer(session, copy_to_host_buffer_request=s.CopyToHostBufferRequest(array_handle=5))
    assert resp.response_metadata.status.code == backend.NOT_FOUND
    session.close()


def test_a_jax_program_becomes_an_export_artifact():
    lowered = jax.jit(lambda a, b: (a * b, a.astype(np.int32))).lower(np.ones((2, 3), np.float32), np.float32(2))
    prog = programs.from_hlo_program(lowered.as_text().encode(), "cpu")
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    assert prog.in_avals == [((2, 3), f32), ((), f32)]
    assert prog.out_avals == [((2, 3), f32), ((2, 3), i32)] and prog.num_partitions == 1
    exported = jax.export.deserialize(bytearray(prog.blob))
    got = exported.call(np.ones((2, 3), np.float32), np.float32(2))
    np.testing.assert_array_equal(got[0], np.full((2, 3), 2, np.float32))
    with pytest.raises(programs.UnsupportedProgram, match="neither"):
        programs.from_hlo_program(b"not a program", "cpu")



def test_an_spmd_program_keeps_its_mesh_and_specs():
    am = AbstractMesh((2, 2), ("x", "y"))
    f = jax.jit(lambda t: (t.sum(0), t * 2), out_shardings=(NamedSharding(am, P("y")), NamedSharding(am, P(("x", "y")))))
    arg = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=NamedSharding(am, P("x", "y")))
    prog = programs.from_hlo_program(jax.export.export(f)(arg).mlir_module().encode(), "cpu")
    assert prog.num_partitions == 4 and (prog.mesh_shape, prog.axis_names) == ([2, 2], ["x", "y"])
    assert prog.in_specs == [["x", "y"]] and prog.out_specs == [["y"], [["x", "y"], None]]


@pytest.mark.parametrize("layout", [
    backend.Layout([2, 2], ["x", "y"], [13, 11, 12, 10], ["y", "x"], [10, 11, 12, 13]),
    backend.Layout([2, 2], ["x", "y"], [10, 11, 12, 13], [["x", "y"], None], [10, 11, 12, 13]),
    backend.Layout([4], ["i"], [10, 11, 12, 13], [None, "i"], [10, 11, 12, 13]),
    backend.Layout([2, 2], ["x", "y"], [10, 11, 12, 13], ["y", None], [10, 11, 12, 13]),     # replicated over x
    backend.Layout([4], ["d"], [10, 11, 12, 13], [None, None], [10, 11, 12, 13]),
])
def test_a_layout_survives_an_op_sharding(layout):
    """What the server tells the client (an OpSharding) puts every block on the
    device the zpath layout puts it, and reading it back does too."""
    op = schema.load().message("xla.OpSharding")()
    backend.op_sharding_of(layout, 2, op)
    back = backend.op_sharding_layout(op, layout.ifrt_devices, 2)
    assert back.region_of((8, 8)) == layout.region_of((8, 8))


def test_an_iota_tile_assignment_is_read():
    op = schema.load().message("xla.OpSharding")(type=3, tile_assignment_dimensions=[2, 1, 2],
                                                  iota_reshape_dims=[2, 2], iota_transpose_perm=[1, 0],
                                                  replicate_on_last_tile_dim=True)
    got = backend.op_sharding_layout(op, [10, 11, 12, 13], 2).region_of((4, 6))
    # devices 0,2 hold rows 0:2 (iota transposed: tiles [[0, 2]], [[1, 3]])
    assert got == {10: ((0, 2), (0, 6)), 12: ((0, 2), (0, 6)), 11: ((2, 4), (0, 6)), 13: ((2, 4), (0, 6))}


def test_a_value_on_the_cluster_moves_worker_to_worker():
    """CopyArrays of a value on the workers is an identity computation on the
    new devices reading it where it is: the proxy never fetches it."""
    s = schema.load()
    fake = _FakeClient()
    session = backend.Session(1, s, fake, "cpu", None)
    src = backend.whole_on([0, 1], 1)
    fut = Future(fake, 7, (4,), np.dtype(np.float32), [0, 1], [2], ["d"], [None])
    session.arrays[1] = backend.Array((4,), np.dtype(np.float32), src, future=fut)
    resp = _answer(session, copy_arrays_request=s.CopyArraysRequest(array_handles=[1], device_ids=[2, 3],
                                                                     result_handles=[2]))
    assert resp.response_metadata.status.code == backend.OK, resp
    (call,) = fake.posted
    assert call.devices == [2, 3] and fake.registered == ["copy"]
    assert [(i.buffer, i.put) for i in call.inputs] == [(7, False)]
    moved = session.arrays[2]
    assert moved.devices == [2, 3] and moved.future.buffer == call.outputs[0].buffer and moved.host is None
    session.close()



# ---- security: loopback by default, sessions private to each other ------------------

def test_the_proxy_serves_loopback_unless_told_insecure():
    assert is_loopback("127.0.0.1:5000") and is_loopback("localhost:0") and is_loopback("[::1]:7")
    assert not is_loopback("0.0.0.0:5000") and not is_loopback(":5000") and not is_loopback("10.1.2.3:0")
    assert launch.listen_address("5000") == launch.listen_address(":5000") == "127.0.0.1:5000"
    assert launch.listen_address("0.0.0.0:1") == "0.0.0.0:1"
    with pytest.raises(ValueError, match="HOST:PORT"):
        launch.listen_address("host:port")
    for address in ("0.0.0.0:0", "[::]:0"):
        with pytest.raises(OSError, match="--ifrt-proxy-insecure"):
            ProxyServer(_FakeClient(), address)
    server = ProxyServer(_FakeClient(), "0.0.0.0:0", insecure=True)     # said explicitly: it listens
    assert server.port > 0
    server.stop(0)


def test_one_session_cannot_reach_another_sessions_arrays_or_buffers():
    """Array handles are per session; host buffers are reached by session id,
    which is random: guessing handles or ids finds nothing."""
    server = ProxyServer(_FakeClient(), "127.0.0.1:0")
    fake = _FakeClient()
    a, b = (backend.Session(server._new_session_id(), server.s, fake, "cpu", None) for _ in range(2))
    server.sessions.update({a.id: a, b.id: b})
    assert a.id != b.id and max(a.id, b.id) > 1 << 32     # not a counter one can walk
    fut = Future(fake, 7, (4,), np.dtype(np.float32), [0], [1], ["d"], [None])
    a.arrays[1] = backend.Array((4,), np.dtype(np.float32), backend.whole_on([0], 1), future=fut)
    a.buffers.store(9, b"secret")
    s = server.s
    for request in (dict(copy_to_host_buffer_request=s.CopyToHostBufferRequest(array_handle=1, host_buffer_handle=3)),
                    dict(copy_arrays_request=s.CopyArraysRequest(array_handles=[1], device_ids=[2], result_handles=[2]))):
        status = _answer(b, **request).response_metadata.status
        assert status.code == backend.NOT_FOUND and "unknown array handle 1" in status.message
    _answer(b, delete_array_request=s.DeleteArrayRequest(array_handle=[1]))   # its future holds the error
    assert a.arrays[1].future is fut and not a.arrays[1].deleted and 2 not in b.arrays and fake.posted == []
    b.buffers.timeout_s = 0.05
    with pytest.raises(backend.Failed):
        b.buffers.lookup(9)
    with pytest.raises(backend.Failed):
        b.buffers.delete(9)
    for sid in (1, 2, b.id + 1, a.id ^ 1):            # a guessed session id is refused
        with pytest.raises(_Aborted) as e:
            server._lookup(s.GrpcHostBufferLookupRequest(session_id=sid, handle=9), _Context()).__next__()
        assert e.value.args[0] == grpc.StatusCode.NOT_FOUND
    assert a.buffers.lookup(9) == b"secret"
    server.stop(0)
