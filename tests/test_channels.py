"""Data-plane channels on real local clusters: ICI through shared memory between
hosts of one island on this machine (and no segment ever left behind), DCN
shaping (latency, bandwidth cap) and CURVE encryption between islands."""
from __future__ import annotations

import gc
import os
import signal
import time

import blake3
import ml_dtypes
import numpy as np
import pytest
import zmq

import zpath as zp
from zpath.client import session as zp_session
from zpath.cluster.launcher import LocalCluster
from zpath.net import channels
from zpath.net import messages as m
from zpath.net.codec import CLIENTS
from zpath.net.transport import Endpoint
from tests.conftest import assert_gone

pytestmark = pytest.mark.timeout(240)


def channel_stats(cluster: LocalCluster, reset: bool = False) -> dict[int, m.ChannelStats]:
    """Every worker's data-plane counters, asked on its data port."""
    from zpath.client.connection import Client
    st = Client(cluster.address, cluster.key, name="stats")
    try:
        hosts = {h.rank: h.data_address for h in st.request(m.StatusRequest(False)).hosts}
    finally:
        st.close()
    ep = Endpoint(cluster.key, "client:stats", signer=CLIENTS)    # what anyone with the cluster key may ask
    ctx = zmq.Context()
    out = {}
    try:
        for rank, address in hosts.items():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            ep.send(s, m.ChannelStatsRequest(reset))
            assert s.poll(10_000), f"host {rank} did not answer ChannelStatsRequest"
            _, _, reply, _ = ep.recv(s)
            assert isinstance(reply, m.ChannelStats), reply
            out[rank] = reply
            s.close(0)
    finally:
        ctx.term()
    return out


def pair(island: int | None = None, hosts: tuple[int, int] | None = None):
    vds = zp.make_virtual_device_set()
    if hosts is not None:
        a = vds.add_slice(devices=1, host=hosts[0]).devices
        b = vds.add_slice(devices=1, host=hosts[1]).devices
    else:
        a = vds.add_slice(devices=1, island=0).devices
        b = vds.add_slice(devices=1, island=1).devices
    assert a[0].host != b[0].host
    return a, b


def move(a, b, x: np.ndarray) -> np.ndarray:
    """Produce x+1 on device a, consume it (times 2) on device b."""
    produce = zp.pmap(lambda v: v + 1, devices=a)
    consume = zp.pmap(lambda v: v * 2, devices=b)
    return np.asarray(consume(produce(x[None])))[0]


# ---- ICI: shared memory ------------------------------------------------------

@pytest.fixture(scope="module")
def island():
    c = LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1)
    pids = c.pids
    try:
        yield c
    finally:
        c.stop()
        assert_gone(pids)
        assert channels.segments(c.shm_prefix) == []


@pytest.fixture
def conn(island):
    c = zp.connect(island.address, island.key, name="test")
    try:
        yield c
    finally:
        zp.shutdown()


@pytest.mark.parametrize("nbytes,dtype", [(1 << 10, "float32"), (64 << 10, "int8"),
                                          (1 << 20, "bfloat16"), (4 << 20, "int64"),
                                          (64 << 20, "float32")])
def test_ici_shm_transfer(island, conn, x64, nbytes, dtype):     # (x64: int64 stays int64)
    import jax.numpy as jnp
    dt = np.dtype(jnp.dtype(dtype))
    n = nbytes // dt.itemsize
    rng = np.random.default_rng(n)
    x = (rng.integers(-50, 50, n)).astype(dt)
    a, b = pair(hosts=(0, 1))
    before = channel_stats(island)
    y = move(a, b, x)
    np.testing.assert_array_equal(y, ((x + dt.type(1)) * dt.type(2)).astype(dt))
    after = channel_stats(island)
    if nbytes <= channels.INLINE_PIECE_BYTES:
        # a small piece went host 0 -> host 1 inline in its message, not through a segment
        assert after[0].sent_ici_tcp == before[0].sent_ici_tcp + 1
        assert after[0].bytes_ici_tcp - before[0].bytes_ici_tcp == nbytes
        assert after[0].sent_shm == before[0].sent_shm
        assert after[1].recv_tcp == before[1].recv_tcp + 1
        assert after[1].recv_shm == before[1].recv_shm
    else:
        # a bigger one through shared memory, not TCP
        assert after[0].sent_shm == before[0].sent_shm + 1
        assert after[0].bytes_shm - before[0].bytes_shm == nbytes
        assert after[0].sent_ici_tcp == before[0].sent_ici_tcp
        assert after[1].recv_shm == before[1].recv_shm + 1
        assert after[1].recv_tcp == before[1].recv_tcp
    # every segment was taken (its name unlinked): nothing left in /dev/shm
    assert channels.segments(island.shm_prefix) == []


