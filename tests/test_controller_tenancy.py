"""The controller's dispatch path under multi-tenancy, in process: a
ControllerCore driven by hand with fake workers and clients and a fake clock
(messages go through ``handle`` and what it returns is recorded; every state
is checked with ``validate_state``). Covers parked nodes released in long chains,
nodes abandoned while they wait, memory-limit waiting, and clients that leave;
and the socket loop's batching around it."""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import logging
import threading
import types
from typing import Any, Callable

import pytest

from zpath.config import ControllerConfig
from zpath.controller.core import ControllerCore, Effect, Send
from zpath.controller import server
from zpath.controller.server import Controller
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)


class Blob(bytes):
    @property
    def nbytes(self) -> int:
        return len(self)


class Rig:
    def __init__(self, hosts=((0, 1),), window_ms: float = 20.0, solo_window_ms: float | None = None,
                 **config: Any) -> None:
        """``hosts``: (island, devices) per host; the solo window is the
        controller's default unless given."""
        extra = {} if solo_window_ms is None else {"solo_window_ms": solo_window_ms}
        self.config = ControllerConfig(policy="share", window_ms=window_ms, **extra, **config)
        self.c = ControllerCore(self.config)
        self.now = 1000.0                  # the fake clock
        self.log: list[tuple[bytes, m.Record]] = []
        self.effects: list[Effect] = []
        self.ids = itertools.count(1)
        for n, (island, ndev) in enumerate(hosts):
            self.handle(f"w{n}".encode(), m.RegisterWorker(
                f"h{n}", island, f"tcp://x:{n}", 1, "cpu", ndev, PROTOCOL_VERSION, list(range(ndev)),
                "", 0, 1, f"machine{n}", "", ""))
        self.programs = {}
        for name in ("f", "g"):
            blob = Blob(name.encode())
            self.programs[name] = (hashlib.sha256(blob).hexdigest(), blob)

    def record(self, effects: list[Effect]) -> None:
        """Record what the core decided; go on while it is busy; check its state."""
        while True:
            self.effects += effects
            self.log += [(e.ident, e.msg) for e in effects if isinstance(e, Send)]
            self.c.validate_state()
            if not self.c.busy:
                return
            effects = self.c.resume(self.now)

    def handle(self, ident: bytes, msg: m.Record, buffers=()) -> None:
        self.record(self.c.handle(self.now, ident, next(self.ids), msg, list(buffers)))

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call one of the core's internal events (e.g. a host lost) and record it."""
        fn(*args)
        self.record(self.c._take())

    def tick(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.record(self.c.tick(self.now))

    def client(self, name: str, shared: bool = False) -> tuple[bytes, int]:
        ident = name.encode()
        self.handle(ident, m.Hello(name, PROTOCOL_VERSION, 1.0, b"", shared))
        for digest, blob in self.programs.values():
            self.handle(ident, m.RegisterProgram(digest, "p"), [blob])
        return ident, self.c.peers[ident].id

    def new_id(self, ident: bytes) -> int:
        return self.c.peers[ident].id << 32 | next(self.ids)

    def call(self, ident: bytes, device: int, inp: int | None = None, program: str = "f",
             width: int = 4) -> tuple[m.Call, int]:
        """A one-device call of float32[1, width] reading ``inp`` (None: a new put value)."""
        av = m.Aval([1, width], "float32")
        put = inp is None
        inp = self.new_id(ident) if put else inp
        out = self.new_id(ident)
        return m.Call(next(self.ids), self.programs[program][0], [1], ["i"], [device],
                      [m.CallInput(inp, av, [None, None], put)], [m.CallOutput(out, av, [None, None])]), out

    def executes(self, since: int = 0) -> list[m.Execute]:
        return [x for _, x in self.log[since:] if isinstance(x, m.Execute)]

    def failed(self, ident: bytes) -> set[int]:
        return {b for i, x in self.log if i == ident and isinstance(x, m.CallFailed) for b in x.buffers}

    def finish(self, exec_id: int, seconds: float = 0.001) -> None:
        for h in list(self.c.in_flight[exec_id].hosts):
            self.handle(self.c.worker_ident[h], m.ExecDone(exec_id, None, 1000.0, 1000.0 + seconds))

    def drain(self) -> None:
        while self.c.in_flight:
            self.finish(next(iter(self.c.in_flight)))

    def close(self) -> None:
        pass

    def idle(self) -> bool:
        c = self.c
        return not (c.in_flight or c.waiters or c.tenants.queued() or c.pinned or c.deferred
                    or c.memory_waiting or c.parked_outputs)


@pytest.fixture
def make_rig():
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        rigs.append(Rig(**kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def _fill_window(rig: Rig, device: int) -> bytes:
    """Another client's long computations take device ``device``'s window."""
    b, _ = rig.client("busy")
    rig.c.tenants._cost[(rig.programs["g"][0], (device,))] = 1.0
    for _ in range(2):
        rig.handle(b, rig.call(b, device, program="g")[0])
    return b


def test_a_long_held_chain_is_released_without_recursion(make_rig):
    rig = make_rig()
    _fill_window(rig, 0)
    a, ca = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6
    calls, prev = [], None
    for _ in range(3000):                 # each node reads the last: all held behind the first
        call, prev = rig.call(a, 0, prev)
        calls.append(call)
    rig.handle(a, m.Program(1, "chain", "parallel", calls, []))
    assert rig.c._queued(ca) == 3000
    mark = len(rig.log)
    rig.drain()
    assert [x.outputs[0].buffer for x in rig.executes(mark)] == [c.outputs[0].buffer for c in calls]
    assert rig.c._queued(ca) == 0 and not rig.failed(a)


def test_what_one_event_frees_on_a_host_goes_as_one_free_after_its_other_messages(make_rig):
    """Op-by-op calls held behind another client's window, each released by
    the client once the next reads it (``x = f(x)``): when they go, in one
    event, each frees what the one before read, and the host gets one Free."""
    rig = make_rig()
    busy = _fill_window(rig, 0)
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6
    first, prev = rig.call(a, 0)
    rig.handle(a, first)
    rig.drain()                 # (the busy client's two go, and a's first)
    _fill_window(rig, 0)
    calls, released = [], []
    for _ in range(10):
        call, out = rig.call(a, 0, prev)
        rig.handle(a, call)
        rig.handle(a, m.Release([prev]))
        calls.append(call)
        released.append(prev)
        prev = out
    assert not [x for _, x in rig.log if isinstance(x, m.Free) and set(x.buffers) & set(released)]
    mark = len(rig.log)
    frees = []
    for exec_id in [x for x, info in rig.c.in_flight.items() if info.client_ident == busy]:
        start = len(rig.log)
        rig.finish(exec_id)
        event = rig.log[start:]
        mine = [(to, x.buffers) for to, x in event if isinstance(x, m.Free)]
        assert len(mine) <= 1 and (not mine or isinstance(event[-1][1], m.Free))   # after its Executes
        frees += mine
    assert [x.outputs[0].buffer for x in rig.executes(mark)] == [c.outputs[0].buffer for c in calls]
    assert [to for to, _ in frees] == [b"w0"] * len(frees) and len(frees) < len(released)
    assert [b for _, bs in frees for b in bs] == released
    rig.drain()
    rig.handle(a, m.Release([prev]))
    assert rig.idle()


def test_nodes_of_a_lost_host_fail_in_a_long_cascade(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, ca = rig.client("a")
    call, x = rig.call(a, 1)                  # x lives on host 1 (island 1)
    rig.handle(a, call)
    rig.drain()
    _fill_window(rig, 0)
    calls, prev = [], x
    for _ in range(2000):
        call, prev = rig.call(a, 0, prev)
        calls.append(call)
    rig.handle(a, m.Program(1, "chain", "parallel", calls, []))
    rig.run(rig.c._host_lost, 1, "test")
    rig.drain()
    assert {c.outputs[0].buffer for c in calls} <= rig.failed(a)
    assert rig.c._queued(ca) == 0
    assert all(x.outputs[0].buffer not in {c.outputs[0].buffer for c in calls} for x in rig.executes())
    # the client and the other worker hear of it (the worker unmaps what it kept for it)
    down = {i for i, x in rig.log if isinstance(x, m.HostDown) and x.rank == 1}
    assert down == {a, b"busy", b"w0"}


def test_a_sequential_node_after_an_abandoned_one_fails_instead_of_hanging(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, ca = rig.client("a")
    call, x = rig.call(a, 1)
    rig.handle(a, call)
    rig.drain()
    _fill_window(rig, 0)
    n1, o1 = rig.call(a, 0, x)                # reads x from host 1
    n2, o2 = rig.call(a, 0, o1)
    rig.handle(a, m.Program(1, "seq", "sequential", [n1, n2], [o1]))
    rig.run(rig.c._host_lost, 1, "test")
    rig.drain()
    assert {o1, o2} <= rig.failed(a)
    err = rig.c.directory.buffers[o2].error
    assert err is not None and err.kind == "HostLost"
    assert rig.c._queued(ca) == 0 and not rig.c.waiters and not rig.c.pinned


def test_memory_waiting_submissions_resume_in_order_while_the_tenant_queue_moves(make_rig):
    rig = make_rig(hosts=((0, 2),), window_ms=1e-6)      # window: 2 computations per device
    rig.c.memory_limit = 64
    a, ca = rig.client("a")
    held = []
    for _ in range(3):                                # a holds 3 x 16 bytes on device 0
        call, out = rig.call(a, 0)
        rig.handle(a, call)
        rig.drain()
        held.append(out)
    b, _ = rig.client("b")
    for _ in range(3):                                # b: 2 at the worker, 1 queued, on device 1
        rig.handle(b, rig.call(b, 1)[0])
    s1, o1 = rig.call(a, 0)                           # needs 32 bytes: waits
    s2, o2 = rig.call(a, 0, width=8)                  # needs 64: waits behind it
    rig.handle(a, s1)
    rig.handle(a, s2)
    assert len(rig.c.memory_waiting) == 2
    rig.handle(a, m.Release(held[:2]))                # 32 bytes free: s1 fits, then s2 does not
    assert rig.c.directory.device_bytes[0] == 32       # held[2] and s1's output (its put is freed)
    assert o1 in rig.c.directory.buffers and o2 not in rig.c.directory.buffers
    assert len(rig.c.memory_waiting) == 1 and rig.c.memory_waiting[0].calls[0] is s2
    rig.handle(a, m.Release([held[2], o1]))
    assert o2 in rig.c.directory.buffers and not rig.c.memory_waiting
    rig.drain()
    assert not rig.failed(a)


def test_a_client_that_leaves_has_nothing_run_afterwards(make_rig):
    rig = make_rig(window_ms=1e-6)
    a, ca = rig.client("a")
    call, x = rig.call(a, 0)
    rig.handle(a, call)
    rig.drain()
    b, _ = rig.client("b")
    for _ in range(3):
        rig.handle(b, rig.call(b, 0)[0])
    queued, o1 = rig.call(a, 0)                     # waits for its turn
    rig.handle(a, queued)
    rig.c.memory_limit = rig.c.directory.device_bytes[0] + 8
    waiting, o2 = rig.call(a, 0, x)                  # waits for memory
    rig.handle(a, waiting)
    held_call, o3 = rig.call(a, 0, o1)               # held: reads a queued node's output
    rig.handle(a, held_call)
    mark = len(rig.log)
    rig.handle(a, m.Goodbye("bye"))
    rig.drain()
    ran = {x.outputs[0].buffer for x in rig.executes(mark)}
    assert not ran & {o1, o2, o3}
    assert not any(buf.owner == ca for buf in rig.c.directory.buffers.values())
    assert rig.idle()


def test_bad_inputs_to_the_tenant_scheduler():
    from zpath.controller.scheduler import Ready, TenantScheduler
    s = TenantScheduler()
    with pytest.raises(KeyError, match="unknown client"):
        s.add(Ready(7, 0, (0,), "p", None))
    s.add_client(7, 1.0)
    s.add(Ready(7, 0, (0,), "p", None))
    s.remove_client(7)
    with pytest.raises(KeyError, match="unknown client"):
        s.add(Ready(7, 0, (0,), "p", None))
    assert dataclasses.is_dataclass(Ready)


@pytest.fixture
def loop_on():
    """A socket loop (server.Controller) around a rig's core."""
    loops: list[Controller] = []

    def make(rig: Rig) -> Controller:
        ctl = Controller(b"k" * 32, config=rig.config)
        rig.c.keys = ctl.keys            # the loop's keys check and sign for the rig's core
        ctl.core = rig.c
        loops.append(ctl)
        return ctl

    yield make
    for ctl in loops:
        ctl.sock.close(0)
        ctl.ctx.term()


def test_what_one_received_message_makes_the_controller_send_goes_out_as_one_batch_per_peer(
        make_rig, loop_on, caplog):
    rig = make_rig(hosts=((0, 2),))
    ctl = loop_on(rig)
    sent: list[tuple[bytes, list[m.Record]]] = []
    ctl.ep.send_batch = lambda sock, msgs, to=None, block=True, sign=None: \
        sent.append((to, [e[0] for e in msgs])) or []
    ctl.ep.send = lambda sock, msg, to=None, parent=0, buffers=(), msg_id=0, block=True, sign=None: \
        sent.append((to, [msg, len(buffers)]))
    a, _ = rig.client("a")
    sent.clear()
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    calls, prev = [], None
    for _ in range(40):
        call, prev = rig.call(a, 0, prev)
        calls.append(call)
    ctl._run(rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), []))
    # the program itself (it has a buffer) went at once; the first node is held
    # until the loop flushes, then goes on with the rest a slice at a time
    assert [(to, type(x[0])) for to, x in sent] == [(b"w0", m.RegisterProgram)]
    slices = 0
    while rig.c.busy:
        ctl._plan_slice()
        slices += 1
    # the nodes went out as they were planned, in groups that double (after
    # nodes 1, 2, 4, ..., 32), so the workers start while the rest is planned
    assert slices == 6
    assert [len(x) for _, x in sent[1:]] == [1, 1, 2, 4, 8, 16, 8]
    assert all(to == b"w0" for to, _ in sent)
    execs = [x for _, xs in sent[1:] for x in xs if isinstance(x, m.Execute)]
    assert len(execs) == 40 and [x.seq for x in execs] == sorted(x.seq for x in execs)
    rig.c.validate_state()
    # a single node is not flushed early: what handling its call sends goes together
    sent.clear()
    call, _ = rig.call(a, 0, prev)
    ctl._run(rig.c.handle(rig.now, a, 2, call, []))
    assert sent == []
    ctl._flush_out()
    assert len(sent) == 1 and any(isinstance(x, m.Execute) for x in sent[0][1])

    # a message with buffers goes at once, after what was held for that peer
    sent.clear()
    ctl._emit([Send(b"w0", m.Ping(1)), Send(a, m.Ping(2)), Send(b"w0", m.Ping(3), buffers=[b"x"])])
    assert sent == [(b"w0", [m.Ping(1)]), (b"w0", [m.Ping(3), 1])]
    ctl._flush_out()
    assert sent[2:] == [(a, [m.Ping(2)])] and ctl._out == {}
    # what is flushed alone goes alone
    ctl._emit([Send(a, m.Ping(4))])
    ctl._flush_out()
    assert sent[3] == (a, [m.Ping(4)])
    # a message that cannot be encoded fails where it is emitted (with a log
    # line), as it would unbatched; what was held with it still goes
    with caplog.at_level(logging.ERROR):
        ctl._emit([Send(a, m.Ping(5)), Send(a, m.Error("x", "\udcff"))])
    assert "cannot encode Error" in caplog.text and "UnicodeEncodeError" in caplog.text
    ctl._flush_out()
    assert sent[4:] == [(a, [m.Ping(5)])]


def test_op_by_op_calls_waiting_together_go_to_a_host_in_few_batches_and_a_lone_one_at_once(
        make_rig, loop_on, monkeypatch):
    """Calls waiting together (one received Batch, or more messages readable)
    are handled before one flush, at most COALESCE_CALLS of them and
    COALESCE_S after the first; a call alone goes when it is handled."""
    import collections

    import zmq

    from zpath.net import codec

    rig = make_rig()
    ctl = loop_on(rig)
    sent: list[tuple[bytes, list[m.Record]]] = []
    ctl.ep.send_batch = lambda sock, msgs, to=None, block=True, sign=None: \
        sent.append((to, [e[0] for e in msgs])) or []
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    inbox: collections.deque = collections.deque()     # what the socket holds: (ident, message)

    def recv_frames(sock, router=False, block=True):
        if not inbox:
            raise zmq.Again()
        return inbox[0][0], []

    def decode(frames, ident=None, keys=None):
        msg = inbox.popleft()[1]
        if type(msg) is list:            # a client's Batch of calls
            return None, codec.Batched([(codec.Header(PROTOCOL_VERSION, c.TYPE, next(rig.ids), 0, "a"), c)
                                        for c in msg]), []
        return codec.Header(PROTOCOL_VERSION, msg.TYPE, next(rig.ids), 0, "a"), msg, []

    monkeypatch.setattr(ctl.ep, "recv_frames", recv_frames)
    monkeypatch.setattr(ctl.ep, "decode", decode)
    monkeypatch.setattr(server, "readable", lambda sock: bool(inbox))
    prev = None

    def chain(n: int) -> list[m.Call]:
        nonlocal prev
        calls = []
        for _ in range(n):
            call, prev = rig.call(a, 0, prev)
            calls.append(call)
        return calls

    def executes() -> list[list[int]]:
        """The outputs of the Executes of each batch sent (all to the one host)."""
        assert all(to == b"w0" for to, _ in sent)
        return [[x.outputs[0].buffer for x in msgs if isinstance(x, m.Execute)] for _, msgs in sent]

    def outs(calls: list[m.Call]) -> list[int]:
        return [c.outputs[0].buffer for c in calls]

    monkeypatch.setattr(server, "COALESCE_S", 60.0)     # the count bounds it
    calls = chain(20)
    inbox.append((a, calls))
    sent.clear()
    ctl._recv_all()
    assert executes() == [outs(calls[:8]), outs(calls[8:16]), outs(calls[16:])]
    # three received messages of two calls each: one batch
    more = [chain(2) for _ in range(3)]
    inbox.extend((a, c) for c in more)
    sent.clear()
    ctl._recv_all()
    assert executes() == [outs(more[0] + more[1] + more[2])]
    # calls of a kept form (CallAgain) alike, each on the timeline as a call
    first = [dataclasses.replace(chain(1)[0], keep=1)]
    inbox.append((a, first))
    sent.clear()
    ctl._recv_all()
    assert executes() == [outs(first)]
    again = [chain(2) for _ in range(3)]
    inbox.extend((a, [m.CallAgain(c.call_id, 1, [c.inputs[0].buffer], [c.outputs[0].buffer]) for c in two])
                 for two in again)
    planned = len(rig.c.events)
    sent.clear()
    ctl._recv_all()
    assert executes() == [outs(again[0] + again[1] + again[2])]
    assert [(e[0], e[2]) for e in list(rig.c.events)[planned:]] == [("plan", "p")] * 6
    # a call alone is not held: it went when _recv_all returned
    lone = chain(1)
    inbox.append((a, lone))
    sent.clear()
    ctl._recv_all()
    assert executes() == [outs(lone)]
    # the time bound: past COALESCE_S from the first held call, each flushes
    monkeypatch.setattr(server, "COALESCE_S", 0.0)
    calls = chain(5)
    inbox.append((a, calls))
    sent.clear()
    ctl._recv_all()
    assert executes() == [[o] for o in outs(calls)]
    seqs = [x.seq for _, msgs in sent for x in msgs if isinstance(x, m.Execute)]
    assert seqs == sorted(seqs)
    # the bound holds whatever follows a held call (other messages readable):
    # a call handled at once, then messages that take past COALESCE_S
    monkeypatch.setattr(server, "COALESCE_S", 0.5)
    clock = iter([0.0, 0.0])          # the call's handling; then 10 s later
    monkeypatch.setattr(server, "time", types.SimpleNamespace(time=lambda: next(clock, 10.0),
                                                              monotonic=lambda: rig.now))
    lone = chain(1)
    inbox.extend([(a, lone), (a, m.Ping(1)), (a, m.Ping(2))])
    sent.clear()
    ctl._recv_all()
    assert [(to, [type(x) for x in msgs]) for to, msgs in sent] == \
        [(b"w0", [m.Execute]), (a, [m.Pong]), (a, [m.Pong])]
    rig.c.validate_state()


def test_a_batch_through_the_controller_socket_each_item_handled_and_a_bad_one_answered(make_rig, loop_on):
    import zmq

    from zpath.net import codec
    from zpath.net.transport import Endpoint, unbatched

    rig = make_rig()
    ctl = loop_on(rig)                       # the real send, over the socket
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ctl.address)
    try:
        ep = Endpoint(b"k" * 32, "client:t", signer=codec.CLIENTS)
        hello = codec.pack_body(m.Hello("t", PROTOCOL_VERSION, 1.0))
        items = [(m.Hello.TYPE, 11, 0, hello),
                 (m.StatusRequest.TYPE, 12, 0, b"\xc1"),               # does not decode
                 (m.StatusRequest.TYPE, 13, 0, codec.pack_body(m.StatusRequest(False)))]
        ep.send(dealer, m.Batch(items))
        replies = []
        deadline = 50
        while len(replies) < 3 and deadline:
            ctl._recv_all()
            while dealer.poll(20):
                _, header, got, buffers = ep.recv(dealer)
                replies += [(h.parent, r) for h, r, _ in unbatched(header, got, buffers)]
            deadline -= 1
        by_parent = {p: type(r) for p, r in replies}
        assert by_parent == {11: m.Welcome, 12: m.Error, 13: m.Status}, replies
        assert [r for p, r in replies if p == 12][0].code == "protocol"
        rig.c.validate_state()
    finally:
        dealer.close()
        ctx.term()


def test_a_held_node_reading_one_buffer_twice_whose_release_was_deferred(make_rig):
    """A sequential program under a memory limit: node 2 reads x twice and waits
    for node 1; x's release (its last reader is planned) is deferred while node 2
    is held. When node 1 finishes, node 2 goes and x is freed once: no error."""
    rig = make_rig()
    rig.c.memory_limit = 10 ** 9
    a, _ = rig.client("a")
    av = m.Aval([1, 4], "float32")
    c1, x = rig.call(a, 0)
    y = rig.new_id(a)
    c2 = m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [0],
                [m.CallInput(x, av, [None, None], False), m.CallInput(x, av, [None, None], False)],
                [m.CallOutput(y, av, [None, None])])
    rig.handle(a, m.Program(1, "seq", "sequential", [c1, c2], [x]))
    assert len(rig.executes()) == 1 and x in rig.c.deferred
    rig.finish(next(iter(rig.c.in_flight)))
    assert len(rig.executes()) == 2
    assert x not in rig.c.pinned and x not in rig.c.deferred and x not in rig.c.directory.buffers
    frees = [b for _, msg in rig.log if isinstance(msg, m.Free) for b in msg.buffers]
    assert frees.count(x) == 1


def held_under_limit(rig: Rig, limit: int) -> tuple[bytes, int]:
    """A client was_parked one 16-byte value on device 0, then a memory limit."""
    a, _ = rig.client("a")
    c0, value = rig.call(a, 0)
    rig.handle(a, c0)
    rig.drain()
    rig.c.memory_limit = limit
    return a, value


def test_a_sequential_program_resumed_after_a_memory_wait_does_not_wait_on_a_finished_node(make_rig):
    """n1 is sent, n2 waits for memory; n1 finishes; a release lets n2 go: it
    must not wait for n1 to finish again."""
    rig = make_rig()
    a, h = held_under_limit(rig, 32)
    n1, o1 = rig.call(a, 0, h)
    n2, o2 = rig.call(a, 0, o1)
    rig.handle(a, m.Program(1, "seq", "sequential", [n1, n2], [o1]))
    assert len(rig.executes()) == 2 and len(rig.c.memory_waiting) == 1     # c0, n1
    rig.drain()                              # n1 finishes while n2 waits
    rig.handle(a, m.Release([h]))            # room for n2
    assert len(rig.executes()) == 3
    rig.drain()
    rig.handle(a, m.Release([o2]))
    assert rig.idle()


def test_a_queued_call_that_reads_a_dropped_value_goes_ahead_of_a_waiting_head(make_rig):
    """`big` waits for memory that z holds; g(z) is queued behind it and z's
    future is dropped, so z lives until g is planned. g depends on nothing that
    waits, so it goes ahead; then z is freed and big fits."""
    rig = make_rig()
    a, z = held_under_limit(rig, 40)
    big, ob = rig.call(a, 0)                 # 32 more bytes (16 held): waits
    rig.handle(a, big)
    g, og = rig.call(a, 0, z)                # reads z: queued behind big
    rig.handle(a, g)
    rig.handle(a, m.Release([z]))            # del z
    rig.drain()
    assert len(rig.executes()) == 2 and len(rig.c.memory_waiting) == 1     # c0, g; big waits
    rig.handle(a, m.Release([og]))           # z and g's output freed: big fits
    assert len(rig.executes()) == 3 and not rig.c.memory_waiting
    rig.drain()
    rig.handle(a, m.Release([ob]))
    assert rig.idle()


def test_workers_may_hold_reports_only_of_a_client_alone_and_of_nothing_waited_for(make_rig):
    rig = make_rig(solo_window_ms=100.0)
    short = make_rig(solo_window_ms=60.0, alone_window_ms=60.0)     # too short for the 50 ms hold: never
    sa, _ = short.client("a")
    short.c.tenants._cost[(short.programs["f"][0], (0,))] = 0.001
    mark = len(short.log)
    short.handle(sa, short.call(sa, 0)[0])
    assert [e.hold for e in short.executes(mark)] == [False]
    # the same solo window with the alone window long enough: a client that is
    # the only one connected may hold, and not once another has connected
    alone = make_rig(solo_window_ms=60.0, alone_window_ms=500.0)
    la, _ = alone.client("a")
    alone.c.tenants._cost[(alone.programs["f"][0], (0,))] = 0.001
    mark = len(alone.log)
    alone.handle(la, alone.call(la, 0)[0])
    alone.drain()
    alone.client("b")
    alone.handle(la, alone.call(la, 0)[0])
    assert [e.hold for e in alone.executes(mark)] == [True, False]
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 0.001      # measured
    mark = len(rig.log)
    call, x = rig.call(a, 0)
    rig.handle(a, call)
    assert [e.hold for e in rig.executes(mark)] == [True]          # alone, parallel
    rig.drain()
    # a sequential program's nodes: the next waits for the last one's ExecDone
    mark = len(rig.log)
    c1, y = rig.call(a, 0, x)
    c2, _ = rig.call(a, 0, y)
    rig.handle(a, m.Program(2, "seq", "sequential", [c1, c2], []))
    rig.drain()
    assert [e.hold for e in rig.executes(mark)] == [False, False]
    # a second client: the island is shared (a used it less than a second ago)
    b, _ = rig.client("b")
    mark = len(rig.log)
    rig.handle(b, rig.call(b, 0)[0])
    rig.handle(a, rig.call(a, 0, x)[0])
    assert [e.hold for e in rig.executes(mark)] == [False, False]
    rig.drain()
    rig.now += 2.0                                                   # b has gone quiet
    mark = len(rig.log)
    rig.handle(a, rig.call(a, 0, x)[0])
    rig.drain()
    # under a device memory limit, calls may wait for what a run frees
    rig.c.memory_limit = 1 << 40
    rig.handle(a, rig.call(a, 0, x)[0])
    rig.drain()
    assert [e.hold for e in rig.executes(mark)] == [True, False]
    assert not rig.failed(a) and not rig.failed(b) and rig.idle()


def test_the_loop_runs_the_collectors_full_pass_it_held_back_when_idle():
    """The controller's process leaves the collector's full passes to its loop
    (server.main sets the threshold): the loop runs one once its poll times out
    with no computation in flight."""
    ctl = Controller(b"k" * 32, config=ControllerConfig(ping_interval_s=0.02))
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], server.FULL_GC_FORCED)
    loop = threading.Thread(target=ctl.serve_forever, daemon=True)
    full_pass = threading.Event()

    def on_collect(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2 and threading.current_thread() is loop:
            full_pass.set()

    gc.callbacks.append(on_collect)
    try:
        for _ in range(server.FULL_GC_AFTER):
            gc.collect(1)                   # young passes: each counts towards a full one
        assert gc.get_count()[2] >= server.FULL_GC_AFTER
        loop.start()
        assert full_pass.wait(20), "the idle loop ran no full pass"
        assert gc.get_count()[2] < server.FULL_GC_AFTER
    finally:
        gc.callbacks.remove(on_collect)
        ctl.stop()
        loop.join(10)
        gc.set_threshold(*before)
    assert not loop.is_alive()


def test_only_a_client_connected_alone_that_carries_no_others_work_gets_the_alone_window(make_rig):
    """The alone window goes to the one client connected; a client that says
    it carries others' work (``Hello.shared``: the IFRT proxy) keeps the solo
    window even alone, and a second client's Hello takes the island back to
    it before that client sends anything; its leaving gives it back."""
    rig = make_rig(solo_window_ms=100.0, alone_window_ms=400.0)
    a, _ = rig.client("a")
    rig.handle(a, rig.call(a, 0)[0])
    assert rig.c.tenants.window(0) == rig.c.tenants.window(0, rig.c.peers[a].id) == 0.4
    b, _ = rig.client("b")
    assert rig.c.tenants.window(0) == 0.1
    rig.handle(b, m.Goodbye("done"))
    assert rig.c.tenants.window(0) == 0.4
    rig.c.validate_state()
    proxy = make_rig(solo_window_ms=100.0, alone_window_ms=400.0)
    p, _ = proxy.client("ifrt-proxy", shared=True)
    proxy.handle(p, proxy.call(p, 0)[0])
    assert proxy.c.tenants.window(0) == 0.1
    proxy.c.validate_state()
