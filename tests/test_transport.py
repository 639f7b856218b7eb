"""Socket helpers: the outbox that hands messages to an I/O thread."""
from __future__ import annotations

import os
import select
import threading
import time
import types

import numpy as np
import pytest

from zpath.net import transport
from zpath.net.transport import Outbox, backoff

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slow_pipe_reads(monkeypatch):
    """Make the outbox's pipe reads slow, so producers run inside drain() and
    every interleaving of put() and drain() happens many times."""
    def slow_read(fd: int, n: int) -> bytes:
        time.sleep(0.0002)
        return os.read(fd, n)
    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    proxy.read = slow_read
    monkeypatch.setattr(transport, "os", proxy)


def test_outbox_never_strands_an_item(slow_pipe_reads):
    """Four producers race a consumer that sleeps in select() until woken. Every
    item must be drained; an item left behind with no wake byte would make the
    consumer time out (this is how two workers once waited on each other)."""
    box = Outbox()
    n_threads, per_thread = 4, 3000
    got: list[tuple] = []

    def produce(t: int) -> None:
        for i in range(per_thread):
            box.put(t, i)
            if i % 50 == 0:
                time.sleep(0.001)   # let the consumer catch up and sleep in select()

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    while len(got) < n_threads * per_thread:
        ready, _, _ = select.select([box.fd], [], [], 2.0)
        assert ready, f"stranded: {n_threads * per_thread - len(got)} items never woke the consumer"
        got.extend(box.drain())
    for th in threads:
        th.join()
    assert sorted(got) == sorted((t, i) for t in range(n_threads) for i in range(per_thread))
    # order is kept per producer
    for t in range(n_threads):
        assert [i for tt, i in got if tt == t] == list(range(per_thread))
    box.close()


def _readable(box: Outbox) -> bool:
    return bool(select.select([box.fd], [], [], 0)[0])


def test_outbox_drain_empties_a_pipe_of_many_wake_bytes() -> None:
    """Wakes from finalizers and signal handlers write a byte each, armed or
    not: one drain takes them all (it reads until a short read), so the next
    poll sleeps instead of waking at once."""
    box = Outbox()
    try:
        for _ in range(3 * 4096 + 5):
            box.wake()
        box.put("item")
        assert _readable(box)
        assert box.drain() == [("item",)]
        assert not _readable(box)
        box.put("next")      # still armed afresh by the next put
        assert _readable(box)
        assert box.drain() == [("next",)]
        assert not _readable(box)
    finally:
        box.close()


@pytest.fixture
def clocked_box(monkeypatch):
    """An Outbox on a clock the test moves (``clock[0]``, seconds)."""
    clock = [1000.0]
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    box = Outbox()
    yield clock, box
    box.close()


def test_outbox_holds_items_until_released_or_due(clocked_box):
    clock, box = clocked_box
    box.hold(("a",), 0.2)
    assert _readable(box)              # the first held item wakes the consumer
    assert box.held_timeout() == pytest.approx(0.2 - transport.DUE_SLACK_S)
    box.put("x")
    box.hold(("b",), 0.2)
    assert box.drain() == [("x",)]     # held ones are not due yet
    assert not _readable(box)          # a later held item does not wake it
    clock[0] += 0.2 - transport.DUE_SLACK_S / 2      # within the slack: due
    assert box.held_timeout() == 0.0
    box.put("y")
    assert box.drain() == [("a",), ("b",), ("y",)]   # held first, in order
    assert box.held_timeout() is None and box.drain() == []
    box.hold(("c",), 60.0)
    box.drain()
    box.release()
    assert _readable(box) and box.held_timeout() == 0.0
    assert box.drain() == [("c",)]
    box.release()                       # nothing held: no wake-up
    assert not _readable(box)
    box.hold(("d",), 60.0)
    box.hold(("e",), 60.0, release=True)   # goes now, with those held before it
    assert box.drain() == [("d",), ("e",)]