def test_ici_segments_are_reused(island, conn):
    a, b = pair(hosts=(0, 1))
    x = np.arange(1 << 18, dtype=np.float32)
    move(a, b, x)
    live = []
    for i in range(10):
        np.testing.assert_array_equal(move(a, b, x + i), (x + i + 1) * 2)
        live.append(channel_stats(island)[0].segments)
    # the pool does not grow with the transfers: a 1 MiB piece is lent to the
    # receiver in its segment until XLA lets go of its input, which it does
    # at its next call or a collection, so a loop rotates through a few (an
    # ack may come after the next send; without acks it would grow by 10)
    assert max(live) <= live[0] + 2, live
    assert channels.segments(island.shm_prefix) == []


def test_segments_gone_after_shutdown_and_after_sigkill():
    zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
    local = zp_session._cluster["current"].local
    prefix, pids = local.shm_prefix, local.pids
    try:
        a, b = pair(hosts=(0, 1))
        move(a, b, np.ones(1 << 20, np.float32))
    finally:
        zp.shutdown()
    assert_gone(pids)
    assert channels.segments(prefix) == []

    # A worker killed with segments it made and no peer took: the launcher's stop
    # removes them (we plant one the way a sender would, then SIGKILL it).
    c = LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1)
    pids = c.pids
    try:
        worker = next(p for name, p in c.procs if name == "worker-i0-h0")
        planted = os.path.join(channels.SHM_DIR, f"{c.shm_prefix}-{worker.pid}-999")
        with open(planted, "wb") as f:
            f.write(b"x" * 4096)
        with _Conn(c):
            a, b = pair(hosts=(0, 1))
            produce = zp.pmap(lambda v: v + 1, devices=a)
            consume = zp.pmap(lambda v: v * 2, devices=b)
            y = consume(produce(np.ones((1, 1 << 20), np.float32)))
            os.kill(worker.pid, signal.SIGKILL)
            del y
        assert channels.segments(c.shm_prefix) != []
    finally:
        c.stop()
    assert_gone(pids)
    assert channels.segments(c.shm_prefix) == []


def test_shm_piece_strided_one_copy_each_side():
    """The sender copies a strided view straight into the segment; the receiver
    copies it out into an XLA-aligned array that later writes into the reused
    segment do not touch."""
    prefix = f"zpath-t{os.getpid()}"
    snd = channels.ShmSender(prefix)
    rcv = channels.ShmReceiver(channels.RecvBuffers(min_bytes=1))
    try:
        full = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        view = full[:, 16:48]                          # not C-contiguous
        name, offset, drop = snd.write(1, view)
        raw = rcv.take(name, offset, view.nbytes, drop)
        assert raw.ctypes.data % channels.XLA_ALIGN == 0
        got = np.frombuffer(raw, np.float32).reshape(view.shape)
        np.testing.assert_array_equal(got, view)
        snd.release(name)
        again, _, _ = snd.write(1, -view)              # the pool reuses the segment...
        assert again == name
        np.testing.assert_array_equal(got, view)       # ...and the piece taken is intact
        snd.release(again)
    finally:
        snd.close()
        rcv.close()
    assert channels.segments(prefix) == []


def _until(pred, timeout: float = 5.0) -> bool:
    import gc
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        gc.collect()      # JAX lets an adopted host array go at its next call, or at a collection
        time.sleep(0.01)
    return True


