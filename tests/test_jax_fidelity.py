"""JAX fidelity (issue #22, items 1-6): values keep JAX's semantics (dtypes under
the caller's jax_enable_x64), futures and traced values are used as arrays,
zp.jit/zp.pmap take JAX's options, pytrees and typed keys go in and out.

The first part traces without a cluster (a connection that only records what it
would send); the second runs on the module's cluster (conftest.cluster)."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import types
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zpath as zp
from zpath.config import ClientConfig
from zpath.client import api, avals
from zpath.client.tracer import TracerBoolConversionError, Value
from zpath.net import messages as m
from zpath.worker.executor import donated_inputs

pytestmark = pytest.mark.timeout(180)
P = zp.P

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class State:
    w: Any
    step: Any


jax.tree_util.register_dataclass(State, data_fields=["w", "step"], meta_fields=[])


# ---- tracing, without a cluster ------------------------------------------------
class RecordingClient:
    """What a Computation needs of a connection; it records what it is sent."""

    config = ClientConfig()

    def __init__(self, devices: int = 2) -> None:
        self.devices = {d: m.DeviceInfo(d, 0, 0, d, d, "cpu") for d in range(devices)}
        self.sent: list = []
        self.programs: dict[str, bytes] = {}
        self.recorder = None
        self._ids = itertools.count(1)

    def new_buffer_id(self) -> int:
        return next(self._ids)

    def new_call_id(self) -> int:
        return next(self._ids)

    def register_program(self, digest: str, name: str, blob: bytes) -> None:
        self.programs[digest] = blob

    def post(self, msg: Any, buffers: Any = (), body: Any = None) -> None:
        self.sent.append(msg)

    def post_call(self, traced: Any, puts: tuple, call_id: int, inputs: list, outputs: list,
                  make: Any) -> Any:
        # (every call whole, no form kept: what these tests read of it)
        msg = make(0)
        self.post(msg)
        return msg

    def put(self, host: int, msg: Any, data: Any) -> None:
        self.sent.append(msg)

    def track(self, fut: Any) -> None:
        pass

    def release(self, buffer: int) -> None:
        self.sent.append(("release", buffer))

    def start_fetch(self, future: Any, timeout: float, wait_only: bool = False, every_shard: bool = False
                    ) -> Any:
        # (answered by the test, with future._fetched)
        fetch = types.SimpleNamespace(wait_only=wait_only, every_shard=wait_only or every_shard, relocated=False)
        self.sent.append(("fetch", future.buffer, fetch))
        return fetch


@pytest.fixture
def fake():
    client = RecordingClient()
    devs = [api.VirtualDevice(1, i, i, 0, 0, client) for i in range(2)]
    return client, devs


def calls(client: RecordingClient) -> list[m.Call]:
    return [x for x in client.sent if isinstance(x, m.Call)]


def test_traces_with_the_callers_x64_setting(fake):
    client, devs = fake
    f = zp.jit(lambda k, x, s: (jax.random.normal(k, (3,)), jnp.arange(3.), x * s, s + 1), devices=devs[:1])
    out = f(jax.random.PRNGKey(0), np.ones(2), 2.0)          # float64 numpy, a Python float
    assert [o.dtype for o in out] == [np.float32] * 4         # as plain JAX
    (call,) = calls(client)
    assert [i.aval.dtype for i in call.inputs] == ["uint32", "float32", "float32"]
    assert [type(x) for x in client.sent[:3]] == [m.Put] * 3 and client.sent[1].aval.dtype == "float32"
    # a Python scalar is weakly typed, as in JAX: it does not widen a bfloat16 array
    bf = zp.jit(lambda x, s: x * s, devices=devs)(np.ones(2, ml_dtypes.bfloat16), 2.0)
    assert bf.dtype == ml_dtypes.bfloat16
    with jax.enable_x64(True):                               # the caller's setting, per call
        out64 = f(jax.random.PRNGKey(0), np.ones(2), 2.0)
    assert [o.dtype for o in out64] == [np.float64] * 4
    assert len(f._cache) == 2


def test_exports_for_the_platform_of_its_devices():
    """A client with no accelerator drives workers that have one: it lowers
    each computation for its devices' platform, as their hosts registered it."""
    client = RecordingClient()
    cuda = [api.VirtualDevice(1, i, i, 0, 0, client, "cuda") for i in range(2)]
    zp.jit(lambda x: jnp.tanh(x) * 2, devices=cuda)(np.ones(4, np.float32))
    (blob,) = client.programs.values()
    assert jax.export.deserialize(bytearray(blob)).platforms == ("cuda",)
    # hosts that run no JAX (simulated ones): this process's own platform
    client = RecordingClient()
    sim = [api.VirtualDevice(1, i, i, 0, 0, client, "sim") for i in range(2)]
    zp.jit(lambda x: x + 1, devices=sim)(np.ones(4, np.float32))
    (blob,) = client.programs.values()
    assert jax.export.deserialize(bytearray(blob)).platforms == (jax.export.default_export_platform(),)
    mixed = [api.VirtualDevice(1, 0, 0, 0, 0, client, "cuda"), api.VirtualDevice(1, 1, 1, 1, 0, client, "cpu")]
    with pytest.raises(ValueError, match=r"mixes devices of platforms \['cpu', 'cuda'\]"):
        zp.jit(lambda x: x + 1, devices=mixed)(np.ones(4, np.float32))