def test_outbox_a_shorter_hold_brings_the_deadline_of_those_held_before_forward(clocked_box):
    clock, box = clocked_box
    box.hold(("long",), 0.05)
    box.drain()                        # (clears the first item's wake-up)
    box.wait_until = clock[0] + 0.5    # the consumer sleeps past 2 ms
    clock[0] += 0.001
    box.hold(("short",), 0.002)
    assert _readable(box)              # woken for the earlier deadline
    assert box.held_timeout() == pytest.approx(0.002 - transport.DUE_SLACK_S)
    clock[0] += 0.002
    assert box.drain() == [("long",), ("short",)]
    box.hold(("a",), 0.002)
    box.hold(("b",), 0.05)             # a longer hold keeps the earlier deadline
    assert box.held_timeout() == pytest.approx(0.002 - transport.DUE_SLACK_S)


def test_outbox_wakes_for_a_held_item_only_if_the_consumer_would_sleep_past_it():
    box = Outbox()
    try:
        box.wait_until = time.monotonic() + 0.001     # it wakes before the deadline anyway
        box.hold(("a",), 60.0)
        assert not _readable(box)
        box.release()
        box.drain()
        box.wait_until = time.monotonic() + 120.0     # it would sleep past the deadline
        box.hold(("b",), 60.0)
        assert _readable(box)
    finally:
        box.close()