def test_recv_buffer_reused_only_once_xla_drops_it():
    import gc
    import jax
    dev = jax.devices()[0]
    pool = channels.RecvBuffers(min_bytes=1)
    raw = pool.get(1 << 20)
    piece = np.frombuffer(raw, np.float32).reshape(1, -1)   # as a worker makes a piece's array
    piece[:] = 1.5
    del raw
    x = jax.device_put(piece, dev)
    assert x.unsafe_buffer_pointer() == piece.ctypes.data  # XLA took the array over: no copy
    del piece
    gc.collect()
    assert pool.free() == 0                                # the device buffer still holds it
    other = pool.get(1 << 20)
    assert other.ctypes.data != x.unsafe_buffer_pointer()  # so this is other memory
    other[:] = 0
    seen = np.array(x)                                     # a copy: holds nothing of x
    assert (seen == 1.5).all()
    del x
    assert _until(lambda: pool.free() == 1)                # back once XLA let it go
    view = other[100:200]                                  # a view keeps its array in use
    del other
    gc.collect()
    assert pool.free() == 1
    del view
    assert _until(lambda: pool.free() == 2)
    pool.get(1 << 20)
    assert (pool.made, pool.reused) == (2, 1)
    small = channels.RecvBuffers(max_arrays=2, min_bytes=1)
    got = [small.get(4096) for _ in range(3)]
    del got
    assert _until(lambda: small.free() == 2)               # the oldest beyond the limit is dropped


def test_shm_piece_lent_in_its_segment_until_nothing_refers_to_it():
    """A big piece is not copied on the receiving side: XLA adopts the view on
    the segment as its device buffer, and the segment is given back (on_free)
    only once that buffer is gone; then the sender may reuse it."""
    import queue

    import jax
    prefix = f"zpath-t{os.getpid()}"
    snd = channels.ShmSender(prefix)
    rcv = channels.ShmReceiver()
    freed: queue.SimpleQueue = queue.SimpleQueue()
    try:
        data = np.arange(1 << 19, dtype=np.float32)             # 2 MiB
        name, offset, drop = snd.write(1, data)
        raw = rcv.view(name, offset, data.nbytes, drop, lambda: freed.put(name))
        assert raw.ctypes.data % channels.XLA_ALIGN == 0
        piece = raw.view(np.float32)                             # as a worker types a piece
        del raw
        x = jax.device_put(piece, jax.devices()[0])
        assert x.unsafe_buffer_pointer() == piece.ctypes.data   # the device buffer is the segment
        del piece
        gc.collect()
        assert freed.empty()                                     # XLA still holds it
        np.testing.assert_array_equal(np.asarray(x), data)
        del x
        assert _until(lambda: not freed.empty())                 # given back once XLA let go
        assert freed.get() == name
        snd.release(name)
        again, _, _ = snd.write(1, -data)
        assert again == name                                     # the sender reuses it
        with pytest.raises(ValueError, match="aligned"):
            rcv.view(again, 8, 64, [], lambda: None)
        snd.release(again)
    finally:
        snd.close()
        rcv.close()
    assert channels.segments(prefix) == []


class _Conn:
    def __init__(self, c: LocalCluster) -> None:
        self.c = c

    def __enter__(self):
        return zp.connect(self.c.address, self.c.key, name="test")

    def __exit__(self, *exc):
        zp.shutdown()


def test_shaper_arithmetic():
    s = channels.Shaper(latency_ms=10, gbps=1)
    assert s.active
    t1 = s.due(125_000_000, 100.0)              # 1 Gbit at 1 Gbit/s: 1 s + 10 ms
    assert t1 == pytest.approx(101.01)
    t2 = s.due(0, 100.5)                        # queued behind the first
    assert t2 == pytest.approx(101.01)
    assert not channels.Shaper().active


def test_shaper_chunks():
    s = channels.Shaper(latency_ms=10, gbps=1, chunk_bytes=1000)
    plan = s.chunks(2500, 100.0)                # 8 us per 1000 bytes at 1 Gbit/s
    assert [(o, n) for o, n, _ in plan] == [(0, 1000), (1000, 1000), (2000, 500)]
    assert [d for _, _, d in plan] == pytest.approx([100.010008, 100.010016, 100.01002])
    assert s.chunks(10, 100.0) == [(0, 10, pytest.approx(100.0100201))]   # behind them, one chunk
    assert channels.Shaper(latency_ms=10, chunk_bytes=1000).chunks(2500, 5.0) == [(0, 2500, 5.01)]
    with pytest.raises(ValueError):
        channels.Shaper(-1, 0)