def test_static_and_keyword_arguments(fake):
    client, devs = fake
    traces = []

    def scale(x, n, *, offset=0.0, mode="add"):
        traces.append(n)
        return jnp.ones(n) * x + (offset if mode == "add" else -offset)
    f = zp.jit(scale, devices=devs, static_argnums=1, static_argnames="mode")
    assert f(np.float32(2), 3, offset=1.0).shape == (3,)
    assert f(np.float32(3), 3, offset=2.0).shape == (3,)                 # same trace
    assert f(np.float32(3), 4, mode="sub").shape == (4,)                  # new static values: traced again
    assert traces == [3, 4]
    (first, *_), last = calls(client), calls(client)[-1]
    assert len(first.inputs) == 2 and len(last.inputs) == 1              # x, offset | x
    with pytest.raises(TypeError, match=r"scale: static argument 'n' must be hashable"):
        f(np.float32(1), [3])


def test_errors_name_the_function_and_the_argument(fake):
    _, devs = fake

    def ones_like_n(x, n):
        return jnp.ones(n) * x
    with pytest.raises(TypeError) as e:
        zp.jit(ones_like_n, devices=devs)(np.float32(1), 3)
    text = str(e.value)
    assert "ones_like_n: argument(s) 'n' are Python ints" in text and "static_argnums" in text
    assert "zpath/" not in text and "flat" not in text
    with pytest.raises(ValueError, match="static and donated"):
        zp.jit(ones_like_n, devices=devs, static_argnums=1, donate_argnums=1)


def test_pmap_in_axes_and_out_axes(fake):
    client, devs = fake
    f = zp.pmap(lambda x, y, t: (x + y, t.b), devices=devs, in_axes=(1, None, Pair(0, None)),
                out_axes=(0, None))
    out = f(np.ones((3, 2)), np.ones(3), Pair(np.ones((2, 5)), np.ones(4)))
    assert out[0].shape == (2, 3) and out[1].shape == (4,)
    (call,) = calls(client)
    axis = api.DEFAULT_PMAP_AXIS
    assert [i.spec for i in call.inputs] == [[None, axis], [None], [axis, None], [None]]
    assert [o.spec for o in call.outputs] == [[axis, None], [None]]
    with pytest.raises(ValueError, match="leading axis of size 2"):
        f(np.ones((3, 2)), np.ones(3), Pair(np.ones((3, 5)), np.ones(4)))
    with pytest.raises(ValueError, match="in_axes has 2 entries for 3 positional arguments"):
        zp.pmap(lambda x, y, z: x, devices=devs, in_axes=(0, 0))(np.ones(2), np.ones(2), np.ones(2))


