"""Tenant isolation without sockets: the keys, the controller core's checks of
what a peer may do, the worker's data-port rules and its bound on pending
fetches (issue #21; the attacks against a live cluster are in
test_robustness.py)."""
from __future__ import annotations

import math

import pytest

from tests.test_controller_tenancy import Rig, make_rig  # noqa: F401  (the fixture)
from zpath import keys
from zpath.ids import buffer_id
from zpath.errors import ErrorKind, ZpathError
from zpath.net import codec
from zpath.net import messages as m
from zpath.net.codec import CLIENTS, CLUSTER, PROTOCOL_VERSION
from zpath.net.transport import RateLimit
from zpath.worker.state import MAX_PENDING_FETCHES, WorkerState, refused_on_data

pytestmark = pytest.mark.timeout(60)


# ---- keys ----------------------------------------------------------------------

def test_a_session_key_is_sealed_for_holders_of_the_cluster_key_only():
    k = keys.Keys(b"c" * 32, b"w" * 32)
    session = k.session(7)
    assert session == keys.session_key(b"w" * 32, 7) != k.session(8)
    sealed = keys.seal(k.clients, b"nonce", 7, session)
    assert sealed != session
    got, cid, of = keys.client_keys(k.clients, b"nonce", 7, sealed)
    assert (got, cid) == (session, 7)
    assert of(CLIENTS) == k.clients and of(7) == session and of(8) is None and of(CLUSTER) is None
    # another cluster key (or nonce) opens it to something else
    assert keys.client_keys(b"x" * 32, b"nonce", 7, sealed)[0] != session
    assert keys.client_keys(k.clients, b"other", 7, sealed)[0] != session
    # the roles' keys, as a receiver looks them up by signer
    assert k.of(CLUSTER) == k.workers and k.of(CLIENTS) == k.clients and k.of(7) == session
    assert k.of(-2) is None and k.of(keys.MAX_CLIENT_ID + 1) is None


def test_a_message_is_checked_under_its_signers_key():
    k = keys.Keys(b"c" * 32, b"w" * 32)
    as_7 = codec.encode(k.session(7), m.Ping(1), msg_id=1, sender="c", signer=7)
    header, msg, _ = codec.decode(k.of, as_7)
    assert header.signer == 7 and msg == m.Ping(1)
    # client 8 signing as client 7, or a receiver that refuses signer 7
    with pytest.raises(codec.ProtocolError, match="bad signature"):
        codec.decode(k.of, codec.encode(k.session(8), m.Ping(1), msg_id=1, sender="c", signer=7))
    with pytest.raises(codec.ProtocolError, match="no key for its signer"):
        codec.decode(lambda s: None, as_7)
    with pytest.raises(codec.ProtocolError, match="no key for its signer"):
        codec.decode(k.of, [as_7[0], b"\xc1", as_7[2]])


def test_buffer_ids_never_reach_another_clients_range():
    assert buffer_id(3, (1 << 32) - 1) >> 32 == 3
    for n in (0, 1 << 32):
        with pytest.raises(ZpathError, match="buffer ids"):
            buffer_id(3, n)


def test_rate_limit_allows_bursts_then_the_rate_and_counts_what_it_dropped():
    r = RateLimit(rate=10.0, burst=3.0)
    assert [r.allow("a", 0.0) for _ in range(5)] == [1, 1, 1, 0, 0]
    assert r.allow("b", 0.0) == 1             # per peer
    assert r.allow("a", 0.1) == 3             # one token back: allowed, and 2 dropped before it
    assert r.allow("a", 0.1) == 0


# ---- the controller ---------------------------------------------------------------

def test_attack_5_worker_messages_need_the_worker_key_and_execdone_its_host(make_rig):
    rig = make_rig(hosts=((0, 1), (0, 1)))
    c = rig.c
    reg = m.RegisterWorker("fake", 0, "tcp://x:9", 1, "cpu", 4, PROTOCOL_VERSION, [0, 1, 2, 3],
                           "", 0, 1, "m", "", "")
    assert "worker key" in c.refuses(b"new", CLIENTS, reg)
    assert "worker key" in c.refuses(b"new", 5, reg)
    assert c.refuses(b"new", CLUSTER, reg) == ""
    assert "cluster key" in c.refuses(b"new", CLUSTER, m.Hello("x", PROTOCOL_VERSION, 1.0))
    # what checks a peer's messages: a worker the worker key, a client its own session key
    a, aid = rig.client("a")
    assert c.keys_of(b"w0")(CLUSTER) == c.keys.workers and c.keys_of(b"w0")(aid) is None
    assert c.keys_of(a)(aid) == c.keys.session(aid) and c.keys_of(a)(CLUSTER) is None
    assert c.keys_of(a)(aid + 1) is None and c.keys_of(a)(CLIENTS) is None
    assert c.sign_for(b"w0") == (c.keys.workers, CLUSTER) and c.sign_for(a) == (c.keys.clients, CLIENTS)
    # ExecDone only from a host that runs the execution (here host 0)
    call, out = rig.call(a, 0)
    rig.handle(a, call)
    [exec_id] = c.in_flight
    rig.handle(b"w1", m.ExecDone(exec_id, m.ErrorInfo("RemoteError", "forged", 1, "", ""), 1000.0, 1000.1))
    assert exec_id in c.in_flight and c.directory.buffers[out].error is None
    # nor as a row of a batch (protocol 4, relays): from a host that is not the
    # relay it was sent through (it went directly: there is none), nor from a client
    forged = m.ExecRow(0, exec_id, m.ErrorInfo("RemoteError", "forged", 0, "", ""), 1000.0, 1000.1)
    rig.handle(b"w1", m.batch_of([m.ExecRow(1, exec_id, None, 1000.0, 1000.1), forged]))
    n = len(rig.log)
    rig.handle(a, m.batch_of([forged]))
    assert exec_id in c.in_flight and c.directory.buffers[out].error is None
    assert [x.code for i, x in rig.log[n:] if i == a and type(x) is m.Error] == [ErrorKind.BAD_REQUEST]
    rig.finish(exec_id)
    assert exec_id not in c.in_flight and c.directory.buffers[out].error is None