def test_a_lost_peer_gives_back_the_link_time_it_had_booked():
    """A sending host's emulated link is one queue: chunks queued for a peer
    that is lost must not hold back what goes to the others."""
    import heapq

    s = channels.Shaper(latency_ms=10, gbps=1, chunk_bytes=125_000_000)
    queued: list = []
    for seq, (rank, nbytes) in enumerate([(1, 125_000_000), (2, 1000), (1, 125_000_000), (3, 2000)]):
        heapq.heappush(queued, (s.due(nbytes, 100.0), seq, rank, f"m{seq}", [np.zeros(nbytes, np.uint8)]))
    assert max(e[0] for e in queued if e[2] == 3) == pytest.approx(102.010024)   # behind 2 s for rank 1
    queued = s.repace(queued, lambda e: e[2] == 1, 100.5)
    assert [(e[2], e[3]) for e in sorted(queued)] == [(2, "m1"), (3, "m3")]
    assert [e[0] for e in sorted(queued)] == pytest.approx([100.510008, 100.510024])
    assert s.due(0, 100.5) == pytest.approx(100.510024)      # the link is free after them


# ---- DCN: shaping and CURVE --------------------------------------------------

def _timed_moves(a, b, x: np.ndarray, repeats: int) -> list[float]:
    produce = zp.pmap(lambda v: v + 1, devices=a)
    consume = zp.pmap(lambda v: v[..., :1] * 2, devices=b)   # trivial consumer
    consume(produce(x[None])).result()                       # compile both, warm up
    times = []
    for _ in range(repeats):
        src = produce(x[None])
        src.result()                                         # the value is on host a
        t = time.perf_counter()
        consume(src).result()
        times.append(time.perf_counter() - t)
    return times


def test_dcn_bandwidth_cap():
    with LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1, dcn_gbps=1.0) as c:
        pids = c.pids
        with _Conn(c):
            a, b = pair()
            t = min(_timed_moves(a, b, np.zeros(4 << 20, np.float32), 2))   # 16 MiB
            # a piece of several chunks and a ragged end comes back whole
            x = np.arange((5 << 20) // 8 + 3, dtype=np.float64)
            np.testing.assert_array_equal(move(a, b, x), (x + 1) * 2)
        stats = channel_stats(c)
        s = stats[a[0].host]
        assert s.sent_dcn >= 4 and s.sent_shm == 0
        assert stats[b[0].host].recv_tcp >= 4
    assert_gone(pids)
    assert t >= 0.13, t               # 16 MiB at 1 Gbit/s is 0.134 s
    assert t < 3.0, t


def test_dcn_latency():
    with LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1, dcn_latency_ms=50) as c:
        pids = c.pids
        with _Conn(c):
            a, b = pair()
            t = min(_timed_moves(a, b, np.zeros(4, np.float32), 3))
    assert_gone(pids)
    assert t >= 0.050, t
    assert t < 2.0, t


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_dcn_curve():
    with LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1, dcn_encrypt=True) as c:
        pids = c.pids
        with _Conn(c):
            a, b = pair()
            for n in (16, 1 << 20):
                x = np.arange(n, dtype=np.float64)
                np.testing.assert_array_equal(move(a, b, x), (x + 1) * 2)
        assert channel_stats(c)[a[0].host].sent_dcn >= 2
    assert_gone(pids)


def test_bad_dcn_settings():
    with pytest.raises(ValueError):
        LocalCluster(islands=1, hosts_per_island=1, devices_per_host=1, dcn_gbps=-1)


def test_a_sender_keeps_reusing_segments_while_one_is_lent_for_long(monkeypatch):
    """A segment lent to the receiver (busy for as long as the input it holds
    lives) does not count against the pool's limits on free segments."""
    monkeypatch.setattr(channels, "POOL_BYTES", 4 << 20)
    prefix = f"zpath-t{os.getpid()}"
    snd = channels.ShmSender(prefix)
    try:
        held, _, _ = snd.write(1, np.zeros(4 << 20, np.uint8))     # lent, never released
        names = set()
        for i in range(5):
            name, _, _ = snd.write(1, np.full(1 << 20, i, np.uint8))
            names.add(name)
            snd.release(name)
        assert len(names) == 1 and held not in names               # one free segment, reused
    finally:
        snd.close()
    assert channels.segments(prefix) == []