def test_pytrees_typed_keys_and_sharding_constraints_trace(fake):
    client, devs = fake
    mesh = zp.Mesh(devs, ("i",))
    f = zp.jit(lambda s, p, k: (State(jax.lax.with_sharding_constraint(s.w * 2, P("i")), s.step + 1),
                                Pair(p.a, p.b), jax.random.split(k)), mesh=mesh)
    state, pair, keys = f(State(np.ones(4), 0), Pair(np.ones(2), np.zeros(2)), jax.random.key(0))
    assert isinstance(state, State) and isinstance(pair, Pair)
    assert keys._key == "threefry2x32" and keys.shape == (2, 2) and keys.dtype == np.uint32    # its key data
    traced = next(iter(f._cache.values()))
    assert traced.out_keys == [None, None, None, None, "threefry2x32"]
    # the workers get a program with flat inputs and outputs (the trees stay here)
    exported = jax.export.deserialize(bytearray(client.programs[traced.digest]))
    assert exported.in_tree == jax.tree_util.tree_structure(((0,) * 5, {}))
    assert exported.out_tree == jax.tree_util.tree_structure([0] * 5)


def test_traced_values_are_arrays_that_cannot_be_asked_their_truth(fake):
    client, devs = fake
    g = zp.jit(lambda x: x * 2, devices=devs)

    @zp.program
    def branches(x):
        y = g(x)
        return g(y) if y else y

    @zp.program
    def cut(x):
        return g(x[0])

    with pytest.raises(TracerBoolConversionError, match="TracerBoolConversionError"):
        branches(np.ones(2))
    with pytest.raises(zp.ZpathError, match="no devices yet"):
        cut(np.ones((2, 2)))
    v = Value((2,), np.float32, ("input", 0))
    for ask in (int, float, bool):
        with pytest.raises(TypeError):
            ask(v)


def test_array_operations_are_cached_per_operation_and_avals(fake):
    client, devs = fake
    y = zp.jit(lambda x: x, mesh=zp.Mesh(devs, ("i",)), in_specs=P("i"), out_specs=P("i"))(np.ones(4))
    mesh = y._mesh
    a, b = y + 1.0, y + 2.0                 # the scalar is an input: one computation, one trace
    assert len(mesh._ops) == 1 and len(next(iter(mesh._ops.values()))._cache) == 1
    assert a.sharding.spec == P("i") and a.devices() == set(devs)       # same shape: same sharding
    s = y.sum()
    assert s.shape == () and s.sharding.spec == P()                       # otherwise replicated
    assert (y[1:3].shape, y.reshape(2, 2).T.shape, (y @ y).shape, y.astype(np.int32).dtype) == \
        ((2,), (2, 2), (), np.int32)
    assert (y < 2).dtype == np.bool_ and (-y).shape == (4,) and (2 ** y).shape == (4,)
    assert b.sharding.devices_indices_map((4,)) == {devs[0]: (slice(0, 2),), devs[1]: (slice(2, 4),)}
    before = len(calls(client))
    y + 3.0
    assert len(calls(client)) == before + 1 and len(mesh._ops) == 10


