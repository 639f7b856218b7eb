"""executor.to_device: a numpy array onto a device as jax.device_put puts it,
without JAX's Python path (what every Put, received piece and empty shard of a
worker takes). Each array is put both ways and the two results compared: type,
aval, sharding, whether committed, the values, and whether the device buffer
is the numpy array's own memory (XLA:CPU takes an aligned array over). JAX
runs in a subprocess, so that turning 64-bit types off there changes no other
test's process. A JAX array on one device (a shard read on another local
device) is compared the same way, onto another device and onto its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent("""
    import json
    import jax, ml_dtypes, numpy as np
    from jax._src import dtypes
    from zpath.net import channels
    from zpath.worker import executor
    from zpath.worker.executor import to_device

    dev = jax.devices()[0]
    calls = []
    real = executor._batched_device_put
    def counting(*a):
        calls.append(1)
        return real(*a)
    executor._batched_device_put = counting

    def aligned(shape, dtype):
        out = channels.recv_buffers.get(shape, np.dtype(dtype))
        out[...] = np.arange(out.size).reshape(shape).astype(dtype)
        return out

    def same(x):
        want = jax.device_put(x, dev)
        n = len(calls)
        got = to_device(x, dev)
        took = len(calls) > n
        assert type(got) is type(want), (type(got), type(want))
        assert got.aval == want.aval, (got.aval, want.aval)
        if not hasattr(want, "sharding"):      # (float0: JAX keeps it on the host)
            return took
        assert got.sharding == want.sharding and got._committed == want._committed
        assert np.array_equal(np.asarray(got), np.asarray(want), equal_nan=True)
        if x.size and x.dtype.names is None:
            own = x.ctypes.data
            assert (got.unsafe_buffer_pointer() == own) == (want.unsafe_buffer_pointer() == own), x.dtype
            aliased.append(got.unsafe_buffer_pointer() == own)
        return took

    arrays = {
        "float64": np.linspace(0, 1, 7), "float32 2-d": np.ones((3, 4), np.float32),
        "int8": np.arange(-4, 4, dtype=np.int8), "bool": np.array([True, False]),
        "complex64": np.array([1 + 2j], np.complex64), "uint64": np.array([2 ** 63], np.uint64),
        "bfloat16": np.ones(5, ml_dtypes.bfloat16), "int4": np.array([1, -2, 3], ml_dtypes.int4),
        "scalar": np.array(3.5), "empty": np.empty((0, 3)), "strided": np.arange(20.)[::2],
        "aligned 64 KiB": aligned((128, 64), np.float64), "nan": np.array([np.nan, np.inf]),
        "float0": np.zeros(3, dtypes.float0),
    }
    fast, aliased = {}, []
    for x64 in (True, False):
        jax.config.update("jax_enable_x64", x64)
        for name, x in arrays.items():
            fast[f"{name}, x64 {x64}"] = same(x)
    jax.config.update("jax_enable_x64", True)
    errors = []
    for bad in (np.array(["a"]), np.array([object()], dtype=object)):
        for put in (lambda b: jax.device_put(b, dev), lambda b: to_device(b, dev)):
            try:
                put(bad)
                errors.append(None)
            except TypeError as e:
                errors.append(type(e).__name__)

    # a JAX array on one device, onto another local device and onto its own
    d1 = jax.devices()[1]
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    two = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), PartitionSpec("x"))
    moved = {}
    for x64 in (True, False):
        jax.config.update("jax_enable_x64", x64)
        for name, make in (("float32", lambda: jax.device_put(np.arange(6, dtype=np.float32), dev)),
                           ("int8 2-d", lambda: jax.device_put(np.ones((2, 3), np.int8), dev)),
                           ("bfloat16", lambda: jax.device_put(np.ones(4, ml_dtypes.bfloat16), dev)),
                           ("empty", lambda: jax.device_put(np.empty((0, 2), np.float32), dev)),
                           ("weak scalar", lambda: jnp.asarray(2.5)),       # (uncommitted too)
                           ("computed", lambda: jax.jit(lambda v: v * 2)(jax.device_put(np.ones(3), dev))),
                           # a shard of a computation's output on 2 devices, as a worker splits it
                           ("shard", lambda: jax.jit(lambda v: v + 1, out_shardings=two)(
                               jax.device_put(np.arange(4.), two))._arrays[0])):
            a = make()
            for target in (dev, d1):
                want = jax.device_put(a, target)
                n = len(calls)
                got = to_device(a, target)
                assert type(got) is type(want) and got.aval == want.aval, (name, got.aval, want.aval)
                assert got.sharding == want.sharding and got._committed == want._committed, name
                assert np.array_equal(np.asarray(got), np.asarray(want)), name
                same_buffer = [v.unsafe_buffer_pointer() == a.unsafe_buffer_pointer() for v in (got, want)] \
                    if a.size else [None, None]
                moved[f"{name}, x64 {x64}, {'own' if target == dev else 'other'}"] = \
                    [len(calls) > n, *same_buffer]
    # a deleted (donated) array, and one on 2 devices (left to jax.device_put):
    # the same error, the same result
    gone = jax.device_put(np.ones(2), dev)
    gone.delete()
    for put in (jax.device_put, to_device):
        try:
            put(gone, d1)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    wide = jax.device_put(np.arange(4.), two)
    n = len(calls)
    got, want = to_device(wide, d1), jax.device_put(wide, d1)
    assert got.aval == want.aval and got.sharding == want.sharding and len(calls) == n
    print(json.dumps({"fast": fast, "errors": errors, "aliased": aliased, "moved": moved}))
""")


def test_to_device_puts_as_jax_device_put_does():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    fast = res["fast"]
    # taken the short way: every plain numeric array with 64-bit types on, and
    # with them off those whose dtype JAX keeps
    for name in ("float64", "float32 2-d", "int8", "bool", "complex64", "uint64", "bfloat16", "int4",
                 "scalar", "empty", "strided", "aligned 64 KiB", "nan"):
        assert fast[f"{name}, x64 True"], name
    for name in ("float32 2-d", "int8", "bool", "complex64", "bfloat16", "int4"):
        assert fast[f"{name}, x64 False"], name
    # left to jax.device_put: dtypes JAX changes (64-bit ones with 64-bit types
    # off) or replaces (float0: zeros of bool)
    for name in ("float64, x64 False", "uint64, x64 False", "scalar, x64 False", "float0, x64 True"):
        assert not fast[name], name
    # what JAX refuses, it refuses the same way
    assert res["errors"][:4] == ["TypeError"] * 4
    assert res["errors"][4] == res["errors"][5] and "deleted" in res["errors"][4]
    # both ways, XLA took some arrays over (the aligned one) and copied others
    assert any(res["aliased"]) and not all(res["aliased"])
    # a JAX array: onto another local device it is copied by the same call
    # (a buffer of its own both ways); onto its own device both wrap its buffer
    moved = res["moved"]
    assert len(moved) == 28
    for name, (called, got_same, want_same) in moved.items():
        other = name.endswith("other")
        assert called == other, name
        if got_same is not None:       # (an empty array has no buffer to compare)
            assert got_same == want_same == (not other), name