def test_a_piece_that_comes_after_its_consumer_failed_is_not_kept():
    import queue

    import jax

    from zpath.worker.executor import Executor
    from zpath.worker.store import PieceKey, Store

    store, done = Store(), queue.Queue()
    dev = jax.devices()[0]
    ex = Executor(store, {0: dev}, lambda i, err, s, e, hold: done.put((i, err)))
    try:
        av = m.Aval([4], "float32")
        piece = m.PieceSource(77, 1, [[0, 4]], [[0, 4]])
        ex.submit(m.Execute(1, 1, "0" * 64, "f", [1], ["i"], [0], [dev.id],
                            [m.ExecInput(5, av, [None], [m.ShardInput(0, [[0, 4]], [piece])])],
                            [m.ExecOutput(6, av, [None])]))
        i, err = done.get(timeout=30)
        assert i == 1 and err is not None and "never sent" in err.message   # no such program
        store.set(PieceKey(77), np.zeros(4, np.float32))      # the piece comes late
        e = store.entry(PieceKey(77))
        assert e.error is not None and e.value is None     # refused: nothing keeps it
    finally:
        ex.stop()


def test_a_sender_lets_go_of_a_lost_peers_segments_lent_ones_included():
    prefix = f"zpath-t{os.getpid()}"
    snd = channels.ShmSender(prefix)
    try:
        lent, _, _ = snd.write(1, np.zeros(1 << 20, np.uint8))          # never acked
        free, _, _ = snd.write(1, np.zeros(1 << 16, np.uint8))
        snd.release(free)
        other, _, _ = snd.write(2, np.zeros(1 << 16, np.uint8))
        assert snd.live() == 3
        assert snd.forget(1) == 2
        assert snd.live() == 1
        assert channels.segments(prefix) == [other]                      # peer 2's is kept
        assert snd.forget(1) == 0
    finally:
        snd.close()
    assert channels.segments(prefix) == []


def test_dtype_name_is_numpys_name():
    for dt in (np.float32, np.float64, np.int8, np.bool_, ">f4", "U5", ml_dtypes.bfloat16):
        d = np.dtype(dt)
        assert channels.dtype_name(d) == d.name
        assert channels.dtype_name(d) == d.name          # asked again: remembered, the same


# ---- a small piece's own datagram (PieceDatagrams) ----------------------------------

