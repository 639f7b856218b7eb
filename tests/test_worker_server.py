"""The worker's message handlers in one process, without peers: what a
message does to the state and the store, and what the worker sends back
(read from its outbox, never from a socket)."""
from __future__ import annotations

import os
import select
import threading
import time

import blake3
import jax
import numpy as np
import pytest

from zpath.config import CommonConfig, WorkerConfig
from zpath.ids import buffer_id
from zpath.net import channels, codec
from zpath.net import messages as m
from zpath.worker import relay as relays
from zpath.worker.executor import Executor
from zpath.worker.server import Worker, _frame, _lower_priority
from zpath.worker.state import IDLE_WAIT_S, ShapedLink
from zpath.worker.store import PieceKey, shard_key

pytestmark = pytest.mark.timeout(60)

CLIENT = b"client-1"


@pytest.fixture
def worker():
    x64 = jax.config.jax_enable_x64
    w = Worker(b"k" * 32, "tcp://127.0.0.1:9", 0, config=WorkerConfig(shm=False),
               common=CommonConfig())
    dev = jax.devices()[0]
    w.rank = w.state.rank = 0
    w.device_ids = [0]
    w.executor = Executor(w.store, {0: dev}, w._exec_done, release_held=w._release_held)
    try:
        yield w
    finally:
        w.close()
        jax.config.update("jax_enable_x64", x64)     # the worker turns it on


def sent(w: Worker, timeout: float = 10.0) -> list[tuple]:
    """What the worker queued to send, once something is queued."""
    assert select.select([w.outbox.fd], [], [], timeout)[0], "nothing was sent"
    return [(kind, target, msg) for kind, target, msg, _, _ in w.outbox.drain()]


def test_a_fetch_is_answered_with_the_shard_once_it_is_done(worker):
    region = [[0, 4]]
    worker._handle_data(CLIENT, 7, m.Fetch(1, buffer_id(1, 1), 0, region, 30.0), [])
    assert select.select([worker.outbox.fd], [], [], 0)[0] == []     # waits for the shard
    worker.store.set(shard_key(buffer_id(1, 1), 0, region), np.arange(4, dtype=np.float32))
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", CLIENT)
    assert reply == m.FetchReply(1, m.Aval([4], "float32"), None)
    assert worker.state.expire_fetches(float("inf")) == []           # answered: not again


class _Posts:
    """Who posts each fetch reply of ``worker``: ``by`` request -> thread name,
    ``msgs`` request -> reply; ``wait_for(n)`` waits until n replies came."""

    def __init__(self, worker: Worker) -> None:
        self.by: dict = {}
        self.msgs: dict = {}
        self.cond = threading.Condition()
        post = worker.post_data

        def posting(ident, msg, *a, **k):
            with self.cond:
                self.by[msg.request] = threading.current_thread().name
                self.msgs[msg.request] = msg
                self.cond.notify_all()
            post(ident, msg, *a, **k)
        worker.post_data = posting

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.msgs) >= n, timeout=10), f"{len(self.msgs)} of {n} replies"


def _storer(store) -> None:
    """Run ``store`` on a thread named "storer" (as an executor stores shards), to its end."""
    t = threading.Thread(target=store, name="storer")
    t.start()
    t.join(10)
    assert not t.is_alive()