def test_a_donated_future_is_consumed(fake):
    client, devs = fake
    step = zp.jit(lambda w, g: w - g, devices=devs, donate_argnums=0)
    w = zp.device_put(np.ones(2), devs)
    w2 = step(w, np.ones(2))
    assert ("release", w.buffer) in client.sent          # after the call that reads it
    assert client.sent.index(("release", w.buffer)) > client.sent.index(calls(client)[-1])
    for use in (lambda: step(w, np.ones(2)), lambda: w.result(), lambda: w + 1):
        with pytest.raises((ValueError, zp.ZpathError), match="donated to <lambda>"):
            use()
    assert w2.shape == (2,)
    # the workers reuse the buffer only of a value that call alone reads: a
    # future read before (by a call, a program, a fetch), or passed twice, is
    # consumed by a program that does not donate
    read = zp.device_put(np.ones(2), devs)
    read + 1
    step(read, np.ones(2))
    twice = zp.device_put(np.ones(2), devs)
    step(twice, twice)
    variants = {donate: traced for (_, donate), traced in step._cache.items()}
    assert set(variants) == {True, False}
    assert [donated_inputs(jax.export.deserialize(bytearray(client.programs[variants[d].digest])))
            for d in (True, False)] == [(0,), ()]
    # a fetch or a wait (block_until_ready, is_ready, a read) that has been
    # answered reads no more: the call donates; while one is out, or after one
    # failed (another host may still read its shard), it copies
    big = zp.jit(lambda w, g: w - g, devices=devs, donate_argnums=0)
    g = np.ones(40_000, np.float32)
    waited, out, fetched, fetching, failed = (zp.device_put(g, devs) for _ in range(5))
    assert not waited.is_ready() and not out.is_ready()        # (the fake answers nothing itself)
    for f in (fetched, fetching, failed):
        f.copy_to_host_async()
    asked = {x[1]: x[2] for x in client.sent if type(x) is tuple and x[0] == "fetch"}
    assert asked[waited.buffer].wait_only and not asked[fetched.buffer].wait_only
    waited._fetched(asked[waited.buffer], None, None)
    fetched._fetched(asked[fetched.buffer], g, None)
    failed._fetched(asked[failed.buffer], None, zp.ZpathError("host 1 did not answer"))
    assert waited.is_ready() and waited._value is None and fetched.done() and not failed.done()
    given_up = zp.device_put(g, devs)           # its fetch never answered: a worker may still read it
    with pytest.raises(zp.DeadlineExceeded):
        given_up.result(timeout=0.05)
    for f in (waited, out, fetched, fetching, failed, given_up):
        big(f, g)
    donating = {donate: traced.digest for (_, donate), traced in big._cache.items()}
    assert [c.program for c in calls(client)[-6:]] == [donating[d] for d in (True, False, True, False, False, False)]


def test_a_calls_outputs_know_each_other(fake):
    """Every output of one call shares one CallRan (so one known computed makes
    the others so: futures.Future._ran_everywhere); a call of one output has
    none."""
    client, devs = fake
    f = zp.jit(lambda x: (x + 1, {"s": x.sum(), "m": x * 2}), devices=devs)
    a, rest = f(np.ones(2))
    outs = [a, rest["m"], rest["s"]]          # (in the order of the leaves: keys sorted)
    assert outs[0]._call is not None and outs[0]._call is outs[1]._call is outs[2]._call
    assert f(np.ones(2))[0]._call is not outs[0]._call          # one per call
    assert zp.jit(lambda x: x + 1, devices=devs)(np.ones(2))._call is None


# ---- on a cluster -----------------------------------------------------------------
def devices(n: int, **kw: Any) -> list:
    return zp.make_virtual_device_set().add_slice(devices=n, **kw).devices