def _piece_bytes(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


_SHAPES = [(), (0,), (3, 0), (5,), (2, 3), (1, 2, 1, 3)]


@pytest.mark.parametrize("name", [n for n in channels.PIECE_DTYPES if channels._piece_dtype(n) is not None])
def test_piece_datagram_round_trip_of_every_dtype_and_shape(name):
    """Every dtype the format carries, in every rank from 0-d through empty
    arrays, strided cuts included, comes back equal, in its dtype and shape."""
    codec_ = channels.PieceDatagrams(b"k" * 32)
    dtype = channels._piece_dtype(name)
    rng = np.random.default_rng(0)
    for shape in _SHAPES:
        raw = rng.integers(0, 256, size=max(1, int(np.prod(shape))) * dtype.itemsize, dtype=np.uint8)
        if dtype.kind == "b":
            raw &= 1
        value = raw[:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        parts = codec_.frames(2**40 + 7, value)
        assert parts is not None
        piece_id, got = codec_.read(_piece_bytes(parts))
        assert piece_id == 2**40 + 7
        assert got.dtype == dtype and got.shape == shape
        assert got.tobytes() == value.tobytes()
    wide = np.arange(24, dtype=np.uint8).view(np.uint8)[:24 - 24 % dtype.itemsize].view(dtype)
    grid = np.stack([wide, wide, wide])                  # 3 x n
    cut = grid[:, 1:]                                     # strided
    _, got = codec_.read(_piece_bytes(codec_.frames(1, cut)))
    assert got.tobytes() == np.ascontiguousarray(cut).tobytes() and got.shape == cut.shape


def test_piece_datagram_is_refused_when_forged_corrupted_short_or_of_another_format():
    ours, theirs = channels.PieceDatagrams(b"k" * 32), channels.PieceDatagrams(b"o" * 32)
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    good = _piece_bytes(ours.frames(9, value))
    assert ours.read(good)[0] == 9
    # another cluster's key (or a tenant's, which holds no worker key): no piece named
    with pytest.raises(channels.PieceError, match="bad MAC") as e:
        ours.read(_piece_bytes(theirs.frames(9, value)))
    assert e.value.piece_id is None
    # any byte changed: the id, the shape, the dtype, the bytes, the MAC
    for at in range(4, len(good)):
        bad = bytearray(good)
        bad[at] ^= 0x01
        with pytest.raises(channels.PieceError) as e:
            ours.read(bytes(bad))
        assert e.value.piece_id is None, at
    # every truncation, and bytes appended
    for n in range(len(good)):
        with pytest.raises(channels.PieceError):
            ours.read(good[:n])
    with pytest.raises(channels.PieceError, match="bad MAC"):
        ours.read(good + b"\0")
    # a format this side does not read, and not a piece datagram at all: said so
    with pytest.raises(channels.PieceError, match="format 2 .*reads 1"):
        ours.read(channels.PIECE_MAGIC + b"\x02" + good[4:])
    with pytest.raises(channels.PieceError, match="not a piece datagram"):
        ours.read(b"\x03\0\0\0" + good[4:])


def _signed(codec_: channels.PieceDatagrams, head: bytes, data: bytes) -> bytes:
    """A datagram with a good MAC over whatever ``head`` and ``data`` say."""
    return head + data + blake3.blake3(head + data, key=codec_._key).digest()


def test_an_authentic_piece_datagram_that_is_no_piece_names_its_piece():
    """Signed with the key but inconsistent (only a bug makes one): refused,
    with the piece's id, so that what waits for it can be failed."""
    ours = channels.PieceDatagrams(b"k" * 32)
    head = channels._PIECE_HEADS[1].pack(channels.PIECE_TAG, channels.PIECE_DTYPES.index("float32"), 1, 5, 3)
    with pytest.raises(channels.PieceError, match="8 bytes do not make a float32\\[3\\]") as e:
        ours.read(_signed(ours, head, bytes(8)))
    assert e.value.piece_id == 5
    head = channels._PIECE_HEADS[1].pack(channels.PIECE_TAG, 250, 1, 6, 3)
    with pytest.raises(channels.PieceError, match="dtype 250 unknown") as e:
        ours.read(_signed(ours, head, bytes(12)))
    assert e.value.piece_id == 6
    head = bytearray(channels._PIECE_HEADS[0].pack(channels.PIECE_TAG, 0, 0, 7))
    head[5] = channels.PIECE_MAX_NDIM + 1
    with pytest.raises(channels.PieceError, match="rank 33"):
        ours.read(_signed(ours, bytes(head), bytes(8 * 40)))


def test_what_the_piece_format_cannot_carry_is_left_to_the_envelope():
    ours = channels.PieceDatagrams(b"k" * 32)
    assert ours.frames(1, np.zeros((1,) * (channels.PIECE_MAX_NDIM + 1), np.float32)) is None
    assert ours.frames(1, np.zeros(channels.INLINE_PIECE_BYTES // 4 + 1, np.float32)) is None
    assert ours.frames(-1, np.zeros(3, np.float32)) is None
    assert ours.frames(1, np.zeros(3, ">i4")) is None           # not this machine's byte order
    assert ours.frames(1, np.zeros(3, "U2")) is None
    assert ours.frames(1, np.zeros(channels.INLINE_PIECE_BYTES // 4, np.float32)) is not None


def test_piece_datagrams_travel_whole_through_the_socket():
    ours = channels.PieceDatagrams(b"k" * 32)
    r = channels.DgramReceiver(channels.dgram_name("zpath-test", f"pieces-{os.getpid()}"))
    s = channels.DgramSender()
    try:
        for n in (0, 1, 1024, channels.INLINE_PIECE_BYTES):
            value = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
            assert s.send_parts(r.name, ours.frames(n, value))
            got = r.recv()
            assert got.startswith(channels.PIECE_MAGIC)
            piece_id, arr = ours.read(got)
            assert piece_id == n and np.array_equal(arr, value)
        assert not s.send_parts(channels.dgram_name("zpath-test", "nobody"), ours.frames(1, value))
    finally:
        r.close()
        s.close()
    # the socket's name carries the format: a worker of another format has another one
    assert f"-dgram{channels.PIECE_FORMAT}-".encode() in channels.dgram_name("p", "a")