def test_attack_4_a_rejected_call_frees_only_the_senders_ids(make_rig):
    rig = make_rig()
    a, aid = rig.client("a")
    b, _ = rig.client("b")
    av = m.Aval([1, 4], "float32")
    theirs = [rig.new_id(a) for _ in range(3)]
    mine = rig.new_id(b)
    bad = m.Call(next(rig.ids), "0" * 64, [1], ["i"], [0],
                 [*(m.CallInput(x, av, [None, None], True) for x in theirs), m.CallInput(mine, av, [None, None], True)],
                 [])
    n = len(rig.log)
    rig.handle(b, bad)
    assert any(isinstance(x, m.CallFailed) for i, x in rig.log[n:] if i == b)
    frees = [f for _, x in rig.log[n:] if isinstance(x, m.Free) for f in x.buffers]
    assert frees == [mine]


def test_attack_6_declared_sizes_are_bounded_and_status_survives(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    huge = m.Aval([2 ** 40, 2 ** 40], "float32")
    for av, why in ((huge, "larger than"), (m.Aval([-1, 4], "float32"), "is not a shape"),
                    (m.Aval([4], "no-such-dtype"), "is not known")):
        call = m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [0], [],
                      [m.CallOutput(rig.new_id(a), av, [None] * len(av.shape))])
        n = len(rig.log)
        rig.handle(a, call)
        [failed] = [x for i, x in rig.log[n:] if isinstance(x, m.CallFailed)]
        assert why in failed.error.message, failed
    # the largest a call may declare is accepted and counted: Status still encodes
    big = m.Aval([1 << 42], "float32")
    assert math.prod(big.shape) * 4 == 1 << 44
    rig.handle(a, m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [0], [],
                         [m.CallOutput(rig.new_id(a), big, [None])]))
    rig.handle(a, m.StatusRequest(False))
    status = [x for i, x in rig.log if isinstance(x, m.Status)][-1]
    codec.encode(b"k" * 32, status, msg_id=1, sender="controller")
    assert max(d.nbytes for d in status.devices) >= 1 << 40


# ---- the worker ---------------------------------------------------------------------

def test_attack_1_2_3_a_data_port_takes_a_clients_own_buffers_and_workers_pieces():
    mine, theirs = buffer_id(3, 1), buffer_id(4, 1)
    put = m.Put(mine, 0, [[0, 1]], m.Aval([1], "float32"))
    fetch = m.Fetch(1, mine, 0, [[0, 1]], 1.0)
    assert refused_on_data(3, put) == "" and refused_on_data(3, fetch) == ""
    for signer in (4, CLUSTER, CLIENTS):
        assert "not the signer's" in refused_on_data(signer, put)
        assert "not the signer's" in refused_on_data(signer, fetch)
    assert "not the signer's" in refused_on_data(3, m.Fetch(1, theirs, 0, [[0, 1]], 1.0))
    for piece in (m.Piece(1, m.Aval([1], "float32"), None), m.PieceChunk(1, m.Aval([1], "float32"), 0, 1),
                  m.ShmPiece(1, m.Aval([1], "float32"), "zpath-x", 0, 4, []),
                  # (relays: a forwarded message of the controller, a group host's report to its relay)
                  m.Forwarded(0, "tcp://x:1", [1], [0], []),
                  m.batch_of([m.ExecRow(1, 5, None, 1.0, 2.0)], 0)):
        assert refused_on_data(CLUSTER, piece) == ""
        assert "from workers only" in refused_on_data(3, piece)
        assert "from workers only" in refused_on_data(CLIENTS, piece)
    assert refused_on_data(CLIENTS, m.ChannelStatsRequest(False)) == ""


def test_attack_7_pending_fetches_are_bounded_per_client():
    st = WorkerState(15.0, 0.0)
    a = [st.fetch(b"a", m.Fetch(k, buffer_id(1, k + 1), 0, [[0, 1]], 60.0), 0.0)
         for k in range(MAX_PENDING_FETCHES)]
    assert all(p is not None for p in a)
    assert st.fetch(b"a", m.Fetch(0, buffer_id(1, 1), 0, [[0, 1]], 60.0), 0.0) is None
    assert st.fetch(b"b", m.Fetch(0, buffer_id(2, 1), 0, [[0, 1]], 60.0), 0.0) is not None   # per client
    assert a[0].claim()                 # answered: room for one more
    assert st.fetch(b"a", m.Fetch(0, buffer_id(1, 1), 0, [[0, 1]], 60.0), 0.0) is not None
    assert not a[0].claim() and st.fetch(b"a", m.Fetch(0, buffer_id(1, 1), 0, [[0, 1]], 60.0), 0.0) is None
    # the deadline answers them too
    assert len(st.expire_fetches(61.0)) == MAX_PENDING_FETCHES + 1
    assert st.pending_fetches == {}
    st.validate_state()