def test_a_small_fetch_is_answered_by_the_thread_that_finds_its_shard_done_a_big_one_by_a_sender(worker):
    """A small shard's fetch (or a failed one's) is answered on the thread that
    stores the shard, before ``set`` returns, or by the I/O thread if the shard
    was done already; a shard over channels.INLINE_PIECE_BYTES goes through the
    pool of sender threads, off the thread that stored it."""
    by = _Posts(worker).by
    small, big = np.arange(4, dtype=np.float32), np.zeros(channels.INLINE_PIECE_BYTES // 4 + 1, np.float32)
    for req, value in ((1, small), (2, big)):
        worker._handle_data(CLIENT, 7, m.Fetch(req, buffer_id(1, req), 0, [[0, value.size]], 30.0), [])
    worker._handle_data(CLIENT, 7, m.Fetch(3, buffer_id(1, 3), 0, [[0, 4]], 30.0), [])
    assert select.select([worker.outbox.fd], [], [], 0)[0] == []     # all wait for their shards

    def store():
        worker.store.set(shard_key(buffer_id(1, 1), 0, [[0, 4]]), small)
        by["answered before set returned"] = 1 in by
        worker.store.set(shard_key(buffer_id(1, 2), 0, [[0, big.size]]), big)
        worker.store.set(shard_key(buffer_id(1, 3), 0, [[0, 4]]),
                         error=m.ErrorInfo("RemoteError", "it failed", 0, "f", ""))
    _storer(store)
    replies = {}
    while len(replies) < 3:
        replies.update({msg.request: msg for _, _, msg in sent(worker)})
    assert replies[1] == m.FetchReply(1, m.Aval([4], "float32"), None)
    assert replies[2] == m.FetchReply(2, m.Aval([big.size], "float32"), None)
    assert replies[3].error.message == "it failed"
    assert by[1] == by[3] == "storer" and by["answered before set returned"]
    assert by[2].startswith("send")
    # a small shard done already: answered by the thread that takes the Fetch
    worker._handle_data(CLIENT, 7, m.Fetch(4, buffer_id(1, 1), 0, [[0, 4]], 30.0), [])
    assert by[4] == threading.current_thread().name
    [(_, _, reply)] = sent(worker, 0)
    assert reply == m.FetchReply(4, m.Aval([4], "float32"), None)
    assert worker.state.expire_fetches(float("inf")) == []


def test_a_fetch_is_sized_without_splitting_its_shard_and_a_shard_that_cannot_be_read_is_answered(worker):
    """What decides where a fetch is answered reads no shard: an Unsplit one
    (a computation's output) stays unsplit; a shard of exactly
    INLINE_PIECE_BYTES is answered where it is stored; a client with more than
    INLINE_FETCHES_WAITING fetches waiting has its answers sent by the pool;
    and a shard that cannot be read (its array deleted before it was split)
    is answered with the error, the thread that stored it unharmed."""
    from zpath.worker import server as ws
    from zpath.worker.store import Entry, Unsplit

    posts = _Posts(worker)
    by, msgs = posts.by, posts.msgs
    whole = jax.device_put(np.arange(8, dtype=np.float32))
    e = Entry()
    e.value = Unsplit(whole, 0)
    pending = worker.state.fetch(CLIENT, m.Fetch(9, buffer_id(1, 9), 0, [[0, 8]], 30.0), time.monotonic())
    assert worker._fetch_bytes(pending, e) == 32 and type(e._value) is Unsplit
    exact = np.zeros(channels.INLINE_PIECE_BYTES // 4, np.float32)
    worker._handle_data(CLIENT, 7, m.Fetch(1, buffer_id(1, 1), 0, [[0, exact.size]], 30.0), [])
    worker.store.set(shard_key(buffer_id(1, 1), 0, [[0, exact.size]]), exact)
    assert by[1] == threading.current_thread().name          # answered before set returned
    # a shard whose array went before it was split: the error is the answer
    gone = jax.device_put(np.arange(4, dtype=np.float32))
    worker._handle_data(CLIENT, 7, m.Fetch(2, buffer_id(1, 2), 0, [[0, 4]], 30.0), [])
    gone.delete()
    worker.store.set_many([(shard_key(buffer_id(1, 2), 0, [[0, 4]]), Unsplit(gone, 0))])
    assert msgs[2].error is not None and "deleted" in msgs[2].error.message
    # many of one client's fetches waiting: the storing thread leaves them to the pool
    for req in range(100, 100 + ws.INLINE_FETCHES_WAITING + 1):
        worker._handle_data(CLIENT, 7, m.Fetch(req, buffer_id(1, 3), 0, [[0, 4]], 30.0), [])
    worker.store.set(shard_key(buffer_id(1, 3), 0, [[0, 4]]), np.arange(4, dtype=np.float32))
    posts.wait_for(3 + ws.INLINE_FETCHES_WAITING)
    names = [by[req] for req in range(100, 100 + ws.INLINE_FETCHES_WAITING + 1)]
    assert names[0].startswith("send")          # the first found too many waiting
    assert all(msgs[req].error is None for req in range(100, 100 + ws.INLINE_FETCHES_WAITING + 1))


def test_a_wait_only_fetch_is_answered_without_its_shard_where_the_shard_is_found_done(worker):
    """A ``wait_only`` fetch (a client's block_until_ready of a big value) is
    answered once its shard is done with no buffer, by the thread that stores
    the shard however big it is, reading nothing of it (an Unsplit output
    stays unsplit); a failed shard's with the error; and one whose shard was
    done already by the thread that takes the Fetch."""
    from zpath.worker.store import Unsplit

    by = _Posts(worker).by
    big = jax.device_put(np.zeros(channels.INLINE_PIECE_BYTES, np.float32))
    region = [[0, big.size]]
    worker._handle_data(CLIENT, 7, m.Fetch(1, buffer_id(1, 1), 0, region, 30.0, True), [])
    worker._handle_data(CLIENT, 7, m.Fetch(2, buffer_id(1, 2), 0, [[0, 4]], 30.0, True), [])
    assert select.select([worker.outbox.fd], [], [], 0)[0] == []     # both wait for their shards

    def store():
        worker.store.set_many([(shard_key(buffer_id(1, 1), 0, region), Unsplit(big, 0))])
        worker.store.set(shard_key(buffer_id(1, 2), 0, [[0, 4]]),
                         error=m.ErrorInfo("RemoteError", "it failed", 0, "f", ""))
    _storer(store)
    got = {}
    while len(got) < 2:
        got.update({msg.request: (msg, bufs) for _, _, msg, bufs, _ in worker.outbox.drain()})
        if len(got) < 2:
            assert select.select([worker.outbox.fd], [], [], 10)[0], "nothing was sent"
    assert got[1] == (m.FetchReply(1, m.Aval([], ""), None), ())
    assert got[2][0].error.message == "it failed" and not got[2][1]
    assert by[1] == by[2] == "storer"
    assert type(worker.store.entry(shard_key(buffer_id(1, 1), 0, region))._value) is Unsplit
    worker._handle_data(CLIENT, 7, m.Fetch(3, buffer_id(1, 1), 0, region, 30.0, True), [])
    assert by[3] == threading.current_thread().name
    [(_, _, reply)] = sent(worker, 0)
    assert reply == m.FetchReply(3, m.Aval([], ""), None)
    assert worker.state.expire_fetches(float("inf")) == []
    # many of one client's waits waiting: as fetches, the storing thread leaves them to the pool
    from zpath.worker import server as ws
    posts = _Posts(worker)
    many = range(100, 100 + ws.INLINE_FETCHES_WAITING + 1)
    for req in many:
        worker._handle_data(CLIENT, 7, m.Fetch(req, buffer_id(1, 3), 0, [[0, 4]], 30.0, True), [])
    _storer(lambda: worker.store.set(shard_key(buffer_id(1, 3), 0, [[0, 4]]), np.arange(4, dtype=np.float32)))
    posts.wait_for(len(many))
    assert posts.by[many[0]].startswith("send")      # the first found too many waiting
    assert all(posts.msgs[req] == m.FetchReply(req, m.Aval([], ""), None) for req in many)


def test_a_computation_whose_second_output_cannot_be_taken_apart_fails_all_its_outputs(worker):
    """Settling a computation whose output 1 is not what the call declared
    stores the computations' before it and fails every output of this one,
    output 0 included: a client that knows one output of a call done takes
    the others for done (futures.Future._fetched), so none may be done alone."""
    from zpath.worker.store import ShardKey

    class Prepared:
        def output_shards(self, k, o, out, lazy=False):
            if k == 1:
                raise ValueError("output 1 is float32[3], but the call declared float32[4]")
            return [(0, ((0, 4),), out)]
    av = m.Aval([4], "float32")
    ex = m.Execute(7, 1, "d" * 64, "f", [1], ["i"], [0], [0], [],
                   [m.ExecOutput(buffer_id(1, 10), av, [None]), m.ExecOutput(buffer_id(1, 11), av, [None])])
    earlier = ShardKey(buffer_id(1, 9), 0, ((0, 4),))
    shards = [(earlier, np.ones(4, np.float32))]
    error = worker.executor._output_shards(ex, Prepared(), [np.zeros(4, np.float32)] * 2, shards)
    assert error is not None and "declared" in error.message and shards == []
    assert worker.store.entry(earlier).error is None and worker.store.entry(earlier).value.tolist() == [1.0] * 4
    for b in (10, 11):
        e = worker.store.entry(shard_key(buffer_id(1, b), 0, [[0, 4]]))
        assert e.done and e.error is not None and "declared" in e.error.message, b


def test_a_fetch_not_ready_by_its_deadline_gets_deadline_exceeded_and_leaves_nothing(worker):
    worker._handle_data(CLIENT, 7, m.Fetch(2, buffer_id(1, 2), 0, [[0, 4]], 0.0), [])
    worker._expire_fetches()
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", CLIENT)
    assert reply.request == 2 and reply.error.kind == "DeadlineExceeded"
    assert worker.store.stats([0]) == (0, 0, [0]) and worker.store.buffers_of(1) == []
    worker.state.validate_state()


def test_the_loop_does_what_is_due_and_sleeps_idle_with_nothing_pending(worker):
    """``_due``, run on every wake-up of the I/O loop: with nothing pending it
    returns the idle wait and sends nothing; a pending fetch, a shaped DCN
    message or a forwarded message that waited past its time each shorten the
    wait or are carried out."""
    assert worker._due() == IDLE_WAIT_S
    assert not select.select([worker.outbox.fd], [], [], 0)[0]
    # a fetch due in 0.2 s: the wait ends by then; one past its deadline is answered
    worker._handle_data(CLIENT, 7, m.Fetch(3, buffer_id(1, 3), 0, [[0, 4]], 0.2), [])
    assert 0 < worker._due() <= 0.2
    worker.state.fetches[0] = (0.0, *worker.state.fetches[0][1:])
    assert worker._due() == IDLE_WAIT_S
    [(_, _, reply)] = sent(worker)
    assert reply.request == 3 and reply.error.kind == "DeadlineExceeded"
    # a DCN message the link delivers in 50 ms: the wait ends by then
    worker.shaped = ShapedLink(channels.Shaper(50.0, 0.0))
    worker.shaped.send(1, m.Ping(1), [], time.monotonic())
    assert 0 < worker._due() <= 0.05
    worker.shaped = ShapedLink(channels.Shaper(0.0, 0.0))
    # a forwarded message waiting for a direct one that never came: handled once past its time
    assert worker.relay.forwarded(1, "tcp://127.0.0.1:9", 5, [], m.Ping(9), [],
                                  time.monotonic() - 2 * relays.ORDER_WAIT_S) == []
    worker._due()
    [(kind, _, pong)] = sent(worker)
    assert kind == "ctl" and pong.seq == 9
    assert worker._due() == IDLE_WAIT_S


def test_puts_of_a_departed_client_are_dropped(worker):
    worker._handle_ctl(m.ClientGone(5), [])
    put = m.Put(buffer_id(5, 1), 0, [[0, 2]], m.Aval([2], "float32"))
    worker._handle_data(CLIENT, 8, put, [np.zeros(2, np.float32)])
    assert not worker.store.is_done(shard_key(buffer_id(5, 1), 0, [[0, 2]]))
    put = m.Put(buffer_id(6, 1), 0, [[0, 2]], m.Aval([2], "float32"))
    worker._handle_data(CLIENT, 9, put, [np.ones(2, np.float32)])
    e = worker.store.entry(shard_key(buffer_id(6, 1), 0, [[0, 2]]))
    assert e.done and e.error is None and np.asarray(e.value).tolist() == [1.0, 1.0]
    worker.state.validate_state()


def test_a_run_of_an_unknown_fused_program_is_reported_failed(worker):
    av = m.Aval([2], "float32")
    ex = m.Execute(0, 0, "p" * 64, "f", [1], ["i"], [0], [0], [m.ExecInput(-1, av, ["i"], [])],
                   [m.ExecOutput(0, av, ["i"])])
    worker._handle_ctl(m.DefineFused(4, [ex], []), [])
    assert worker.state.fused[4].devices == [0]
    worker._handle_ctl(m.DropFused([4]), [])
    worker._handle_ctl(m.RunFused(11, 1, 4, [buffer_id(1, 1)], buffer_id(1, 2)), [])
    [(kind, _, done)] = sent(worker)
    assert kind == "ctl" and done.exec_id == 11
    assert done.error.kind == "FusedUnknown" and "fused program 4 is unknown here" in done.error.message
    worker.state.validate_state()


def test_a_fused_run_frees_what_it_makes_unremembered_and_an_input_it_releases_remembered(worker):
    """Once the run has finished, its own outputs are freed without being
    remembered as freed (its client puts only slot values, outside the run's
    block); an input it releases (maybe a Put; this controller releases none
    so) is remembered, so a late Put of it is dropped, as after a Free."""
    av = m.Aval([2], "float32")
    ex = m.Execute(0, 0, "p" * 64, "f", [1], ["i"], [0], [0], [m.ExecInput(-1, av, ["i"], [])],
                   [m.ExecOutput(0, av, ["i"])])
    ex2 = m.Execute(0, 0, "p" * 64, "f", [1], ["i"], [0], [0], [m.ExecInput(0, av, ["i"], [])],
                    [m.ExecOutput(1, av, ["i"])])
    worker._handle_ctl(m.DefineFused(4, [ex, ex2], [0, -1]), [])
    first, put = buffer_id(1, 10), buffer_id(1, 1)
    keys = {b: shard_key(b, 0, [[0, 2]]) for b in (first, put)}
    for k in keys.values():          # as if stored: the frees drop them
        worker.store.set(k, np.zeros(2, np.float32))
    ex_ = worker.executor
    arrived, frees, free_after_earlier = [], [], ex_.free_after_earlier
    # queued, not run (the program is not here): its place in the order only
    ex_.submit = lambda run: arrived.append(ex_._order.arrive())
    ex_.free_after_earlier = lambda buffers, remember=True: (
        frees.append((list(buffers), remember)), free_after_earlier(buffers, remember))
    worker._handle_ctl(m.RunFused(11, 1, 4, [put], first), [])
    assert frees == [([first], False), ([put], True)]
    assert all(worker.store.is_done(k) for k in keys.values())      # the run has not finished
    with ex_._lock:
        ex_._free(ex_._order.finish(arrived[0]))
    assert not any(worker.store.is_done(k) for k in keys.values())
    assert not worker.store.was_freed(first) and worker.store.was_freed(put)
    # a Put of the released input that comes late is dropped; a stray one of
    # the client's into the run's block lasts no longer than the client
    for b in (put, first):
        worker._handle_data(CLIENT, 9, m.Put(b, 0, [[0, 2]], av), [np.ones(2, np.float32)])
    assert not worker.store.is_done(keys[put]) and worker.store.is_done(keys[first])
    ex_.free_after_earlier = free_after_earlier
    worker._handle_ctl(m.ClientGone(1), [])
    assert not worker.store.is_done(keys[first])
    worker.state.validate_state()


def test_a_piece_in_chunks_is_stored_once_whole(worker):
    av = m.Aval([4], "float32")
    data = np.arange(4, dtype=np.float32).view(np.uint8)
    worker._handle_data(b"peer", 1, m.PieceChunk(3, av, 0, 16), [data[:8]])
    assert not worker.store.is_done(PieceKey(3))
    worker._handle_data(b"peer", 2, m.PieceChunk(3, av, 8, 16), [data[8:]])
    e = worker.store.entry(PieceKey(3))
    assert e.done and e.error is None and e.value.tolist() == [0.0, 1.0, 2.0, 3.0]
    # a chunk that does not fit fails the piece and is answered with an error
    worker._handle_data(b"peer", 3, m.PieceChunk(4, av, 12, 16), [data[:8]])
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", b"peer") and reply.code == "bad_request"
    assert worker.store.entry(PieceKey(4)).error.message.startswith("bad PieceChunk")
    worker.chunks.validate_state()


@pytest.fixture
def pair():
    """Two workers of one machine that may use its shortcuts (shared memory,
    datagrams), not serving: their handlers are called here."""
    x64 = jax.config.jax_enable_x64
    ws = [Worker(b"k" * 32, "tcp://127.0.0.1:9", 0, config=WorkerConfig(shm=True), common=CommonConfig())
          for _ in range(2)]
    try:
        yield ws
    finally:
        for w in ws:
            w.close()
        jax.config.update("jax_enable_x64", x64)


def send_piece(a: Worker, b: Worker, piece_id: int, value: np.ndarray | None,
               error: m.ErrorInfo | None = None, address: str | None = None) -> None:
    """Host a sends piece ``piece_id`` of a shard holding ``value`` (or failed
    with ``error``) to host b (at ``address``, b's data port by default)."""
    region = [[0, 1], [0, 4]]
    key = shard_key(buffer_id(1, piece_id), 0, region)
    a.store.set(key, value, error=error)
    order = m.SendPiece(piece_id, buffer_id(1, piece_id), 0, region, region, 1,
                        address or b.data_address, "ICI", b.machine, "")
    a._piece_ready(order, a.store.entry(key))


def test_a_small_piece_to_a_worker_of_this_machine_goes_as_a_datagram(pair):
    a, b = pair
    assert a.dgram_in is not None and b.dgram_in is not None
    value = np.arange(4, dtype=np.float32).reshape(1, 4)
    send_piece(a, b, 1, value)
    send_piece(a, b, 2, None, error=m.ErrorInfo("RemoteError", "it failed", 0, "f", ""))
    # nothing went through a's I/O thread (its outbox) or ZeroMQ: b's socket has both
    assert select.select([a.outbox.fd], [], [], 0)[0] == []
    assert select.select([b.dgram_in.fileno()], [], [], 5)[0]
    b._drain_dgram()
    e = b.store.entry(PieceKey(1))
    assert e.done and e.error is None and e.value.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert b.store.entry(PieceKey(2)).error.message == "it failed"
    assert b.stats["recv_tcp"] == 1 and a.stats["sent_ici_tcp"] == 1
    # a datagram is checked as any message: another key's, or one that is not
    # a piece, is dropped (and the loop goes on to the next one)
    other = Worker(b"o" * 32, "tcp://127.0.0.1:9", 0, config=WorkerConfig(shm=True), common=CommonConfig())
    try:
        frames = codec.encode(b"o" * 32, m.Piece(3, m.Aval([1], "float32"), None), msg_id=1, sender="x",
                              buffers=[np.zeros(1, np.float32)])
        assert other.dgram_out.send(b.dgram_in.name, frames)
    finally:
        other.close()
    frames = codec.encode(b"k" * 32, m.Put(buffer_id(1, 9), 0, [[0, 1]], m.Aval([1], "float32")), msg_id=2,
                          sender="x", buffers=[np.zeros(1, np.float32)])
    assert a.dgram_out.send(b.dgram_in.name, frames)
    assert a.dgram_out.send(b.dgram_in.name, [b"not", b"a message"])
    send_piece(a, b, 4, value)
    b._drain_dgram()
    assert not b.store.is_done(PieceKey(3)) and not b.store.is_done(shard_key(buffer_id(1, 9), 0, [[0, 1]]))
    assert b.store.entry(PieceKey(4)).value.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert b.dgram_in.recv() is None


def test_a_small_piece_goes_by_zeromq_when_no_datagram_socket_takes_it(pair):
    a, b = pair
    a.peer_addrs[1] = ("tcp://127.0.0.1:1", "")
    send_piece(a, b, 5, np.ones((1, 4), np.float32), address="tcp://127.0.0.1:1")   # nobody's
    [(kind, target, msg)] = sent(a)
    assert (kind, target) == ("peer", 1) and msg == m.Piece(5, m.Aval([1, 4], "float32"), None)
    assert b.dgram_in.recv() is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_strided_or_bfloat16_small_piece_arrives_as_its_c_ordered_bytes(pair, dtype):
    """A piece's bytes go as one frame without a copy when they lie C-ordered in
    the shard; a strided cut (columns 1:3 of 2x4), or a dtype with no buffer
    format (bfloat16), goes as a C-ordered copy. Both arrive equal."""
    a, b = pair
    value = np.arange(8, dtype=np.float32).reshape(2, 4).astype(jax.numpy.dtype(dtype))
    region, sub = [[0, 2], [0, 4]], [[0, 2], [1, 3]]
    key = shard_key(buffer_id(1, 7), 0, region)
    a.store.set(key, value)
    a._piece_ready(m.SendPiece(7, buffer_id(1, 7), 0, region, sub, 1, b.data_address, "ICI", b.machine, ""),
                   a.store.entry(key))
    assert select.select([b.dgram_in.fileno()], [], [], 5)[0]
    b._drain_dgram()
    got = b.store.entry(PieceKey(7)).value
    assert got.dtype == value.dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got, value[:, 1:3])
    frame = _frame(value[:, 1:3])
    assert bytes(frame) == np.ascontiguousarray(value[:, 1:3]).tobytes()
    whole = _frame(value)
    assert bytes(whole) == value.tobytes()
    if dtype == "float32":       # C-ordered in the shard: a view on it, no copy
        assert isinstance(whole, memoryview) and whole.obj is value


def test_datagram_frames_are_checked():
    frames = [b"ab", b"", np.arange(3, dtype=np.float32).view(np.uint8)]
    r = channels.DgramReceiver(channels.dgram_name("zpath-test", f"frames-{id(frames)}"))
    s = channels.DgramSender()
    try:
        assert s.send(r.name, frames)
        assert [bytes(f) for f in channels.dgram_frames(r.recv())] == [bytes(f) for f in frames]
        # small frames come out as bytes (codec.decode's shortest path), big ones as views
        big = bytes(range(256)) * ((channels.DGRAM_COPY_BYTES >> 8) + 1)
        assert s.send(r.name, [b"ab", big])
        small, large = channels.dgram_frames(r.recv())
        assert type(small) is bytes and small == b"ab"
        assert type(large) is memoryview and bytes(large) == big
        assert r.recv() is None
        assert not s.send(r.name, [bytes(channels.DGRAM_MAX_BYTES)])       # too big: the caller uses ZeroMQ
        assert not s.send(channels.dgram_name("zpath-test", "nobody"), frames)
        for bad in (b"", b"\x02\x00\x00\x00\x01\x00\x00\x00", b"\x01\x00\x00\x00\x09\x00\x00\x00abc",
                    b"\x01\x00\x00\x00\x01\x00\x00\x00abc"):
            with pytest.raises(ValueError):
                channels.dgram_frames(bad)
    finally:
        r.close()
        s.close()


def test_lower_priority_adds_to_each_given_threads_niceness_only():
    """Per thread (Linux keeps a niceness per thread): the given thread's goes
    up by the amount (at most 19), the caller's stays; a thread that has ended
    is skipped without an error."""
    got: dict[str, int] = {}
    ready, done = threading.Event(), threading.Event()

    def body() -> None:
        got["tid"] = threading.get_native_id()
        got["before"] = os.getpriority(os.PRIO_PROCESS, got["tid"])
        ready.set()
        done.wait(10)
        got["after"] = os.getpriority(os.PRIO_PROCESS, got["tid"])

    t = threading.Thread(target=body)
    t.start()
    try:
        assert ready.wait(10)
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        _lower_priority({got["tid"]}, 3)
        _lower_priority({got["tid"]}, 30)          # capped at 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        done.set()
        t.join(10)
    assert got["before"] == mine and got["after"] == 19
    _lower_priority({got["tid"]}, 3)                # ended: nothing to do, no error


def test_a_small_piece_goes_in_the_channels_own_format_and_a_bad_one_is_refused(pair):
    """The datagram is the channel's piece format (not a signed envelope); one
    of another cluster's key is dropped, and one that is authentic but no
    piece fails what waits for it."""
    a, b = pair
    value = np.arange(4, dtype=np.float32).reshape(1, 4)
    send_piece(a, b, 1, value)
    assert select.select([b.dgram_in.fileno()], [], [], 5)[0]
    data = b.dgram_in.recv()
    assert data.startswith(channels.PIECE_MAGIC)
    assert b.piece_dgrams.read(data)[0] == 1
    other = channels.PieceDatagrams(b"o" * 32)
    assert a.dgram_out.send_parts(b.dgram_in.name, other.frames(3, value))
    forged = bytearray(b"".join(bytes(p) for p in a.piece_dgrams.frames(4, value)))
    forged[20] ^= 1
    assert a.dgram_out.send_parts(b.dgram_in.name, [bytes(forged)])
    assert a.dgram_out.send_parts(b.dgram_in.name, [channels.PIECE_MAGIC + b"\x01"])      # short
    head = channels._PIECE_HEADS[1].pack(channels.PIECE_TAG, channels.PIECE_DTYPES.index("float32"), 1, 5, 4)
    mac = a.piece_dgrams._key
    assert a.dgram_out.send_parts(b.dgram_in.name, [head, bytes(8), blake3.blake3(head + bytes(8), key=mac).digest()])
    send_piece(a, b, 6, value)
    b._drain_dgram()
    assert not b.store.is_done(PieceKey(3)) and not b.store.is_done(PieceKey(4))
    assert b.store.entry(PieceKey(5)).error.message.startswith("bad Piece: piece 5: 8 bytes do not make")
    assert b.store.entry(PieceKey(6)).value.tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert b.dgram_in.recv() is None


def test_a_small_piece_the_format_cannot_carry_goes_as_a_signed_envelope(pair):
    """Rank 33 (or a dtype not in the format's table): the old datagram, the
    signed ``Piece``, which the receiver still takes."""
    a, b = pair
    value = np.arange(2, dtype=np.float32).reshape((1,) * 32 + (2,))
    region = [[0, 1]] * 32 + [[0, 2]]
    key = shard_key(buffer_id(1, 8), 0, region)
    a.store.set(key, value)
    a._piece_ready(m.SendPiece(8, buffer_id(1, 8), 0, region, region, 1, b.data_address, "ICI", b.machine, ""),
                   a.store.entry(key))
    assert select.select([b.dgram_in.fileno()], [], [], 5)[0]
    data = b.dgram_in.recv()
    assert not data.startswith(channels.PIECE_MAGIC)
    header, msg, buffers = b.ep.decode(channels.dgram_frames(data))
    assert msg == m.Piece(8, m.Aval(list(value.shape), "float32"), None)
    b._piece_in(None, header.msg_id, msg, buffers)
    np.testing.assert_array_equal(b.store.entry(PieceKey(8)).value, value)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint32", "int64", "float16", "bfloat16", "float64",
                                   "complex64", "float8_e4m3fn", "int4"])
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_small_pieces_of_every_dtype_and_shape_arrive_equal(pair, dtype, shape):
    a, b = pair
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)     # (int64, float64, complex128 kept as they are)
    try:
        _small_piece_arrives_equal(a, b, dtype, shape)
    finally:
        jax.config.update("jax_enable_x64", x64)  # the process's other tests see it as before


