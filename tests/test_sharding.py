"""Pure tests of zpath/sharding.py.

The reference for :func:`zpath.sharding.regions` is JAX itself:
``NamedSharding(mesh, PartitionSpec(...)).devices_indices_map(shape)``. That needs
real devices, so JAX runs in a subprocess with 8 emulated CPU devices (setting
XLA_FLAGS here would not work if another test had already imported jax)."""
from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from zpath import sharding

pytestmark = pytest.mark.timeout(60)

# ---- the JAX reference, in a subprocess ---------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cases = json.load(sys.stdin)
    devices = jax.devices()
    assert len(devices) >= 8, devices
    out = []
    for mesh_shape, names, shape, spec in cases:
        n = int(np.prod(mesh_shape))
        arr = np.array(devices[:n], dtype=object).reshape(mesh_shape)
        mesh = Mesh(arr, tuple(names))
        entries = [tuple(e) if isinstance(e, list) else e for e in spec]
        idx = NamedSharding(mesh, P(*entries)).devices_indices_map(tuple(shape))
        regs = []
        for d in arr.flat:          # row-major over the mesh device array
            regs.append([[0 if s.start is None else s.start, size if s.stop is None else s.stop]
                         for s, size in zip(idx[d], shape)])
        out.append(regs)
    json.dump(out, sys.stdout)