def test_outbox_held_items_leave_within_their_bound():
    """A producer holds items while a consumer sleeps in
    select() as the worker's I/O thread does: it sets ``wait_until`` before it
    reads the held timeout, and waits up to 0.5 s when nothing is held. Every
    item arrives, none anywhere near that 0.5 s (an item whose deadline the
    consumer missed would wait for it)."""
    box = Outbox()
    hold_s, n = 0.003, 400
    sent: dict[int, float] = {}
    late: list[float] = []
    got: list[int] = []

    def produce() -> None:
        for i in range(n):
            sent[i] = time.monotonic()
            box.hold((i,), hold_s)
            time.sleep(0.0005 if i % 10 else 0.01)

    th = threading.Thread(target=produce)
    th.start()
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        box.wait_until = time.monotonic() + 0.5
        held = box.held_timeout()
        wait = 0.5
        if held is not None and held < wait:
            wait = held
            box.wait_until = time.monotonic() + wait
        ready = select.select([box.fd], [], [], wait)[0]
        if ready or box.held_timeout() == 0.0:
            now = time.monotonic()
            for (i,) in box.drain():
                got.append(i)
                late.append(now - sent[i])
    th.join()
    box.close()
    assert got == list(range(n))
    late.sort()
    assert late[len(late) // 2] < 0.05, late[len(late) // 2]
    assert late[-1] < 0.45, late[-1]      # an item the consumer missed waits 0.5 s or more


def test_backoff_is_capped_and_jittered():
    values = [backoff(a, base=0.1, cap=1.0) for a in range(20)]
    assert all(0 < v <= 1.0 for v in values)
    assert len(set(values)) > 1


# ---- Endpoint over real sockets ------------------------------------------------------

KEY = bytes(range(32))


@pytest.fixture
def pair():
    """A ROUTER and a DEALER (identity b"d1") connected over inproc."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"d1")
    router.bind("inproc://transport-test")
    dealer.connect("inproc://transport-test")
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def _poll(sock, timeout_ms: int = 5000) -> None:
    assert sock.poll(timeout_ms), "nothing arrived"


def test_endpoint_frames_are_the_codec_frames(pair):
    import numpy as np

    from zpath.net import codec
    from zpath.net import messages as m

    router, dealer = pair
    a, b = transport.Endpoint(KEY, "worker:a"), transport.Endpoint(KEY, "controller")
    msg = m.ExecDone(3, None, 1.5, 2.5)
    assert a.send(dealer, msg, msg_id=5, parent=2) == 5
    _poll(router)
    got = router.recv_multipart()
    assert got == [b"d1", *codec.encode(KEY, msg, msg_id=5, sender="worker:a", parent=2)]

    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    big = np.arange(1 << 15, dtype=np.float64)          # 256 KiB: sent without a copy
    put = m.Put(1, 0, [[0, 2], [0, 3]], m.Aval([2, 3], "float32"))
    msg_id = b.send(router, put, to=b"d1", buffers=[small, b"xyz", big])
    assert msg_id == 1
    _poll(dealer)
    got = dealer.recv_multipart()
    want = codec.encode(KEY, put, msg_id=1, sender="controller",
                        buffers=[small.tobytes(), b"xyz", big.tobytes()])
    assert got == want


def test_endpoint_round_trip_and_router_identity(pair):
    import numpy as np

    from zpath.net import messages as m

    router, dealer = pair
    a, b = transport.Endpoint(KEY, "worker:a"), transport.Endpoint(KEY, "controller")
    big = np.arange(1 << 15, dtype=np.float64)
    a.send(dealer, m.Pong(7, 1, 2, [3]), buffers=[big, b"ab"], parent=9)
    _poll(router)
    ident, header, msg, buffers = b.recv(router, router=True)
    assert ident == b"d1" and type(ident) is bytes
    assert (header.type_id, header.msg_id, header.parent, header.sender) == (m.Pong.TYPE, 1, 9, "worker:a")
    assert msg == m.Pong(7, 1, 2, [3])
    assert [type(x) for x in buffers] == [memoryview, memoryview]
    np.testing.assert_array_equal(np.frombuffer(buffers[0], dtype=np.float64), big)
    assert bytes(buffers[1]) == b"ab"

    b.send(router, m.Ping(4), to=ident, parent=header.msg_id)
    _poll(dealer)
    ident, header, msg, buffers = a.recv(dealer)
    assert ident is None and msg == m.Ping(4) and buffers == [] and header.parent == 1


def test_endpoint_nonblocking(pair):
    zmq = pytest.importorskip("zmq")
    from zpath.net import messages as m

    router, dealer = pair
    a = transport.Endpoint(KEY, "worker:a")
    with pytest.raises(zmq.Again):
        a.recv(dealer, block=False)
    lonely = dealer.context.socket(zmq.DEALER)       # no peer: a send would block
    try:
        with pytest.raises(zmq.Again):
            a.send(lonely, m.Ping(1), block=False)
    finally:
        lonely.close()


def test_endpoint_bad_message_says_who_sent_it(pair):
    from zpath.net import codec
    from zpath.net import messages as m

    router, dealer = pair
    b = transport.Endpoint(KEY, "controller")
    dealer.send_multipart(codec.encode(b"x" * 32, m.Ping(1), msg_id=77, sender="client:z"))
    _poll(router)
    with pytest.raises(transport.BadMessage, match="bad signature") as info:
        b.recv(router, router=True)
    assert info.value.ident == b"d1"
    assert info.value.header == codec.Header(codec.PROTOCOL_VERSION, m.Ping.TYPE, 77, 0, "client:z")
    dealer.send_multipart([b"one", b"two"])
    _poll(router)
    with pytest.raises(transport.BadMessage, match="expected at least 3 frames, got 2"):
        b.recv(router, router=True)


def test_endpoint_uses_a_socket_subclass_send_and_copies_small_frames_only(pair):
    zmq = pytest.importorskip("zmq")
    import numpy as np

    from zpath.net import messages as m

    calls = []

    class Recording(zmq.Socket):
        def send(self, data, flags=0, copy=True, track=False, **kw):
            calls.append((memoryview(data).nbytes, int(flags), copy))
            return super().send(data, flags, copy=copy, track=track, **kw)

    router, _ = pair
    sock = Recording(router.context, zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("inproc://transport-test")
    try:
        big = np.zeros(transport.ZERO_COPY_BYTES, dtype=np.uint8)
        transport.Endpoint(KEY, "w").send(sock, m.Ping(1), buffers=[b"small", big])
        more = int(zmq.SNDMORE)
        assert [(f, c) for _, f, c in calls] == [(more, True)] * 4 + [(0, False)]
        assert [n for n, _, _ in calls][3:] == [5, transport.ZERO_COPY_BYTES]
        _poll(router)
        assert len(router.recv_multipart()) == 6
    finally:
        sock.close()


def test_send_batch_one_message_goes_as_itself(pair):
    from zpath.net import codec
    from zpath.net import messages as m

    router, dealer = pair
    a = transport.Endpoint(KEY, "worker:a")
    a.send_batch(dealer, [(m.ExecDone(3, None, 1.5, 2.5), 4, 8)])
    _poll(router)
    assert router.recv_multipart() == [b"d1", *codec.encode(KEY, m.ExecDone(3, None, 1.5, 2.5), msg_id=8,
                                                            sender="worker:a", parent=4)]


def test_send_batch_many_messages_are_one_zmq_message_in_order(pair):
    from zpath.net import codec
    from zpath.net import messages as m

    router, dealer = pair
    a, b = transport.Endpoint(KEY, "controller"), transport.Endpoint(KEY, "worker:a")
    msgs = [m.Ping(1), m.Free([5, 6]), m.ExecDone(2, None, 0.0, 1.0), m.Ping(2)]
    a.send_batch(router, [(x, i, 0) for i, x in enumerate(msgs)], to=b"d1")
    _poll(dealer)
    ident, header, out, buffers = b.recv(dealer)
    assert header.type_id == m.Batch.TYPE and type(out) is codec.Batched
    assert not dealer.poll(50), "a batch is one ZeroMQ message"
    got = transport.unbatched(header, out, buffers)
    assert [x for _, x, _ in got] == msgs
    assert [h.parent for h, _, _ in got] == [0, 1, 2, 3]
    assert len({h.msg_id for h, _, _ in got}) == 4 and all(h.sender == "controller" for h, _, _ in got)
    # a plain message passes through unbatched() as itself
    assert transport.unbatched(header, msgs[0], []) == ((header, msgs[0], []),)


def test_send_batch_splits_at_the_body_limit(pair, monkeypatch):
    from zpath.net import messages as m

    router, dealer = pair
    monkeypatch.setattr(transport, "BATCH_BODY_BYTES", 40)
    a, b = transport.Endpoint(KEY, "controller"), transport.Endpoint(KEY, "worker:a")
    msgs = [m.Free(list(range(i * 10, i * 10 + 10))) for i in range(9)]   # 12 bytes or more each
    a.send_batch(router, [(x, 0, 0) for x in msgs], to=b"d1")
    got, sizes = [], []
    while dealer.poll(200):
        _, header, out, buffers = b.recv(dealer)
        parts = transport.unbatched(header, out, buffers)
        sizes.append(len(parts))
        got += [x for _, x, _ in parts]
    assert got == msgs
    assert len(sizes) >= 2 and max(sizes) > 1 and sum(sizes) == 9


def test_send_batch_leaves_out_only_what_cannot_be_encoded(pair):
    from zpath.net import messages as m

    router, dealer = pair
    a, b = transport.Endpoint(KEY, "controller"), transport.Endpoint(KEY, "worker:a")
    bad = m.Error("x", "\udcff")            # a lone surrogate: msgpack cannot encode it
    msgs = [m.Ping(1), bad, m.Ping(2)]
    failed = a.send_batch(router, [(x, 0, 0) for x in msgs], to=b"d1")
    assert [(f[0], type(f[2])) for f in failed] == [(bad, UnicodeEncodeError)]
    _poll(dealer)
    _, header, out, buffers = b.recv(dealer)
    assert [x for _, x, _ in transport.unbatched(header, out, buffers)] == [m.Ping(1), m.Ping(2)]
    # alone, too: reported, not raised
    failed = a.send_batch(router, [(bad, 0, 7)], to=b"d1")
    assert [(f[0], f[1]) for f in failed] == [(bad, 7)]
    assert not dealer.poll(50)


def test_client_fails_the_futures_of_every_call_it_could_not_send():
    from zpath.client.connection import Client
    from zpath.errors import Broken
    from zpath.net import messages as m

    class Fut:
        def __init__(self):
            self.error = None

        def _fail(self, err):
            self.error = err

    c = Client.__new__(Client)               # only the bookkeeping _failed uses
    c._pending, c._fetches = {}, {}
    futs = {b: Fut() for b in (1, 2, 3)}
    c._futures = futs
    av = m.Aval([1], "float32")

    def call(out):
        return m.Call(1, "p", [1], ["i"], [0], [], [m.CallOutput(out, av, [None])])

    # a fetch waiting for the controller to locate a copy (sent as message 9)
    fetched = []
    fetch = types.SimpleNamespace(regions={}, future=types.SimpleNamespace(
        _fetched=lambda f, value, err: fetched.append(err)))
    c._locates = {9: fetch}
    c._failed(m.Program(1, "p", "parallel", [call(1), call(2)], []), 0, RuntimeError("down"))
    c._failed(call(3), 0, RuntimeError("down"))
    assert all(isinstance(f.error, Broken) for f in futs.values())
    c._failed(m.Locate(4), 9, RuntimeError("down"))
    assert not c._locates and len(fetched) == 1 and isinstance(fetched[0], Broken)


def test_client_fetch_queued_for_a_host_it_has_since_heard_is_lost_looks_for_a_copy():
    """A Fetch still queued when its host's HostDown came cannot be sent: the
    fetch asks the controller for a copy (Locate) instead of failing; any other
    message for that host fails what waits on it."""
    from zpath.client.connection import Client, _Fetch
    from zpath.errors import HostLost
    from zpath.net import messages as m

    c = Client.__new__(Client)               # only the bookkeeping used here
    c._pending, c._locates, c._futures = {}, {}, {}
    c.ep = types.SimpleNamespace(next_id=lambda: 77)
    sent = []
    c._send_ctl = sent.extend
    failed = []
    fut = types.SimpleNamespace(buffer=9, _fetched=lambda f, value, err: failed.append(err))
    fetch = _Fetch(fut, {5: ((0, 1),), 6: ((1, 2),)}, {5: 1, 6: 0}, 30.0)
    c._fetches = {5: fetch, 6: fetch}
    err = HostLost("host 1 was lost")
    c._unsendable(m.Fetch(5, 9, 1, [[0, 1]], 30.0), 5, err)
    assert c._locates == {77: fetch} and not c._fetches and not failed
    assert [(type(x).__name__, x.buffer, i) for x, _, i in sent] == [("Locate", 9, 77)]
    c._unsendable(m.Fetch(6, 9, 0, [[1, 2]], 30.0), 6, err)     # its other request: nothing more
    assert len(sent) == 1 and not failed
    others = []
    c._failed = lambda msg, msg_id, e: others.append((type(msg).__name__, e))
    c._unsendable(m.Put(4, 1, [[0, 1]], m.Aval([1], "float32")), 0, err)
    assert others == [("Put", err)] and len(sent) == 1


def test_client_fetch_answered_while_its_requests_are_still_being_put_waits_for_all_of_them():
    """The I/O thread may answer a fetch's first request before the caller has
    put the next one: the value is made of every shard, never of the first
    alone (with uninitialized memory for the rest); a wait (``wait_only``)
    likewise ends only once every shard's host has answered."""
    import itertools

    from zpath.client.connection import Client
    from zpath.client.futures import Future
    from zpath.net import messages as m

    c = Client.__new__(Client)               # only the bookkeeping used here
    c._closed, c._broken, c._lost, c._fetches = False, None, {}, {}
    c.ep = types.SimpleNamespace(next_id=itertools.count(100).__next__)
    c.devices = {d: m.DeviceInfo(d, 0, 0, d, d, "cpu") for d in range(2)}
    whole = np.arange(8, dtype=np.float32).reshape(4, 2)
    asked = []

    class Answering:                         # answers each request as it is put, as a fast worker would
        def put(self, kind, host, msg, buffers, req):
            asked.append(msg)
            rows = slice(*msg.region[0])
            bufs = [] if msg.wait_only else [whole[rows].tobytes()]
            c._handle(0, m.FetchReply(msg.request, m.Aval(list(whole[rows].shape), "float32"), None), bufs)
    c.outbox = Answering()
    got = []

    class Fut(Future):
        def _fetched(self, fetch, value, error):
            got.append((value, error))
    fut = Fut(c, 9, (4, 2), np.dtype(np.float32), [0, 1], [2], ["i"], ["i", None])
    c.start_fetch(fut, 30.0)
    [(value, error)] = got
    assert error is None
    np.testing.assert_array_equal(value, whole)
    got.clear()
    c.start_fetch(fut, 30.0, wait_only=True)
    assert got == [(None, None)] and [a.wait_only for a in asked] == [False, False, True, True]
    assert not c._fetches
    # a replicated value: a read's fetch asks one shard, a wait (or a fetch
    # with every_shard) every device's, which is what says its call ended
    rep = Fut(c, 10, (4, 2), np.dtype(np.float32), [0, 1], [2], ["i"], [None, None])
    for kw, n in (({}, 1), ({"wait_only": True}, 2), ({"every_shard": True}, 2)):
        asked.clear()
        fetch = c.start_fetch(rep, 30.0, **kw)
        assert [a.device for a in asked] == [0, 1][:n] and fetch.every_shard == (n == 2), kw
    # a wait whose host was lost goes to the copy the controller locates: still a wait, relocated
    asked.clear()
    sent = []
    c._send_ctl, c._locates, c._data_sock = sent.extend, {}, lambda host: host
    c._send = lambda sock, msg, bufs, req: c.outbox.put("data", sock, msg, bufs, req)
    wait = c.start_fetch(rep, 30.0, wait_only=True)
    c._relocate(wait)
    [(locate, _, req)] = sent
    got.clear()
    c._refetch(c._locates.pop(req), m.Location(10, [[[0, 4], [0, 2]]], [1], None))
    assert wait.relocated and [(a.device, a.wait_only) for a in asked] == [(0, True), (1, True), (1, True)]
    assert got == [(None, None)]


def test_client_sends_the_releases_made_among_a_burst_of_calls_as_one_release_after_them():
    """``x = f(x)`` op-by-op: each x is released once the next call reads it.
    The releases go as one Release after the calls around them (never before
    a call made before them), and before any other message."""
    from zpath.client.connection import Client
    from zpath.net import messages as m

    c = Client.__new__(Client)               # only what _flush uses
    c.outbox = Outbox()
    sent: list[list] = []
    c._send_ctl = lambda msgs: sent.append([x[0] for x in msgs]) if msgs else None
    c._data_sock = lambda host: ("data", host)
    data = []
    c._send = lambda sock, msg, buffers, msg_id: data.append((sent[-1] if sent else None, msg))
    av = m.Aval([1], "float32")

    def call(inp, out):
        return m.Call(out, "p", [1], ["i"], [0], [m.CallInput(inp, av, [None], False)],
                      [m.CallOutput(out, av, [None])])

    try:
        calls = [call(k, k + 1) for k in range(1, 5)]
        for x in calls:
            c.outbox.put("ctl", None, x, (), 0)
            c.outbox.put("rel", None, x.inputs[0].buffer, (), 0)
        c.outbox.put("ctl", None, m.StatusRequest(False), (), 5)
        c.outbox.put("rel", None, 5, (), 0)
        later = call(6, 7)
        c.outbox.put("ctl", None, later, (), 0)
        c.outbox.put("data", 0, m.Fetch(1, 7, 0, [[0, 1]], 1.0), (), 1)
        assert c._flush() is False
        assert sent == [[*calls, m.Release([1, 2, 3, 4]), m.StatusRequest(False), later, m.Release([5])]]
        assert data == [(sent[0], m.Fetch(1, 7, 0, [[0, 1]], 1.0))]      # after what came before it
    finally:
        c.outbox.close()


def test_send_batch_uses_bodies_packed_beforehand(pair):
    from zpath.net import codec
    from zpath.net import messages as m

    router, dealer = pair
    a, b = transport.Endpoint(KEY, "controller"), transport.Endpoint(KEY, "worker:a")
    msg = m.ExecDone(3, None, 1.5, 2.5)
    # a body that differs from the message shows which one went: the body given
    given = codec.pack_body(m.ExecDone(9, None, 1.5, 2.5))
    a.send_batch(router, [(msg, 4, 8, given)], to=b"d1")               # alone
    a.send_batch(router, [(msg, 0, 0, given), (m.Ping(1), 0, 0)], to=b"d1")
    got = []
    for _ in range(2):
        _poll(dealer)
        _, header, out, buffers = b.recv(dealer)
        got += [x for _, x, _ in transport.unbatched(header, out, buffers)]
    assert got == [m.ExecDone(9, None, 1.5, 2.5), m.ExecDone(9, None, 1.5, 2.5), m.Ping(1)]


@pytest.fixture
def switch_interval():
    """The process's GIL switch interval, put back after the test."""
    import sys
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield sys
    sys.setswitchinterval(before)


def test_hurried_outbox_shortens_the_switch_interval_until_its_items_are_sent(clocked_box, switch_interval):
    """An item that comes after the consumer has been idle gets the GIL handed
    to the consumer quickly (a short switch interval) until the consumer says
    it sent what it drained; items put while it waits, or in a burst right
    after a send, do not shorten it again (they go as one batch)."""
    sys = switch_interval
    clock, plain = clocked_box
    box = Outbox(hurry=True)
    try:
        box.put("ctl", None, "a", (), 0)
        assert sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
        box.put("ctl", None, "b", (), 0)                  # (waits with it)
        assert [x[2] for x in box.drain()] == ["a", "b"]
        assert sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)   # (sending still)
        box.put("ctl", None, "c", (), 0)                  # put while the consumer sends
        box.sent()
        assert sys.getswitchinterval() == 0.005           # set back: "c" waits for the next batch
        box.drain()
        box.sent()
        clock[0] += transport.HURRY_IDLE_S / 2            # a burst: right after a send
        box.put("ctl", None, "d", (), 0)
        assert sys.getswitchinterval() == 0.005
        box.drain()
        box.sent()
        clock[0] += 2 * transport.HURRY_IDLE_S            # idle again
        box.put("ctl", None, "e", (), 0)
        assert sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
        plain.put("ctl", None, "x", (), 0)                # an outbox without hurry changes nothing
        assert plain.drain() and sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
        box.drain()
        box.sent()
        assert sys.getswitchinterval() == 0.005
        plain.put("ctl", None, "y", (), 0)
        assert sys.getswitchinterval() == 0.005
    finally:
        box.close()