def test_numbers_are_plain_jaxs(client):
    d = devices(2, island=0)
    f = zp.jit(lambda k, x: (jax.random.normal(k, (3,)), x * 0.1, jnp.arange(3.) / 3), devices=d[:1])
    got = f(jax.random.PRNGKey(0), np.arange(3.))
    expect = jax.jit(lambda k, x: (jax.random.normal(k, (3,)), x * 0.1, jnp.arange(3.) / 3))(
        jax.random.PRNGKey(0), np.arange(3.))
    for g, e in zip(got, expect, strict=True):
        assert g.dtype == e.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_futures_are_arrays(client):
    d0, d1 = devices(2, island=0), devices(2, island=1)
    x = np.arange(8., dtype=np.float32).reshape(4, 2)
    y = zp.device_put(x, zp.NamedSharding(zp.Mesh(d0, ("i",)), P("i")))
    other = zp.device_put(np.ones(2, np.float32), d1)          # another island's: moved to y's devices
    assert jax.block_until_ready({"y": y}) == {"y": y} and y.is_ready() and y.done()
    assert y.block_until_ready() is y and y.sharding.spec == P("i") and y.devices() == set(d0)
    z = y * 2
    assert z.copy_to_host_async() is None          # as jax.Array's: the fetch starts, nothing waits
    # a big value: waited for without being copied here, then read
    big = zp.device_put(np.ones((64, 512), np.float32), zp.NamedSharding(zp.Mesh(d0, ("i",)), P("i")))
    big = big * 3
    assert jax.block_until_ready({"b": big})["b"] is big and big.is_ready() and big._value is None
    np.testing.assert_array_equal(big.result(timeout=60), np.full((64, 512), 3, np.float32))
    # a call's outputs: one waited for, the others are known computed (nothing fetched)
    three = zp.jit(lambda a: (a + 1, a.sum(), a * 2), devices=d0)(big)
    jax.block_until_ready(three)
    assert all(f._is_computed() and f._value is None for f in three)
    np.testing.assert_array_equal(three[2].result(timeout=60), np.full((64, 512), 6, np.float32))
    # a program's outputs, made by three computations, share a RunOutputs (asked for
    # together once a second is waited for); a one-output program's has none
    total, double, triple = (zp.jit(fn, devices=d0) for fn in (jnp.sum, lambda a: a * 2, lambda a: a * 3))
    outputs = zp.program(lambda a: (total(a), double(a), triple(a)))
    for _ in range(2):       # the first run defines the program's template, the second runs it
        outs = outputs(big)
        assert outs[0]._run is not None and outs[0]._run is outs[1]._run is outs[2]._run
        jax.block_until_ready(outs)
        assert outs[0].done() and all(f._is_computed() and f._value is None for f in outs[1:])
    np.testing.assert_array_equal(outs[2].result(timeout=60), np.full((64, 512), 9, np.float32))
    assert zp.program(lambda a: double(a))(big)._run is None
    # waited for, then donated: the wait read nothing, so the step takes the buffer over
    bumped = zp.jit(lambda a: a + 1, devices=d0, donate_argnums=0)
    w = big * 1
    jax.block_until_ready(w)
    w2 = bumped(w)
    assert [donate for _, donate in bumped._cache] == [True]
    np.testing.assert_array_equal(w2.result(timeout=60), np.full((64, 512), 4, np.float32))
    # read (fetched), then donated: the value read stays as it was
    v = w2 * 1
    seen = v.result(timeout=60)
    v2 = bumped(v)
    assert [donate for _, donate in bumped._cache] == [True]
    np.testing.assert_array_equal(v2.result(timeout=60), np.full((64, 512), 5, np.float32))
    np.testing.assert_array_equal(seen, np.full((64, 512), 4, np.float32))
    np.testing.assert_array_equal(z.result(timeout=60), x * 2)
    ops = {"add": (y + other, x + 1), "rsub": (1 - y, 1 - x), "mul": (y * y, x * x), "div": (y / 2, x / 2),
           "pow": (y ** 2, x ** 2), "matmul": (y @ y.T, x @ x.T), "index": (y[1:, 0], x[1:, 0]),
           "index2": (y[np.array([0, 2])], x[[0, 2]]), "cmp": (y >= 3, x >= 3), "eq": (y == 2, x == 2),
           "reshape": (y.reshape(2, 4), x.reshape(2, 4)), "astype": (y.astype(np.int32), x.astype(np.int32)),
           "sum": (y.sum(0), x.sum(0)), "neg": (-y, -x), "iter": (list(y)[3], x[3]),
           "numpy-left": (np.ones(2, np.float32) + y, 1 + x)}
    for name, (fut, want) in ops.items():
        assert isinstance(fut, zp.Future) and fut.devices() == set(d0), name
        np.testing.assert_array_equal(fut.result(timeout=60), want, err_msg=name)
        assert fut.dtype == want.dtype, name
    assert (y.shape, y.ndim, y.size, y.dtype) == ((4, 2), 2, 8, np.float32)
    assert float(y[3, 1]) == 7.0 and int(y[1, 0]) == 2 and [0, 1, 2][y[0, 1].astype(np.int32)] == 1
    assert (y + other).sharding.spec == P("i")


