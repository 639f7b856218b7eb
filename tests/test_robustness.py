"""Bad input and misbehaving peers get clear errors; nothing hangs or crashes."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import zpath as zp
from zpath.net import codec, transport
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION

# hand-made messages below name float64 values: 64-bit types on
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("x64")]


def devices(n, **kw):
    return zp.make_virtual_device_set().add_slice(devices=n, **kw).devices


def test_bfloat16_and_other_dtypes_round_trip_across_hosts(client):
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    on0 = zp.pmap(lambda x: x * 2, devices=devices(2, host=0))
    on1 = zp.pmap(lambda x: x + 1, devices=devices(2, host=1))
    for dtype in (ml_dtypes.bfloat16, np.int8, np.bool_, np.float16, np.uint32):
        x = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
        got = np.asarray(on1(on0(x)))      # put, piece between hosts, fetch
        with jax.enable_x64(True):           # as zpath traced it (this module's x64)
            expect = np.asarray((jnp.asarray(x) * 2) + 1)
        assert got.dtype == expect.dtype, dtype
        np.testing.assert_array_equal(got, expect)


def test_zero_size_arrays(client):
    P = zp.P
    d0, d1 = devices(2, host=0), devices(2, host=1)
    make = zp.jit(lambda x: x * 2, mesh=zp.Mesh(d0, ("i",)), in_specs=P(None, "i"), out_specs=P(None, "i"))
    use = zp.jit(lambda x: x.sum(0) + 1, mesh=zp.Mesh(d1, ("j",)), in_specs=P(), out_specs=P())
    y = make(np.ones((0, 4)))
    assert np.asarray(y).shape == (0, 4)
    np.testing.assert_array_equal(np.asarray(use(y)), np.ones(4))


def test_put_with_an_unknown_dtype_is_rejected_and_fails_the_call(cluster, client):
    """A hand-made Put whose dtype name is unknown gets Error(bad_request) at
    once, and the call that reads it fails instead of waiting."""
    d = devices(1)
    inc = zp.pmap(lambda x: x + 1, devices=d)
    inc(np.zeros(1)).result(timeout=60)       # registers the program
    c = client.client
    buf = c.new_buffer_id()
    host = c.devices[d[0].id].host
    c.put(host, m.Put(buf, d[0].id, [[0, 1]], m.Aval([1], "notadtype")), np.zeros(1))
    traced = next(iter(inc._cache.values()))
    out = c.new_buffer_id()
    fut = inc.future(out, traced.out_avals[0], traced.out_specs[0])
    c.post(inc.call_message(traced, [m.CallInput(buf, m.Aval([1], "float64"), ["_zp_pmap"], True)], [out]))
    t = time.monotonic()
    with pytest.raises(zp.RemoteError, match="unknown dtype"):
        fut.result(timeout=60)
    assert time.monotonic() - t < 30


def test_controller_keeps_serving_a_client_that_never_reads(cluster, client):
    """A peer that floods requests and never reads the answers must not block
    the controller (its sends never block; answers queue or are dropped)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(cluster.address)
    try:
        s.send_multipart(codec.encode(cluster.key, m.Hello("flood", PROTOCOL_VERSION, 1.0), msg_id=1, sender="x",
                                      signer=codec.CLIENTS))
        for i in range(5000):
            s.send_multipart(codec.encode(cluster.key, m.StatusRequest(True), msg_id=i + 2, sender="x",
                                          signer=codec.CLIENTS))
        assert s.poll(30_000), "the controller never answered the flood"    # it is working through it
        inc = zp.pmap(lambda x: x + 1, devices=devices(1))
        t = time.monotonic()
        np.testing.assert_array_equal(inc(np.zeros(1)).result(timeout=30), [1.])
        assert time.monotonic() - t < 20
    finally:
        s.close()
        ctx.term()