def test_hurried_outbox_keeps_an_interval_someone_else_set(clocked_box, switch_interval):
    """An interval the program set meanwhile stays, and so does one already
    shorter than the hurry's; closing with items unsent sets it back."""
    sys = switch_interval
    clock, _ = clocked_box
    box = Outbox(hurry=True)
    try:
        box.put("ctl", None, "a", (), 0)
        sys.setswitchinterval(0.002)           # the program's own, while "a" waits
        box.drain()
        box.sent()
        assert sys.getswitchinterval() == 0.002
        sys.setswitchinterval(0.0001)          # already shorter: left as it is
        clock[0] += 1
        box.put("ctl", None, "b", (), 0)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        box.drain()
        box.sent()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        clock[0] += 1
        box.put("ctl", None, "c", (), 0)
        assert sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
    finally:
        box.close()
    assert sys.getswitchinterval() == 0.005    # closed with "c" unsent: set back


def test_hurried_outbox_raced_by_a_second_producer_still_sets_the_interval_back(clocked_box, switch_interval,
                                                                               monkeypatch):
    """Two producers that both found the outbox unarmed and not hurried (a
    caller and a finalizer's release): the one that shortens the interval
    second finds it short already, and must not make the outbox forget that
    the other shortened it."""
    sys = switch_interval
    clock, _ = clocked_box
    box = Outbox(hurry=True)
    hurry = transport._hurry
    calls = []

    def racing_hurry():
        calls.append(1)
        if len(calls) == 1:       # the first producer, about to shorten it: the second gets there first
            box._armed = False    # (it checked the flags before the first set them)
            box.put("rel", None, 1, (), 0)
        return hurry()

    monkeypatch.setattr(transport, "_hurry", racing_hurry)
    try:
        box.put("ctl", None, "a", (), 0)
        assert len(calls) == 2 and sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
        box.drain()
        box.sent()
        assert sys.getswitchinterval() == 0.005
    finally:
        box.close()


def test_hurried_outbox_sets_back_exactly_the_interval_it_read(clocked_box, switch_interval):
    """CPython keeps whole microseconds and truncates: an interval such as
    0.1 s must come back as it was read, not a microsecond less each time."""
    sys = switch_interval
    clock, _ = clocked_box
    sys.setswitchinterval(0.1)
    was = sys.getswitchinterval()
    box = Outbox(hurry=True)
    try:
        for _ in range(3):
            clock[0] += 1
            box.put("ctl", None, "a", (), 0)
            assert sys.getswitchinterval() == pytest.approx(transport.HURRY_SWITCH_S)
            box.drain()
            box.sent()
            assert sys.getswitchinterval() == was
    finally:
        box.close()


def test_a_put_after_close_is_dropped_without_touching_the_interval(clocked_box, switch_interval):
    """A finalizer's release may come after the consumer closed the outbox:
    it neither raises (the pipe is closed) nor shortens the interval for good."""
    sys = switch_interval
    box = Outbox(hurry=True)
    box.close()
    box.put("rel", None, 1, (), 0)
    assert sys.getswitchinterval() == 0.005 and not box._items