""")

MESHES = [
    ((8,), ("x",)),
    ((4,), ("x",)),
    ((1,), ("x",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("a", "b")),
    ((1, 8), ("a", "b")),
    ((8, 1), ("a", "b")),
    ((2, 2, 2), ("x", "y", "z")),
    ((2, 1, 4), ("x", "y", "z")),
]


def _entry_options(names: tuple[str, ...]) -> list:
    opts: list = [None, *names]
    for k in range(1, len(names) + 1):
        opts += [list(p) for p in itertools.permutations(names, k)]
    return opts


def _used(entry) -> list[str]:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def _cases() -> list:
    rng = random.Random(1234)
    cases = []
    for mesh_shape, names in MESHES:
        opts = _entry_options(names)
        # replicated: P() for several ranks, and a spec shorter than the rank
        for shape in ([8], [8, 16], [24, 8, 16]):
            cases.append((mesh_shape, names, shape, []))
        cases.append((mesh_shape, names, [16, 8], [names[0]]))
        # every single entry on a rank-1 and (in the middle) a rank-3 array
        for e in opts:
            cases.append((mesh_shape, names, [16], [e]))
            cases.append((mesh_shape, names, [8, 24, 16], [None, e, None]))
        # random multi-dimensional specs without a repeated axis
        seen = 0
        while seen < 30:
            rank = rng.randint(1, 3)
            spec = [rng.choice(opts) for _ in range(rank)]
            used = [a for e in spec for a in _used(e)]
            if len(used) != len(set(used)):
                continue
            shape = [rng.choice([8, 16, 24]) for _ in range(rank)]
            cases.append((mesh_shape, names, shape, spec))
            seen += 1
    return cases


@pytest.fixture(scope="module")
def jax_reference():
    cases = _cases()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cases, json.loads(proc.stdout)


def test_regions_match_jax(jax_reference):
    cases, expected = jax_reference
    assert len(cases) == len(expected) > 200
    kinds = set()
    for (mesh_shape, names, shape, spec), want in zip(cases, expected, strict=True):
        got = sharding.regions(shape, mesh_shape, names, spec)
        want = [sharding.from_wire(r) for r in want]
        assert got == want, f"mesh {mesh_shape} {names}, shape {shape}, spec {spec}"
        kinds.update(type(e).__name__ for e in spec)
    # the comparison really covered None, single axes and tuples of axes
    assert kinds == {"NoneType", "str", "list"}


def test_regions_accept_tuple_and_normalized_specs(jax_reference):
    cases, expected = jax_reference
    for (mesh_shape, names, shape, spec), want in zip(cases[:80], expected[:80], strict=True):
        as_tuples = [tuple(e) if isinstance(e, list) else e for e in spec]
        norm = sharding.normalize_spec(as_tuples, len(shape), names)
        want = [sharding.from_wire(r) for r in want]
        assert sharding.regions(shape, mesh_shape, names, as_tuples) == want
        assert sharding.regions(shape, mesh_shape, names, norm) == want


# ---- hand-checked regions ---------------------------------------------------------

def test_regions_row_major_order_2d():
    # mesh a=2, b=2; dimension 0 split over (b, a): b is the major axis
    got = sharding.regions([8], [2, 2], ["a", "b"], [["b", "a"]])
    # positions (a,b) in row-major order: (0,0) (0,1) (1,0) (1,1)
    # index = b*2 + a -> 0, 2, 1, 3
    assert got == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


def test_regions_replicated_and_scalar():
    assert sharding.regions([4, 6], [3], ["x"], []) == [((0, 4), (0, 6))] * 3
    assert sharding.regions([], [2], ["x"], []) == [(), ()]


def test_regions_indivisible_dimension_raises():
    with pytest.raises(ValueError, match="not divisible"):
        sharding.regions([6], [4], ["x"], ["x"])
    with pytest.raises(ValueError, match="dimension 1 of size 3"):
        sharding.regions([4, 3], [2, 2], ["a", "b"], [None, ["a", "b"]])


def test_regions_reject_bad_specs():
    with pytest.raises(ValueError, match="axis 'q'"):
        sharding.regions([4], [2], ["x"], ["q"])
    with pytest.raises(ValueError, match="twice"):
        sharding.regions([4, 4], [2], ["x"], ["x", "x"])
    with pytest.raises(ValueError, match="rank 1"):
        sharding.regions([4], [2], ["x"], [None, "x"])


# ---- normalize_spec -------------------------------------------------------------

def test_normalize_spec_forms():
    from jax.sharding import PartitionSpec as P

    names = ("x", "y")
    assert sharding.normalize_spec(P(), 2, names) == [None, None]
    assert sharding.normalize_spec(None, 1, names) == [None]
    assert sharding.normalize_spec(P("x"), 3, names) == ["x", None, None]
    assert sharding.normalize_spec(P(None, ("x", "y")), 2, names) == [None, ["x", "y"]]
    assert sharding.normalize_spec([("y",)], 1, names) == [["y"]]
    assert sharding.normalize_spec(P(()), 1, names) == [None]
    assert sharding.normalize_spec(["y", "x"], 2, names) == ["y", "x"]


def test_normalize_spec_errors():
    names = ("x", "y")
    with pytest.raises(ValueError, match="names axis 'z'.*mesh axes are \\('x', 'y'\\)"):
        sharding.normalize_spec(["z"], 1, names)
    with pytest.raises(ValueError, match="uses axis 'x' twice"):
        sharding.normalize_spec(["x", "x"], 2, names)
    with pytest.raises(ValueError, match="uses axis 'y' twice"):
        sharding.normalize_spec([("x", "y"), "y"], 2, names)
    with pytest.raises(ValueError, match="has 3 entries for an array of rank 2"):
        sharding.normalize_spec([None, "x", None], 2, names)


# ---- region helpers -------------------------------------------------------------

def test_intersect():
    a = ((0, 4), (0, 6))
    assert sharding.intersect(a, ((2, 8), (3, 4))) == ((2, 4), (3, 4))
    assert sharding.intersect(a, a) == a
    assert sharding.intersect(a, ((4, 8), (0, 6))) is None      # touching is empty
    assert sharding.intersect(a, ((1, 2), (6, 7))) is None
    assert sharding.intersect((), ()) == ()
    with pytest.raises(ValueError):
        sharding.intersect(a, ((0, 1),))


def test_contains():
    outer = ((0, 4), (2, 6))
    assert sharding.contains(outer, outer)
    assert sharding.contains(outer, ((1, 3), (2, 4)))
    assert not sharding.contains(outer, ((1, 5), (2, 4)))
    assert not sharding.contains(outer, ((0, 4), (1, 6)))


def test_local_slices_cut_the_right_block():
    import numpy as np

    glob = np.arange(8 * 6).reshape(8, 6)
    outer = ((2, 8), (0, 6))
    inner = ((4, 6), (1, 3))
    held = glob[2:8, 0:6]
    sl = sharding.local_slices(inner, outer)
    assert sl == (slice(2, 4), slice(1, 3))
    np.testing.assert_array_equal(held[sl], glob[4:6, 1:3])


def test_region_from_index_and_wire():
    shape = (8, 6, 4)
    idx = (slice(2, 4), slice(None, None), slice(0, None))
    r = sharding.region_from_index(idx, shape)
    assert r == ((2, 4), (0, 6), (0, 4))
    assert sharding.region_shape(r) == (2, 6, 4)
    assert sharding.to_wire(r) == [[2, 4], [0, 6], [0, 4]]
    assert sharding.from_wire(sharding.to_wire(r)) == r
    assert sharding.region_from_index((), ()) == ()


def test_regions_of_takes_a_str_subclass_as_one_axis_name():
    # (numpy's string scalars are str: a spec built from them names the same axes)
    want = sharding.regions((4, 6), [2, 3], ["data", "model"], ["data", ["model"]])
    got = sharding.regions_of((4, 6), [2, 3], ["data", "model"], [np.str_("data"), [np.str_("model")]])
    assert list(got) == want