def test_fetches_that_never_complete_do_not_starve_a_worker(client):
    """Many fetches of shards that will never exist (each waiting for its long
    deadline) do not hold up transfers or other fetches on that host."""
    c = client.client
    d = devices(1, host=0)
    host = c.devices[d[0].id].host
    for k in range(8):
        c.outbox.put("data", host, m.Fetch(10_000 + k, 12345678 + k, d[0].id, [[0, 1]], 3600.0), (), 10_000 + k)
    # (what follows goes to that host after them: one socket, in order)
    on0 = zp.pmap(lambda x: x * 2, devices=d)
    on1 = zp.pmap(lambda x: x + 1, devices=devices(1, host=1))
    t = time.monotonic()
    np.testing.assert_array_equal(on1(on0(np.ones(1))).result(timeout=30), [3.])   # needs a SendPiece
    np.testing.assert_array_equal(on0(np.ones(1)).result(timeout=30), [2.])
    assert time.monotonic() - t < 20


def test_a_rejected_call_does_not_poison_an_existing_buffer(client):
    inc = zp.pmap(lambda x: x + 1, devices=devices(1))
    y = inc(np.zeros(1))
    y.result(timeout=60)
    c = client.client
    bogus = m.Call(c.new_call_id(), "0" * 64, [1], ["_zp_pmap"], inc.mesh.device_ids, [],
                   [m.CallOutput(y.buffer, m.Aval([1], "float64"), ["_zp_pmap"])])
    c.post(bogus)
    # the next call follows it on the same connection: the controller has
    # rejected it by the time it plans this one
    np.testing.assert_array_equal(np.asarray(inc(y)), [2.])


def test_clients_cannot_use_each_others_buffers(cluster, client):
    """Another client can neither read this client's buffers nor name its buffer
    ids for new values; the owner's value stays usable."""
    from zpath.client.connection import Client
    inc = zp.pmap(lambda x: x + 1, devices=devices(1))
    theirs = inc(np.zeros(1))
    theirs.result(timeout=60)
    other = Client(cluster.address, cluster.key, name="other")
    try:
        traced = next(iter(inc._cache.values()))
        other.register_program(traced.digest, "inc", traced.blob)
        av, spec, devs = m.Aval([1], "float64"), ["_zp_pmap"], inc.mesh.device_ids

        def submit(inputs, out):
            fut = zp.Future(other, out, (1,), np.float64, devs, [1], spec, spec)
            other.track(fut)
            other.post(m.Call(other.new_call_id(), traced.digest, [1], spec, devs, inputs,
                              [m.CallOutput(out, av, spec)]))
            return fut
        read = submit([m.CallInput(theirs.buffer, av, spec, False)], other.new_buffer_id())
        with pytest.raises(zp.RemoteError, match="is unknown"):
            read.result(timeout=30)
        squat = submit([], theirs.buffer + 99)
        with pytest.raises(zp.RemoteError, match="not this client's"):
            squat.result(timeout=30)
    finally:
        other.close()
    np.testing.assert_array_equal(np.asarray(inc(theirs)), [2.])
    # the refused id was not claimed either: its owner can still create it
    later = theirs.buffer + 99
    fut = inc.future(later, traced.out_avals[0], traced.out_specs[0])
    client.client.post(inc.call_message(traced, [m.CallInput(theirs.buffer, av, spec, False)], [later]))
    np.testing.assert_array_equal(fut.result(timeout=30), [2.])


def test_numpy_integers_as_slice_arguments(client):
    d = devices(np.int64(1), island=np.int64(0), host=None)
    assert len(d) == 1 and d[0].island == 0


@pytest.mark.parametrize("target", ["controller", "worker"])
def test_a_message_of_very_many_frames_is_refused_cheaply(cluster, client, target):
    """An unsigned message of 200,000 empty frames: refused with one Error (its
    frames beyond any message's are dropped unread), the cluster keeps serving."""
    address = cluster.address if target == "controller" else \
        next(iter(client.client.hosts.values())).data_address
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart([b""] * 200_000)
        assert s.poll(20_000), "no answer"
        frames = s.recv_multipart()
        assert b"too many frames (200000" in frames[-1], frames
        inc = zp.pmap(lambda x: x + 1, devices=devices(1))
        np.testing.assert_array_equal(inc(np.zeros(1)).result(timeout=30), [1.])
    finally:
        s.close()
        ctx.term()


# ---- tenant isolation: the attacks of issue #21, each refused ----------------
# The attacker B is a client like any other: it holds the cluster key and its
# own session key, and speaks the protocol by hand (docs/protocol.md).

