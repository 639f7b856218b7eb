"""The fast path of a repeated op-by-op call (zpath/controller/fastcall.py),
in process: the same events go to a core with the fast path and to one with
the general path only, and both must decide the same (every effect, in
order, and the state after); the fast path must be taken for repeats and
left for whatever changed. Cores are checked with ``validate_state`` after
every event (the Rig of test_controller_tenancy)."""
from __future__ import annotations

from typing import Any

import pytest

from zpath.errors import ErrorKind
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION
from tests.test_controller_tenancy import make_rig  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

AVAL = m.Aval([2], "float32")


def _rigs(make_rig):
    """Two cores, each with two hosts of one island (one device each, one JAX
    runtime): with the fast path, and with the general path only; the window
    of a client alone on the island is the solo one whether or not it is the
    only client connected (so a chain of 150 parks most of its calls)."""
    rigs = []
    for fast in (True, False):
        rig = make_rig(hosts=(), alone_window_ms=100.0)
        for n in range(2):
            rig.handle(b"w%d" % n, m.RegisterWorker(f"h{n}", 0, f"tcp://x:{n}", 1, "cpu", 1, PROTOCOL_VERSION,
                                                    [n], "127.0.0.1:1", n, 2, "machine", "", "", n))
        if not fast:
            rig.c._fast_call = lambda peer, call: False
        rigs.append(rig)
    return rigs


def _spmd(rig, ident: bytes, inp: int | None = None, aval: m.Aval = AVAL, spec=("i",), program: str = "f",
          out: int | None = None, devices=(0, 1)) -> tuple[m.Call, int]:
    """A 2-device SPMD call of ``aval`` reading ``inp`` (None: a new value put)."""
    put = inp is None
    inp = rig.new_id(ident) if put else inp
    out = rig.new_id(ident) if out is None else out
    return m.Call(next(rig.ids), rig.programs[program][0], [2], ["i"], list(devices),
                  [m.CallInput(inp, aval, list(spec), put)], [m.CallOutput(out, aval, list(spec))]), out


def _chain(rig, ident: bytes, n: int, prev: int | None = None) -> int:
    """``x = f(x)`` ``n`` times, the previous value released, one computation
    left in flight (the hosts finish the one before), as island_dispatch.py -O."""
    for _ in range(n):
        call, out = _spmd(rig, ident, prev)
        rig.handle(ident, call)
        if prev is not None:
            rig.handle(ident, m.Release([prev]))
        for exec_id in sorted(rig.c.in_flight)[:-1]:
            rig.finish(exec_id)
        prev = out
    return prev


def _state(rig) -> tuple:
    c = rig.c
    return ({b: (buf.shape, buf.dtype, buf.owner, buf.layouts, buf.error) for b, buf in c.directory.buffers.items()},
            dict(c.directory.device_bytes.items()), sorted(c.in_flight), dict(c.scheduler.next_seq),
            dict(c.tenants.used), dict(c.tenants._vt), c.tenants.queued(), c.calls, c.send_budget)


def _effects(rig) -> list:
    """What the core decided, in order (a Welcome's session key is random)."""
    return [(e.ident, e.msg.client_id, e.parent) if type(e.msg) is m.Welcome else e for e in rig.effects]


def _same(fast, slow) -> None:
    assert _effects(fast) == _effects(slow)
    assert _state(fast) == _state(slow)


def test_repeated_calls_take_the_fast_path_with_the_general_paths_effects(make_rig):
    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, _ = rig.client("a")
        last = _chain(rig, a, 40)
        rig.handle(a, m.Release([last]))
        rig.drain()
    _same(fast, slow)
    # the first call (a value put) and the second (an input made before) are
    # learnt; every later one is a repeat
    assert (fast.c.fast_sent, slow.c.fast_sent) == (38, 0)
    assert len(fast.executes()) == 80
    assert fast.idle() and not fast.c.directory.buffers
    # a second chain starts with a value put again: it repeats too
    for rig in (fast, slow):
        _chain(rig, a, 5)
        rig.drain()
    _same(fast, slow)
    assert fast.c.fast_sent == 38 + 5


