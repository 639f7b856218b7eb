"""The worker's message handlers in one process, without peers: what a
message does to the state and the store, and what the worker sends back
(read from its outbox, never from a socket)."""
from __future__ import annotations

import select

import jax
import numpy as np
import pytest

from zpath.config import CommonConfig, WorkerConfig
from zpath.ids import buffer_id
from zpath.net import messages as m
from zpath.worker.executor import Executor
from zpath.worker.server import Worker
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


def test_a_fetch_not_ready_by_its_deadline_gets_deadline_exceeded_and_leaves_nothing(worker):
    worker._handle_data(CLIENT, 7, m.Fetch(2, buffer_id(1, 2), 0, [[0, 4]], 0.0), [])
    worker._expire_fetches()
    [(kind, target, reply)] = sent(worker)
    assert (kind, target) == ("data", CLIENT)
    assert reply.request == 2 and reply.error.kind == "DeadlineExceeded"
    assert worker.store.stats([0]) == (0, 0, [0]) and worker.store.buffers_of(1) == []
    worker.state.validate_state()


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