def _attacker(cluster):
    from zpath.client.connection import Client
    return Client(cluster.address, cluster.key, name="attacker")


def _ask(cluster, b, address: str, msgs, buffers=(), until=None, ep=None, timeout: float = 20.0) -> list:
    """Send ``msgs`` from a fresh connection to ``address``, signed as client ``b``
    (or by ``ep``); return the answers (checked under the cluster key or b's
    session key) until one passes ``until`` (default: the first)."""
    ep = ep or b.ep
    keys = {codec.CLIENTS: cluster.key, b.client_id: b.ep.sign_key}
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        for msg in msgs:
            ep.send(s, msg, buffers=buffers)
        got: list = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and s.poll(int((deadline - time.monotonic()) * 1000)):
            header, msg, _ = codec.decode(keys.get, s.recv_multipart())
            got += [x for _, x, _ in transport.unbatched(header, msg, [])]
            if until is None or any(until(x) for x in got):
                return got
        raise AssertionError(f"no answer (got {got})")
    finally:
        s.close()
        ctx.term()


def _data_address(client, device: int) -> str:
    c = client.client
    return c.hosts[c.devices[device].host].data_address


def test_attack_1_a_client_cannot_fetch_another_clients_value(cluster, client):
    """B fetches A's value from the worker's data port, by its own key, by the
    cluster key, or claiming to be A: refused each time."""
    inc = zp.pmap(lambda x: x + 1, devices=devices(1))
    x = inc(np.full(1, 41.))
    x.result(timeout=60)
    dev = inc.mesh.device_ids[0]
    fetch = m.Fetch(7, x.buffer, dev, [[0, 1]], 5.0)
    b = _attacker(cluster)
    try:
        for ep in (None, transport.Endpoint(cluster.key, "b", signer=codec.CLIENTS)):
            [reply] = _ask(cluster, b, _data_address(client, dev), [fetch], ep=ep)
            # that fetch fails (as any failed fetch), with no data
            assert isinstance(reply, m.FetchReply) and reply.error is not None, reply
            assert "not the signer's" in reply.error.message, reply
        as_a = transport.Endpoint(b.ep.sign_key, "b", signer=client.client.client_id)
        [reply] = _ask(cluster, b, _data_address(client, dev), [fetch], ep=as_a)
        assert isinstance(reply, m.Error) and "bad signature" in reply.message, reply
    finally:
        b.close()
    np.testing.assert_array_equal(np.asarray(x), [42.])


def test_attack_2_puts_under_another_clients_next_ids_are_refused(cluster, client):
    """B puts values under A's next buffer ids: refused; A's next calls compute
    with A's own values."""
    dbl = zp.pmap(lambda x: x * 2 + 1, devices=devices(1))
    dbl(np.zeros(1)).result(timeout=60)
    dev = dbl.mesh.device_ids[0]
    nxt = client.client.new_buffer_id()
    b = _attacker(cluster)
    try:
        puts = [m.Put(nxt + k, dev, [[0, 1]], m.Aval([1], "float64")) for k in range(1, 9)]
        got = _ask(cluster, b, _data_address(client, dev), puts, buffers=[np.full(1, 999.)])
        assert isinstance(got[0], m.Error) and "not the signer's" in got[0].message, got
    finally:
        b.close()
    for v in (3., 5., 7.):          # A's next values are its own
        np.testing.assert_array_equal(dbl(np.full(1, v)).result(timeout=30), [2 * v + 1])


def test_attack_3_pieces_from_a_client_are_refused(cluster, client):
    """B sends 3,000 pieces with guessed ids to a worker: refused (pieces come
    only from workers); A's cross-island program computes right."""
    on0 = zp.pmap(lambda x: x * 2, devices=devices(1, island=0))
    on1 = zp.pmap(lambda x: x + 1, devices=devices(1, island=1))
    dev = on1.mesh.device_ids[0]
    b = _attacker(cluster)
    try:
        pieces = [m.Piece(k, m.Aval([1], "float64"), None) for k in range(1, 3001)]
        got = _ask(cluster, b, _data_address(client, dev), pieces, buffers=[np.full(1, 999.)])
        assert isinstance(got[0], m.Error) and "from workers only" in got[0].message, got
    finally:
        b.close()
    for v in (1., 2., 3.):
        np.testing.assert_array_equal(on1(on0(np.full(1, v))).result(timeout=30), [2 * v + 1])


