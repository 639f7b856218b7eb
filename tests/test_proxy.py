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

import grpc
import jax
import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from zpath.client.connection import Client
from zpath.cluster.testing import wait_until
from zpath.net import messages as m
from zpath.proxy import backend, launch, programs, schema
from zpath.proxy.server import PROTOCOL_MAX, ProxyServer

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
def proxy(cluster):
    """The IFRT proxy process, started for the module's cluster as `zpath up
    --ifrt-proxy` and zp.init(ifrt_proxy=) start it, and stopped by pid."""
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
    return dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{server.address}",
                IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")


def _start_client(server: Proxy, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, *argv], env=_env(server), stdin=subprocess.PIPE,
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
        assert json.loads(_line(p, "HOLDING")) == [0.0, 2.0, 4.0]
        # the arrays the client dropped are freed: only the three results it
        # keeps are on the workers (its three inputs are still in the proxy)
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


class _FakeClient:
    devices = {0: m.DeviceInfo(0, 0, 0, 0, 0)}


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