def test_a_chain_sent_ahead_of_its_hosts_is_planned_fast_and_waits_as_before(make_rig):
    """The client posts a whole chain at once (as island_dispatch.py -O
    does): beyond the tenant scheduler's window each call waits for the one
    it reads to be sent; the fast path plans those and parks them as the
    general path does, and sends the others at once."""
    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, _ = rig.client("a")
        rig.handle(a, m.Release([_chain(rig, a, 2)]))     # learnt (and the cost measured)
        rig.drain()
        for _ in range(2):
            prev = None
            for _ in range(150):
                call, out = _spmd(rig, a, prev)
                rig.handle(a, call)
                if prev is not None:
                    rig.handle(a, m.Release([prev]))
                prev = out
            assert rig.c.waiters and rig.c.pinned and rig.c.deferred      # parked, releases deferred
            rig.handle(a, m.Release([prev]))
            rig.drain()
        assert rig.idle() and not rig.c.directory.buffers
    _same(fast, slow)
    assert fast.c.fast_planned >= 100 and fast.c.fast_sent >= 100
    assert fast.c.fast_planned + fast.c.fast_sent == 300 and slow.c.fast_planned == 0
    # each parked one went with the Execute made when it was planned
    assert fast.c.fast_unparked == fast.c.fast_planned and not fast.c.fast_parked


def test_what_changed_since_goes_the_general_path_with_its_effects(make_rig):
    """Each step changes one thing the plan or its checks depend on: the fast
    path is left (its count does not move) and the general path decides."""
    fast, slow = _rigs(make_rig)
    counts = []
    for rig in (fast, slow):
        a, _ = rig.client("a")
        b, _ = rig.client("b")
        x = _chain(rig, a, 3)
        steps = []
        # another client reads a's buffer: not its own (NOT_FOUND)
        rig.handle(b, _spmd(rig, b, x)[0])
        steps.append(rig.c.fast_sent)
        # an output id in use, and one of another client
        rig.handle(a, _spmd(rig, a, x, out=x)[0])
        rig.handle(a, _spmd(rig, a, x, out=rig.new_id(b))[0])
        steps.append(rig.c.fast_sent)
        # another shape: planned anew (and learnt)
        call, y = _spmd(rig, a, aval=m.Aval([4], "float32"))
        rig.handle(a, call)
        steps.append(rig.c.fast_sent)
        # x gets a second layout (read replicated): its reader is planned anew
        call, _ = _spmd(rig, a, x, spec=(None,), program="g")
        rig.handle(a, call)
        call, x2 = _spmd(rig, a, x)
        rig.handle(a, call)
        steps.append(rig.c.fast_sent)
        rig.drain()
        # an input that failed
        rig.c.directory.poison([x2], rig.c.peers[a].id, m.ErrorInfo(ErrorKind.REMOTE_ERROR, "boom", None, "", ""))
        rig.handle(a, _spmd(rig, a, x2)[0])
        steps.append(rig.c.fast_sent)
        # the tenant queue holds another client's work on the island: a's call
        # queues behind it
        rig.c.tenants._cost[(rig.programs["g"][0], (0, 1))] = 1.0
        for _ in range(3):
            rig.handle(b, _spmd(rig, b, program="g")[0])
        assert rig.c.tenants.queued() == 1
        rig.handle(a, _spmd(rig, a)[0])
        assert rig.c.tenants.queued() == 2
        steps.append(rig.c.fast_sent)
        rig.drain()
        # a repeat goes fast again
        z = _chain(rig, a, 2)
        steps.append(rig.c.fast_sent)
        rig.drain()
        # a sequential program's second node waits for its first to finish: a
        # call reading what it makes waits too (parked)
        n1, o1 = _spmd(rig, a, z)
        n2, o2 = _spmd(rig, a, o1)
        rig.handle(a, m.Program(1, "seq", "sequential", [n1, n2], [o1]))
        assert o2 in rig.c.parked_outputs and not rig.c.tenants.queued()
        call, o3 = _spmd(rig, a, o2)
        rig.handle(a, call)
        assert o3 in rig.c.parked_outputs
        steps.append(rig.c.fast_sent)
        rig.drain()
        # a host lost: the mapping changed, the call fails as planning fails it
        rig.run(rig.c._host_lost, 1, "test")
        call, out = _spmd(rig, a, z)
        rig.handle(a, call)
        call, out2 = _spmd(rig, a)           # (what it reads is put: nothing failed but the hosts)
        rig.handle(a, call)
        assert {out, out2} <= rig.failed(a) and not rig.c.in_flight
        steps.append(rig.c.fast_sent)
        counts.append(steps)
    _same(fast, slow)
    n = counts[0][0]
    assert n > 0 and counts[0] == [n, n, n, n, n, n + 1, n + 3, n + 3, n + 3] and counts[1] == [0] * 9
    failed = [(x.error.kind, x.error.message) for _, x in fast.log if isinstance(x, m.CallFailed)]
    assert [k for k, _ in failed[:4]] == [ErrorKind.CALL_FAILED] * 3 + [ErrorKind.REMOTE_ERROR]
    assert failed[-1][0] == ErrorKind.HOST_LOST        # (after the lost hosts' buffers)
    assert "is unknown" in failed[0][1] and "already exists" in failed[1][1] and "not this client's" in failed[2][1]