def test_attack_4_a_rejected_call_naming_another_clients_ids_frees_nothing_of_theirs(cluster, client):
    """B's call, which the controller rejects, names A's next ids as values put:
    nothing of A's is freed, and A's next calls (which put those ids) complete."""
    inc = zp.pmap(lambda x: x + 1, devices=devices(1))
    inc(np.zeros(1)).result(timeout=60)
    dev = inc.mesh.device_ids[0]
    nxt = client.client.new_buffer_id()
    av, spec = m.Aval([1], "float64"), ["_zp_pmap"]
    b = _attacker(cluster)
    try:
        b.post(m.Call(b.new_call_id(), "0" * 64, [1], spec, [dev],
                      [m.CallInput(nxt + k, av, spec, True) for k in range(1, 9)], []))
        b.request(m.StatusRequest(False))      # after its call: the controller has rejected it
    finally:
        b.close()
    t = time.monotonic()
    for v in (1., 2., 3.):
        np.testing.assert_array_equal(inc(np.full(1, v)).result(timeout=30), [v + 1])
    assert time.monotonic() - t < 20


def test_attack_5_only_the_worker_key_registers_a_worker(cluster, client):
    """B registers as a worker, under the cluster key and under its own session
    key: refused; no host is added."""
    before = client.client.request(m.StatusRequest(False))
    reg = m.RegisterWorker("fake", 0, "tcp://127.0.0.1:1", 1, "cpu", 8, PROTOCOL_VERSION, list(range(8)),
                           "", 0, 1, "fake-machine", "", "")
    b = _attacker(cluster)
    try:
        for ep in (transport.Endpoint(cluster.key, "b", signer=codec.CLIENTS), None):
            [reply] = _ask(cluster, b, cluster.address, [reg], ep=ep)
            assert isinstance(reply, m.Error) and "worker key" in reply.message, reply
    finally:
        b.close()
    after = client.client.request(m.StatusRequest(False))
    assert len(after.hosts) == len(before.hosts) and "fake" not in {h.name for h in after.hosts}


def test_attack_7_an_oversized_frame_is_refused_before_it_is_read(cluster, client):
    """A frame over the controller's maximum (MAXMSGSIZE): its connection is
    dropped as the frame comes, with no answer (it is never read, so never
    checked); a request sent after it on the same socket is answered."""
    from zpath.controller.server import MAX_FRAME_BYTES
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(cluster.address)
    try:
        s.send(bytes(MAX_FRAME_BYTES + 1), copy=False)
        s.send_multipart(codec.encode(cluster.key, m.StatusRequest(False), msg_id=5, sender="x",
                                      signer=codec.CLIENTS))
        replies = []
        while not any(isinstance(r, m.Status) for r in replies):
            assert s.poll(60_000), replies
            replies.append(codec.decode(cluster.key, s.recv_multipart())[1])
        assert not any(isinstance(r, m.Error) for r in replies), replies
    finally:
        s.close()
        ctx.term()


def test_attack_7_garbage_gets_rate_limited_answers(cluster, client):
    """2,000 garbage messages at a worker's data port get a few Error answers
    (rate-limited per peer), not one each; a good request after them is answered."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(next(iter(client.client.hosts.values())).data_address)
    try:
        for k in range(2000):
            s.send_multipart([b"x" * 32, b"garbage", b"%d" % k])
        s.send_multipart(codec.encode(cluster.key, m.ChannelStatsRequest(False), msg_id=5, sender="x",
                                      signer=codec.CLIENTS))
        replies = []
        while not any(isinstance(r, m.ChannelStats) for r in replies):
            assert s.poll(60_000), len(replies)
            replies.append(codec.decode(cluster.key, s.recv_multipart())[1])
        errors = [r for r in replies if isinstance(r, m.Error)]
        assert 1 <= len(errors) <= 200, len(errors)
    finally:
        s.close()
        ctx.term()
