"""@zp.program: traced dataflow graphs submitted as one message, explained,
dispatched in parallel or sequentially."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import zpath as zp
from zpath.client import api
from zpath.cluster.testing import wait_until
from zpath.net import codec
from zpath.net import messages as m
from tests.test_memory import empty, wait_for

pytestmark = pytest.mark.timeout(180)


def devices(n, **kw):
    return zp.make_virtual_device_set().add_slice(devices=n, **kw).devices


@pytest.fixture
def figure2(client):
    a = zp.pmap(lambda x: x * 2., devices=devices(2, island=0))
    b = zp.pmap(lambda x: x + 1., devices=devices(2, island=1))
    c = zp.pmap(lambda x: x / 2., devices=devices(2, island=0))
    traces = []

    def f(v):
        traces.append(1)          # runs only while tracing
        x = a(v)
        y = b(x)
        z = a(c(x))
        return (y, z)
    return f, traces


@pytest.mark.parametrize("dispatch", ["parallel", "sequential"])
def test_figure2_as_one_program(client, figure2, dispatch):
    f, traces = figure2
    prog = zp.program(f, dispatch=dispatch)
    calls_before = client.client.request(m.StatusRequest(False)).calls
    y, z = prog(np.array([1., 2.]))
    assert isinstance(y, zp.Future) and y.shape == (2,)
    np.testing.assert_array_equal(np.asarray(y), [3., 5.])
    np.testing.assert_array_equal(np.asarray(z), [2., 4.])
    # traced once per input signature; a new signature traces again
    y2, _ = prog(np.array([5., 6.]))
    np.testing.assert_array_equal(np.asarray(y2), [11., 13.])
    assert len(traces) == 1
    prog(np.ones((2, 3)))[0].result(timeout=60)
    assert len(traces) == 2
    # the controller planned one node per computation: 4 per program
    assert client.client.request(m.StatusRequest(False)).calls - calls_before == 12


def test_intermediates_are_freed_after_the_program(client, figure2):
    f, _ = figure2
    prog = zp.program(f)
    wait_for(client, empty)
    y, z = prog(np.arange(2000.).reshape(2, 1000))
    y.result(timeout=60), z.result(timeout=60)
    # only y (host of island 1) and z (island 0) remain: 2 shards each, 4000 bytes
    # each (float32, JAX's default)
    held = wait_for(client, lambda s: sorted(s.values()) == [(2, 8000), (2, 8000)])
    assert len(held) == 2
    del y, z
    gc.collect()
    wait_for(client, empty)


def test_explain_shows_nodes_and_transfers(client, figure2, capsys):
    f, _ = figure2
    text = zp.program(f).explain(np.array([1., 2.]))
    assert capsys.readouterr().out.strip() == text
    lines = text.splitlines()
    assert lines[0] == "program f: 4 node(s), dispatch=parallel"
    assert sum(1 for ln in lines if ln.startswith("  node ")) == 4
    # x (island 0) is read by b on island 1: two 4-byte (float32) shards cross the DCN
    dcn = [ln for ln in lines if "over DCN" in ln]
    assert len(dcn) == 2 and all("4 bytes" in ln for ln in dcn)
    assert not any("over ICI" in ln for ln in lines)


def test_sequential_dispatch_waits_for_predecessors(client):
    """In sequential mode a node starts only after the node it reads finished;
    both modes agree on the result."""
    on0 = zp.pmap(lambda x: x + 1., devices=devices(1, host=0))
    on1 = zp.pmap(lambda x: x * 2., devices=devices(1, host=1))

    def chain(v):
        for _ in range(4):
            v = on1(on0(v))
        return v

    seq, par = zp.program(chain, dispatch="sequential"), zp.program(chain)
    np.testing.assert_array_equal(np.asarray(seq(np.zeros(1))), np.asarray(par(np.zeros(1))))
    np.testing.assert_array_equal(np.asarray(seq(np.zeros(1))), [30.])
    recs = client.client.request(m.TimelineRequest(8)).records
    assert len(recs) == 8
    # (in the order they ran: the reports of a host's two executor threads may
    # reach the controller in either order)
    recs = sorted(recs, key=lambda r: r.start)
    for before, after in zip(recs, recs[1:]):
        assert after.start >= before.end - 1e-3, (before, after)


def test_program_inputs_futures_and_constants(client):
    d = devices(2)
    add = zp.pmap(lambda x, y: x + y, devices=d)
    outside = add(np.ones(2), np.ones(2))            # a future captured by the program
    const = np.array([10., 20.])

    @zp.program
    def p(v):
        return add(add(v, outside), const)

    np.testing.assert_array_equal(np.asarray(p(np.array([1., 2.]))), [13., 24.])
    np.testing.assert_array_equal(np.asarray(p(outside)), [14., 24.])  # a future as input


def test_program_errors(client):
    inc = zp.pmap(lambda x: x + 1, devices=devices(2))

    @zp.program
    def peeks(v):
        return np.asarray(inc(v))
    with pytest.raises(zp.ZpathError, match="no contents yet"):
        peeks(np.ones(2))

    @zp.program
    def returns_input(v):
        return v
    with pytest.raises(zp.ZpathError, match="must return values computed"):
        returns_input(np.ones(2))

    @zp.program
    def bad_shape(v):
        return inc(v)
    with pytest.raises(ValueError, match="leading axis of size 2"):
        bad_shape(np.ones(3))
    with pytest.raises(ValueError, match="dispatch must be"):
        zp.program(lambda v: v, dispatch="sideways")

    inner = zp.program(lambda v: inc(v))

    @zp.program
    def outer(v):
        return inner(inc(v))
    with pytest.raises(zp.ZpathError, match="cannot be nested"):
        outer(np.ones(2))


def test_a_failing_node_fails_the_program_outputs(client):
    import jax.numpy as jnp
    d = devices(1)
    huge = zp.pmap(lambda x: jnp.broadcast_to(x, (1 << 40,)), devices=d)
    after = zp.pmap(lambda x: x[:2] * 2, devices=d)

    @zp.program
    def failing(v):
        return after(huge(v))
    for _ in range(3):          # the first run plain, the others fused
        with pytest.raises(zp.RemoteError, match="RESOURCE_EXHAUSTED"):
            failing(np.ones(1)).result(timeout=60)
    fused = _fused_records(client, "failing")
    assert fused and not any(r.ok for r in fused)


def test_calls_reading_a_held_sequential_node_wait_for_it(client):
    """A program or plain call that reads the output of a sequential program
    still being held back must not reach the worker before its producer."""
    d = devices(1)
    f = zp.pmap(lambda x: x * 2., devices=d)

    @zp.program(dispatch="sequential")
    def two(x):
        return f(f(x))
    y = two(np.ones(1))
    z = two(y)                 # reads y, whose producer may still be held
    w = f(z)                   # a plain call after it
    np.testing.assert_array_equal(w.result(timeout=30), [32.])
    np.testing.assert_array_equal(z.result(timeout=30), [16.])


def _fused_records(client, name):
    return [r for r in client.client.request(m.TimelineRequest(100_000)).records
            if r.name.startswith(f"{name} (") and r.name.endswith(" fused)")]


def test_repeated_runs_of_a_program_are_fused(client):
    """A program run again is sent as a template run, and one that moves no data
    between hosts runs fused (one computation per run for the controller); the
    results are the same as plain calls'. Runs with client values (put each
    time) and with futures as inputs are both fused."""
    d = devices(2, host=0)
    inc = zp.pmap(lambda x: x + 1., devices=d)
    dbl = zp.pmap(lambda x: x * 2., devices=d)
    add = zp.pmap(lambda x, y: x + y, devices=d)
    const = np.array([10., 20.])

    @zp.program
    def step(v):
        return dbl(inc(v)), add(v, const)

    calls0 = client.client.request(m.StatusRequest(False)).calls
    x, want = np.array([0., 1.]), np.array([0., 1.])
    for k in range(8):
        if k == 4:
            x, want = np.array([3., 4.]), np.array([3., 4.])     # a client value again
        x, s = step(x)
        np.testing.assert_array_equal(s.result(timeout=60), want + const)
        want = 2 * (want + 1)
        np.testing.assert_array_equal(x.result(timeout=60), want)
    # every run counts its 3 nodes, fused or not
    assert client.client.request(m.StatusRequest(False)).calls - calls0 == 24
    # per input pattern, the first run defines the template; runs 2-4 and 6-8 are fused
    fused = _fused_records(client, "step")
    assert len(fused) >= 5 and all(r.ok and r.name == "step (3 nodes, fused)" for r in fused)


def test_a_program_that_moves_data_is_not_fused(client, figure2):
    f, _ = figure2
    prog = zp.program(f)
    for k in range(4):
        y, z = prog(np.array([1., 2.]) + k)
        np.testing.assert_array_equal(np.asarray(y), [3. + 2 * k, 5. + 2 * k])
        np.testing.assert_array_equal(np.asarray(z), [2. + 2 * k, 4. + 2 * k])
    assert not _fused_records(client, "f")


def test_fused_runs_free_their_intermediates_and_inputs(client):
    d = devices(2, host=0)
    inc = zp.pmap(lambda x: x + 1., devices=d)
    wait_for(client, empty)

    @zp.program
    def three(v):
        return inc(inc(inc(v)))
    for k in range(4):
        out = three(np.full((2, 1000), float(k)))
        np.testing.assert_array_equal(out.result(timeout=60), np.full((2, 1000), k + 3.))
    assert _fused_records(client, "three")
    # only the last result remains: 2 float32 shards of 4000 bytes on host 0
    held = wait_for(client, lambda s: sorted(s.values()) == [(0, 0), (2, 8000)])
    assert held[0] == (2, 8000)
    del out
    gc.collect()
    wait_for(client, empty)


def test_a_first_run_that_raises_leaves_the_program_usable(client, monkeypatch):
    """The first run of a program defines its template: if it raises before
    the definition is sent, later runs define it again instead of naming a
    template the controller never got."""
    inc = zp.pmap(lambda x: x + 1., devices=devices(2, host=0))

    @zp.program
    def p(v):
        return inc(inc(v))
    real, calls = api.Computation.put, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("put failed")
        return real(self, *a, **k)
    monkeypatch.setattr(api.Computation, "put", flaky)
    with pytest.raises(RuntimeError, match="put failed"):
        p(np.zeros(2))
    for k in range(4):
        np.testing.assert_array_equal(p(np.full(2, float(k))).result(timeout=60), [k + 2.] * 2)
    assert _fused_records(client, "p")


def test_a_run_racing_the_first_one_is_right(client, monkeypatch):
    """Another thread's run while the first run is still being sent goes as a
    plain program (the template is not defined yet), and is right."""
    inc = zp.pmap(lambda x: x + 1., devices=devices(2, host=0))

    @zp.program
    def q(v):
        return inc(v)
    real, calls = api.Computation.put, []
    sending, go_on = threading.Event(), threading.Event()

    def held_first(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:          # the first run stops while it is being sent
            sending.set()
            go_on.wait(60)
        return real(self, *a, **k)
    monkeypatch.setattr(api.Computation, "put", held_first)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", q(np.zeros(2)).result(timeout=60)))
    t.start()
    try:
        assert sending.wait(60)
        np.testing.assert_array_equal(q(np.ones(2)).result(timeout=60), [2., 2.])
    finally:
        go_on.set()
        t.join(60)
    np.testing.assert_array_equal(out["a"], [1., 1.])
    for k in range(3):
        np.testing.assert_array_equal(q(np.full(2, float(k))).result(timeout=60), [k + 1.] * 2)


def test_collected_programs_drop_their_templates(client):
    inc = zp.pmap(lambda x: x + 1., devices=devices(2, host=0))
    live = client.client._templates_live
    for k in range(3):
        @zp.program
        def p(v):
            return inc(v)
        p(np.zeros(2)).result(timeout=60)
        np.testing.assert_array_equal(p(np.full(2, float(k))).result(timeout=60), [k + 1.] * 2)
    assert client.client._templates_live == live + 1      # the last p is alive
    del p
    gc.collect()
    # the client's I/O thread counts it
    wait_until(lambda: client.client._templates_live == live, 10, interval=0.05,
               what="the collected program's template dropped")
    assert client.client._templates_live == live


def test_fused_intermediates_read_in_another_sharding(client):
    """A fused run passes a value on as it is when the next node reads it in the
    sharding it was made in, and stores its shards when a node reads it in
    another (here: sharded, then replicated, on the same host's two devices)."""
    d = devices(2, host=0)
    mesh = zp.Mesh(np.array(d, dtype=object), ("i",))
    sharded = zp.jit(lambda x: x * 3., mesh=mesh, in_specs=zp.P("i"), out_specs=zp.P("i"))
    again = zp.jit(lambda x: x + 1., mesh=mesh, in_specs=zp.P("i"), out_specs=zp.P("i"))
    whole = zp.jit(lambda x: x.sum() + x, mesh=mesh, in_specs=zp.P(), out_specs=zp.P())

    @zp.program
    def mixed(v):
        a = sharded(v)            # an intermediate, read as it is ...
        b = again(a)              # ... and replicated
        return whole(a), whole(b), b
    for k in range(4):
        v = np.arange(4.) + k
        a = v * 3.
        wa, wb, b = mixed(v)
        np.testing.assert_array_equal(wa.result(timeout=60), a.sum() + a)
        np.testing.assert_array_equal(wb.result(timeout=60), (a + 1).sum() + a + 1)
        np.testing.assert_array_equal(b.result(timeout=60), a + 1)
    assert _fused_records(client, "mixed")


def test_a_failed_node_of_a_fused_run_leaves_what_it_read_intact(client):
    import jax.numpy as jnp
    d = devices(2, host=0)
    mesh = zp.Mesh(np.array(d, dtype=object), ("i",))
    sharded = zp.jit(lambda x: x * 3., mesh=mesh, in_specs=zp.P("i"), out_specs=zp.P("i"))
    huge = zp.jit(lambda x: jnp.broadcast_to(x.sum(), (1 << 40,)), mesh=mesh, in_specs=zp.P("i"),
                  out_specs=zp.P())
    whole = zp.jit(lambda x: x.sum() + x, mesh=mesh, in_specs=zp.P(), out_specs=zp.P())

    @zp.program
    def partly(v):
        a = sharded(v)
        return huge(a), whole(a)      # the first fails; the second reads a in another sharding
    for k in range(3):
        bad, ok = partly(np.arange(4.) + k)
        a = (np.arange(4.) + k) * 3.
        np.testing.assert_array_equal(ok.result(timeout=60), a.sum() + a)
        with pytest.raises(zp.RemoteError, match="RESOURCE_EXHAUSTED"):
            bad.result(timeout=60)
    assert _fused_records(client, "partly")


def test_a_node_that_reads_a_client_value_twice(client):
    d = devices(2, host=0)
    add = zp.pmap(lambda x, y: x + y, devices=d)
    inc = zp.pmap(lambda x: x + 1., devices=d)

    @zp.program
    def twice(v):
        return add(v, v), add(inc(v), v)
    for k in range(4):
        v = np.array([1., 2.]) + k
        a, b = twice(v)
        np.testing.assert_array_equal(a.result(timeout=60), 2 * v)
        np.testing.assert_array_equal(b.result(timeout=60), 2 * v + 1)
    assert _fused_records(client, "twice")


def test_a_node_whose_failed_input_comes_first_does_not_wait(client):
    """In a fused run, a node that reads a failed value and then an
    intermediate fails at once with the root cause (it used to wait for the
    intermediate in the store, which a fused run does not fill, for 300 s)."""
    import jax.numpy as jnp
    d = devices(1)
    huge = zp.pmap(lambda x: jnp.broadcast_to(x, (1 << 40,)), devices=d)
    inc = zp.pmap(lambda x: x + 1., devices=d)
    comb = zp.pmap(lambda x, y: x[:1] + y, devices=d)

    @zp.program
    def failing_first(v):
        b = inc(v)
        return comb(huge(v), b), inc(b)
    for k in range(3):
        bad, ok = failing_first(np.full(1, float(k)))
        np.testing.assert_array_equal(ok.result(timeout=20), [k + 2.])
        with pytest.raises(zp.RemoteError, match="RESOURCE_EXHAUSTED"):
            bad.result(timeout=20)
    assert _fused_records(client, "failing_first")


def test_a_value_returned_twice_is_one_future(client):
    inc = zp.pmap(lambda x: x + 1., devices=devices(2, host=0))

    @zp.program
    def same(v):
        a = inc(v)
        return a, a
    for k in range(3):
        x, y = same(np.full(2, float(k)))
        assert x is y
        del x
        gc.collect()
        np.testing.assert_array_equal(y.result(timeout=30), [k + 1.] * 2)


def test_a_sequential_node_does_not_read_a_copy_a_waiting_node_is_to_make(client):
    """Sequential: ``n1`` waits for ``a`` and is to copy x to island 0; ``n2``
    reads x there too and waits for nothing, so it goes first. It moves x
    itself (it used to read the copy n1 had not made, which sat behind it on
    the worker: it waited 300 s)."""
    d0, d1 = devices(1, island=0), devices(1, island=1)
    on1 = zp.pmap(lambda x: x + 1., devices=d1)
    add0 = zp.pmap(lambda x, y: x + y, devices=d0)
    dbl0 = zp.pmap(lambda x: x * 2., devices=d0)

    @zp.program(dispatch="sequential")
    def p(x):
        a = on1(x)
        return add0(x, a), dbl0(x)
    for k in range(2):
        x = on1(np.full(1, float(k)))            # lives on island 1
        n1, n2 = p(x)
        np.testing.assert_array_equal(n2.result(timeout=30), [2. * (k + 1)])
        np.testing.assert_array_equal(n1.result(timeout=30), [2. * (k + 1) + 1])


def test_a_call_reads_its_inputs_as_they_were_when_it_was_made(client, monkeypatch):
    """Client values go to the workers later, from the client's I/O thread:
    changing an array after the call (a reused input buffer) must not change
    what the call reads. Puts are held here until the array has changed."""
    from zpath.client.connection import Client

    held = []
    send = Client.put
    monkeypatch.setattr(Client, "put", lambda self, *a: held.append((self, a)))
    d = devices(2)
    ident = zp.pmap(lambda x: x + 0., devices=d)
    add = zp.pmap(lambda x, y: x + y, devices=d)
    x = np.ones((2, 1000))
    out = ident(x)
    base = np.ones((2, 1000))
    seen = np.broadcast_to(base, base.shape)      # read-only, yet it changes with base
    out_view = ident(seen)
    const = np.array([10., 20.])

    @zp.program
    def p(v):
        return add(ident(v), const)
    v = np.ones(2)
    prog_out = p(v)
    x[:] = 7.
    base[:] = 7.
    v[:] = 7.
    const[:] = 7.        # as with jax.jit, a constant is the value it had when traced
    monkeypatch.setattr(Client, "put", send)
    assert len(held) >= 3
    for self_, a in held:
        send(self_, *a)
    np.testing.assert_array_equal(out.result(timeout=60), np.ones((2, 1000)))
    np.testing.assert_array_equal(out_view.result(timeout=60), np.ones((2, 1000)))
    np.testing.assert_array_equal(prog_out.result(timeout=60), [11., 21.])
    np.testing.assert_array_equal(p(np.ones(2)).result(timeout=60), [11., 21.])


def test_a_program_too_large_for_one_message_fails_where_it_is_called(client, monkeypatch):
    """The controller refuses a message over codec.MAX_BODY_BYTES; a program
    that large fails at the call, before its client values are put (they
    would stay on the workers, unknown to the controller)."""
    d = devices(2)
    inc = zp.pmap(lambda x: x + 1., devices=d)

    def body(v):
        for _ in range(20):
            v = inc(v)
        return v
    wait_for(client, empty)
    monkeypatch.setattr(codec, "MAX_BODY_BYTES", 2000)     # here only: the controller keeps 16 MiB
    progs = [zp.program(body, dispatch=dispatch) for dispatch in ("parallel", "sequential")]
    for p in progs:
        with pytest.raises(zp.ZpathError, match="split it into smaller programs"):
            p(np.arange(2.))
    monkeypatch.undo()
    # nothing reached a worker: once the stores report a value made after the
    # failures (reports come every second), they hold exactly its two shards
    marker = inc(np.arange(2.))
    np.testing.assert_array_equal(marker.result(timeout=60), [1., 2.])
    wait_for(client, lambda s: (sum(n for n, _ in s.values()), sum(b for _, b in s.values())) == (2, 8))
    del marker
    wait_for(client, empty)
    for p in progs:
        np.testing.assert_array_equal(p(np.arange(2.)).result(timeout=60), [20., 21.])
