"""Resharding between device sets: a value produced on mesh A with sharding SA
and read on mesh B with sharding SB gives the same numbers as plain numpy/JAX,
on one host, across hosts of an island, and across islands."""
from __future__ import annotations

import numpy as np
import pytest

import zpath as zp
from zpath.net import messages as m
from tests.conftest import connected, running_cluster

pytestmark = pytest.mark.timeout(240)
P = zp.P


@pytest.fixture(scope="module")
def big_cluster():
    """Two islands of two hosts (one JAX runtime each), two devices per host."""
    with running_cluster(islands=2, hosts_per_island=2, devices_per_host=2) as c:
        yield c


@pytest.fixture(scope="module")
def conn(big_cluster):
    with connected(big_cluster, "reshard") as conn:
        yield conn


@pytest.fixture(scope="module")
def layout(conn):
    """host rank -> its 2 devices; island -> its 4 devices."""
    devs = {}
    islands = {}
    for island in (0, 1):
        d = zp.make_virtual_device_set().add_slice(devices=4, island=island).devices
        islands[island] = d
        for v in d:
            devs.setdefault(v.host, []).append(v)
    return devs, islands


def mesh(devs, shape, names):
    return zp.Mesh(np.array(devs, dtype=object).reshape(shape), names)


# (where the consumer runs relative to the producer, producer mesh+spec, consumer mesh+spec)
CASES = [
    # same host, other devices / same devices other sharding
    ("same-host", (2,), ("i",), P("i"), (2,), ("j",), P()),
    ("same-host", (2,), ("i",), P(), (2,), ("j",), P(None, "j")),
    ("same-host", (1,), ("i",), P(), (2,), ("j",), P("j", None)),
    # across hosts of one island: sets of different sizes, 1-D <-> 2-D
    ("island", (2,), ("i",), P("i"), (4,), ("j",), P("j")),
    ("island", (4,), ("i",), P("i"), (2, 2), ("a", "b"), P("a", "b")),
    ("island", (2, 2), ("a", "b"), P(("a", "b")), (2,), ("j",), P(None, "j")),
    ("island", (2, 2), ("a", "b"), P("b", "a"), (4,), ("j",), P()),
    # across islands (DCN)
    ("islands", (2,), ("i",), P("i", None), (4,), ("j",), P(None, "j")),
    ("islands", (2, 2), ("a", "b"), P("a", None), (2, 2), ("c", "d"), P("d", "c")),
    ("islands", (4,), ("i",), P(), (1,), ("j",), P()),
]


@pytest.mark.parametrize("where,a_shape,a_names,a_spec,b_shape,b_names,b_spec", CASES,
                         ids=[f"{c[0]}-{c[3]}-to-{c[6]}" for c in CASES])
def test_reshard(conn, layout, x64, where, a_shape, a_names, a_spec, b_shape, b_names, b_spec):
    by_host, by_island = layout
    na, nb = int(np.prod(a_shape)), int(np.prod(b_shape))
    if where == "same-host":
        host = sorted(by_host)[0]
        a_devs, b_devs = by_host[host][:na], by_host[host][-nb:][::-1]
    elif where == "island":
        isl = by_island[0]
        a_devs, b_devs = isl[:na], isl[::-1][:nb]
    else:
        a_devs, b_devs = by_island[0][:na], by_island[1][:nb]
    if where != "same-host" and where != "islands":
        assert len({d.host for d in a_devs + b_devs}) > 1
    produce = zp.jit(lambda x: x * 3. - 1., mesh=mesh(a_devs, a_shape, a_names), in_specs=a_spec,
                     out_specs=a_spec)
    consume = zp.jit(lambda x: x.T @ x + x.sum(), mesh=mesh(b_devs, b_shape, b_names), in_specs=b_spec,
                     out_specs=P())
    x = np.random.default_rng(len(a_shape) * 10 + na).normal(size=(8, 4))
    y = produce(x)
    expect_y = x * 3. - 1.
    np.testing.assert_allclose(np.asarray(y), expect_y)
    np.testing.assert_allclose(np.asarray(consume(y)), expect_y.T @ expect_y + expect_y.sum(), rtol=1e-12)


def test_same_devices_and_sharding_means_no_transfer(conn, layout):
    by_host, _ = layout
    devs = by_host[sorted(by_host)[0]]
    f = zp.jit(lambda x: x + 1., mesh=mesh(devs, (2,), ("i",)), in_specs=P("i"), out_specs=P("i"))
    g = zp.jit(lambda x: x * 2., mesh=mesh(devs, (2,), ("k",)), in_specs=P("k"), out_specs=P("k"))

    @zp.program
    def chain(v):
        return g(f(v))
    text = chain.explain(np.ones(4))
    assert "transfer" not in text
    np.testing.assert_array_equal(np.asarray(chain(np.ones(4))), np.full(4, 4.))
    st = conn.client.request(m.StatusRequest(False))
    assert st.calls > 0