def _small_piece_arrives_equal(a, b, dtype, shape):
    dt = jax.numpy.dtype(dtype)
    value = (np.arange(int(np.prod(shape))) % 2).astype(dt).reshape(shape)
    region = [[0, n] for n in shape]
    key = shard_key(buffer_id(1, 11), 0, region)
    a.store.set(key, value)
    a._piece_ready(m.SendPiece(11, buffer_id(1, 11), 0, region, region, 1, b.data_address, "ICI", b.machine, ""),
                   a.store.entry(key))
    assert select.select([b.dgram_in.fileno()], [], [], 5)[0]
    b._drain_dgram()
    got = b.store.entry(PieceKey(11)).value
    assert got.dtype == dt and got.shape == shape and got.tobytes() == value.tobytes()


def test_a_fetch_whose_shard_cannot_be_read_is_answered_with_the_error(worker, monkeypatch):
    """Reading a done shard fails (here: cutting it raises): the fetch, already
    claimed by then, gets that error at once, not the client's deadline."""
    from zpath import sharding
    region = [[0, 4]]

    def broken(*a, **k):
        raise RuntimeError("the array was deleted")
    monkeypatch.setattr(sharding, "cut", broken)
    worker._handle_data(CLIENT, 7, m.Fetch(3, buffer_id(1, 3), 0, region, 30.0), [])
    worker.store.set(shard_key(buffer_id(1, 3), 0, region), np.arange(4, dtype=np.float32))
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", CLIENT) and reply.request == 3
    assert reply.error.kind == "RemoteError" and "RuntimeError: the array was deleted" in reply.error.message
    assert worker.state.expire_fetches(float("inf")) == []


def test_a_put_the_device_does_not_take_fails_what_waits_on_it(worker, monkeypatch):
    """A Put whose array the device refuses with an error that is not a bad
    request's (here: to_device raises RuntimeError) is answered with the error,
    and its shard fails with it: a computation waiting on it does not wait out
    its input timeout."""
    from zpath.worker import server

    def refused(*a, **k):
        raise RuntimeError("out of device memory")
    monkeypatch.setattr(server, "to_device", refused)
    put = m.Put(buffer_id(1, 4), 0, [[0, 2]], m.Aval([2], "float32"))
    worker._handle_data(CLIENT, 8, put, [np.zeros(2, np.float32)])
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", CLIENT)
    assert reply.code == "RemoteError" and "RuntimeError: out of device memory" in reply.message
    e = worker.store.entry(shard_key(buffer_id(1, 4), 0, [[0, 2]]))
    assert e.done and e.error is not None and "Put failed: RuntimeError: out of device memory" in e.error.message