def test_microbatches_are_cut_and_combined_in_the_program(client):
    d = devices(2, island=0)
    layer = zp.jit(lambda w, x: jnp.tanh(x @ w), devices=d)
    stack = zp.jit(lambda parts: jnp.concatenate(parts), devices=d)

    @zp.program
    def forward(w, batch):
        parts = [layer(w, batch[k * 2:(k + 1) * 2]) for k in range(3)]
        return stack(parts), parts[0].sum() + parts[1].sum()
    w = zp.device_put(np.eye(3, dtype=np.float32) * 0.5, d)
    batch = zp.device_put(np.arange(18., dtype=np.float32).reshape(6, 3) / 18, d)
    out, partial = forward(w, batch)
    expect = np.tanh(np.arange(18., dtype=np.float32).reshape(6, 3) / 18 @ (np.eye(3, dtype=np.float32) * 0.5))
    np.testing.assert_allclose(out.result(timeout=60), expect, rtol=1e-6)
    np.testing.assert_allclose(partial.result(timeout=60), expect[:4].sum(), rtol=1e-6)
    # slicing, combining and the layers are nodes of one program
    traced = next(iter(forward._cache.values()))
    assert [n.computation.name for n in traced.nodes].count("getitem") == 3 and len(traced.nodes) == 10


def test_jit_options_on_a_cluster(client):
    d = devices(2, island=1)
    mesh = zp.Mesh(d, ("data",))
    step = zp.jit(lambda w, g, *, lr: jax.lax.with_sharding_constraint(w - lr * g, P("data")), mesh=mesh,
                  in_specs=(P("data"), P("data")), out_specs=P("data"), donate_argnums=0)
    w = zp.device_put(np.ones(4, np.float32), zp.NamedSharding(mesh, P("data")))
    for _ in range(3):
        w = step(w, np.ones(4, np.float32), lr=0.25)
    np.testing.assert_array_equal(w.result(timeout=60), np.full(4, 0.25, np.float32))
    rep = zp.jit(lambda x, n: jnp.tile(x, n), devices=d, static_argnums=1)(np.arange(2), 3)
    np.testing.assert_array_equal(rep.result(timeout=60), np.tile(np.arange(2), 3))
    assert rep.sharding.spec == P() and rep.dtype == np.int32


def test_pytrees_and_typed_keys_in_and_out(client):
    d = devices(2, island=0)
    f = zp.jit(lambda s, k: (State(s.w * 2, s.step + 1), Pair(*jax.random.split(k))), devices=d)
    state, keys = f(State(np.ones(2), 1), jax.random.key(0))
    assert isinstance(state, State) and isinstance(keys, Pair)
    np.testing.assert_array_equal(state.w.result(timeout=60), [2., 2.])
    assert state.step.result(timeout=60) == 2
    expect = jax.random.split(jax.random.key(0))
    assert jax.random.key_data(keys.a.result(timeout=60)).tolist() == jax.random.key_data(expect[0]).tolist()
    draw = zp.jit(lambda k: jax.random.uniform(k, (2,)), devices=d)
    np.testing.assert_array_equal(draw(keys.b).result(timeout=60), jax.random.uniform(expect[1], (2,)))

    @zp.program
    def again(s, k):
        s2, ks = f(s, k)
        return s2, draw(ks.a)
    s2, u = again(state, jax.random.key(0))
    assert isinstance(s2, State)
    np.testing.assert_array_equal(u.result(timeout=60), jax.random.uniform(expect[0], (2,)))
    np.testing.assert_array_equal(s2.w.result(timeout=60), [4., 4.])


def test_dtype_names_the_client_remembers_are_numpys():
    for dt in ("float32", ">f4", "int64", "bool", ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, "complex64"):
        d = np.dtype(dt)
        assert avals.dtype_name(d) == d.name and avals.dtype_name(d) == d.name      # (remembered the second time)
    assert avals.dtype_name(jax.random.key(0).dtype) == jax.random.key(0).dtype.name