def test_a_host_lost_while_a_fast_call_runs_fails_it_as_before(make_rig):
    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, _ = rig.client("a")
        x = _chain(rig, a, 3)
        call, out = _spmd(rig, a, x)
        rig.handle(a, call)                  # in flight on both hosts
        rig.handle(b"w0", m.ExecDone(max(rig.c.in_flight), None, 1000.0, 1000.001))
        rig.run(rig.c._host_lost, 1, "test")
        assert out in rig.failed(a) and not rig.c.in_flight
        err = rig.c.directory.buffers[out].error
        assert err is not None and err.kind == ErrorKind.HOST_LOST
    _same(fast, slow)
    assert fast.c.fast_sent == 2


def test_a_client_that_leaves_is_forgotten_by_the_fast_path(make_rig):
    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, _ = rig.client("a")
        _chain(rig, a, 3)
        rig.handle(a, m.Goodbye("done"))
        rig.drain()
        a2, _ = rig.client("a")              # a new client: its own calls, learnt anew
        _chain(rig, a2, 3)
        rig.drain()
    _same(fast, slow)
    assert fast.c.fast_sent == 2


def test_parked_repeats_on_devices_in_another_order_fail_as_before_when_a_host_is_lost(make_rig):
    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, _ = rig.client("a")
        prev = None
        for _ in range(150):                 # (the first two learnt, the window's worth sent)
            call, prev = _spmd(rig, a, prev, devices=(1, 0))
            rig.handle(a, call)
        assert rig.c.waiters
        rig.run(rig.c._host_lost, 1, "test")
        rig.drain()
        assert prev in rig.failed(a) and rig.idle()
    _same(fast, slow)
    assert fast.c.fast_planned > 0


def test_parked_repeats_go_the_general_path_after_a_mapping_change_or_are_forgotten_with_their_client(make_rig):
    """A call the fast path planned and parked is sent with the Execute made
    then (``_fast_dispatch``) only while the mapping it was planned at holds:
    after a host registers meanwhile it goes the general path, with the same
    effects; a client that leaves takes its parked calls with it."""
    def park(rig: Any, name: str) -> tuple[bytes, int]:
        """A client whose chain of 150 repeats is mostly parked: it and the last."""
        client, _ = rig.client(name)
        rig.handle(client, m.Release([_chain(rig, client, 2)]))     # learnt (and the cost measured)
        rig.drain()
        prev = None
        for _ in range(150):
            call, prev = _spmd(rig, client, prev)
            rig.handle(client, call)
        assert rig.c.waiters
        return client, prev

    fast, slow = _rigs(make_rig)
    for rig in (fast, slow):
        a, prev = park(rig, "a")
        rig.handle(b"w2", m.RegisterWorker("h2", 1, "tcp://x:2", 1, "cpu", 1, PROTOCOL_VERSION, [0],
                                           "", 0, 1, "machine", "", "", 2))
        rig.handle(a, m.Release([prev]))
        rig.drain()
        assert rig.idle()
    _same(fast, slow)
    assert fast.c.fast_planned > 0 and fast.c.fast_unparked == 0 and not fast.c.fast_parked
    for rig in (fast, slow):
        b, _ = park(rig, "b")
        rig.handle(b, m.Goodbye("done"))
        rig.drain()
        assert rig.idle()
    _same(fast, slow)
    assert fast.c.fast_planned > 100 and not fast.c.fast_parked
