"""Simulated hosts (zpath.worker.simulate): the worker protocol without JAX.

The first tests drive one SimProcess of two hosts from a fake controller (a
ROUTER socket in the test) through every message a worker must answer; the
last ones run the real controller with simulated hosts in their own process:
16 hosts end to end through benchmarks/scale.py, and a killed process whose
hosts are reported lost as real ones are."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from tests.conftest import run_script
from zpath.cluster.launcher import SimulatedCluster
from zpath.errors import ErrorKind
from zpath.keys import session_key
from zpath.net import codec
from zpath.net import messages as m
from zpath.net.codec import CLUSTER, PROTOCOL_VERSION
from zpath.net.transport import Endpoint, make_context, unbatched
from zpath.worker import relay as relays
from zpath.worker import simulate
from zpath.worker.simulate import SimProcess, program_cost_s, sim_program

pytestmark = pytest.mark.timeout(120)

KEY = b"s" * 32
ROOT = Path(__file__).resolve().parents[1]


def _scale_module() -> Any:
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "benchmarks" / "scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeController:
    """A ROUTER socket that plays the controller for a SimProcess."""

    def __init__(self) -> None:
        self.ctx = make_context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.ep = Endpoint(KEY, "controller")
        self.inbox: list[tuple[bytes, m.Record]] = []

    def send(self, ident: bytes, msg: m.Record, buffers: list | None = None) -> None:
        self.ep.send(self.sock, msg, to=ident, buffers=buffers or [])

    def expect(self, kind: type, timeout: float = 10.0, where: Any = None) -> tuple[bytes, Any]:
        """The next message of this type (and passing ``where``) from any host."""
        deadline = time.monotonic() + timeout
        while True:
            for k, (ident, msg) in enumerate(self.inbox):
                if isinstance(msg, kind) and (where is None or where(msg)):
                    del self.inbox[k]
                    return ident, msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind.__name__} within {timeout}s; got {self.inbox}")
            if self.sock.poll(int(left * 1000)):
                ident, header, msg, buffers = self.ep.recv(self.sock, router=True)
                self.inbox += [(ident, item) for _, item, _ in unbatched(header, msg, buffers)]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def sim():
    """A SimProcess of two hosts (two devices each) registered with a fake controller."""
    yield from _sim(True)


@pytest.fixture(params=[True, False], ids=["groups", "per-host"])
def sim_groups(request):
    """As ``sim``, with groups of hosts (SimGroup) or without."""
    yield from _sim(request.param)


def _sim(groups: bool):
    ctl = FakeController()
    proc = SimProcess(KEY, ctl.address, hosts=2, devices=2, cost_ms=5.0, groups=groups)
    t = threading.Thread(target=lambda: (proc.register(10.0), proc.serve_forever()), daemon=True)
    t.start()
    idents = {}
    for rank in range(2):
        ident, reg = ctl.expect(m.RegisterWorker)
        assert reg.platform == "sim" and reg.num_devices == 2 and reg.protocol == PROTOCOL_VERSION
        devices = [m.DeviceInfo(rank * 2 + i, rank, 0, i, reg.jax_ids[i], "sim") for i in range(2)]
        ctl.send(ident, m.Registered(rank, devices))
        idents[rank] = ident
    data = ctl.ctx.socket(zmq.DEALER)
    data.connect(proc.data_address)
    yield ctl, proc, idents, data
    proc.stop()
    t.join(10)
    data.close(0)
    ctl.close()
    assert not t.is_alive()


def _client_ep(client: int) -> Endpoint:
    """What client ``client`` signs with (KEY is the worker key here too)."""
    return Endpoint(session_key(KEY, client), f"client:{client}", signer=client)


def _request(ctl: FakeController, data: zmq.Socket, msg: m.Record, buffers: list | None = None,
             signer: int | None = None):
    """Send ``msg`` on the data port and return the answer: as the client whose
    buffer it names (``signer``: as that client instead), else as the controller."""
    if signer is None and isinstance(msg, (m.Put, m.Fetch)):
        signer = msg.buffer >> 32
    ep = ctl.ep if signer in (None, CLUSTER) else _client_ep(signer)
    ep.send(data, msg, buffers=buffers or [])
    assert data.poll(10_000), f"no answer to {type(msg).__name__}"
    _, _, reply, bufs = ep.recv(data)
    return reply, bufs


AV = m.Aval([4], "float32")


def _execute(exec_id: int, seq: int, digest: str, inputs: list, out: int | None, hold: bool = False):
    outputs = [] if out is None else [m.ExecOutput(out, AV, ["x"])]
    return m.Execute(exec_id, seq, digest, "f", [4], ["x"], [0, 1, 2, 3], [0, 1, 2, 3], inputs, outputs, hold)


def test_program_costs_are_declared_by_the_program_bytes():
    assert program_cost_s(sim_program(2.5), 0.001) == pytest.approx(0.0025)
    assert program_cost_s(b"a real jax.export blob", 0.001) == 0.001
    assert program_cost_s(b"zpath-sim-program\n{not json", 0.004) == 0.004
    with pytest.raises(ValueError):
        sim_program(-1.0)


def test_a_program_cost_is_worked_out_once_per_process(monkeypatch):
    """Every host of a process gets the program's bytes: they are read once."""
    ctl = FakeController()
    proc = SimProcess(KEY, ctl.address, hosts=2, devices=1, cost_ms=5.0)
    try:
        blob = sim_program(2.5)
        assert proc.program_cost("d1", blob) == pytest.approx(0.0025)
        read = []
        monkeypatch.setattr(simulate, "program_cost_s", lambda b, d: read.append(b) or program_cost_s(b, d))
        assert proc.program_cost("d1", blob) == pytest.approx(0.0025) and read == []
        # other bytes under a name seen before are read (not the remembered cost)
        assert proc.program_cost("d1", sim_program(7.0)) == pytest.approx(0.007) and len(read) == 1
        assert proc.program_cost("d2", b"a real jax.export blob") == pytest.approx(0.005)
    finally:
        proc.close()
        ctl.close()


def test_a_simulated_host_answers_every_control_message(sim):
    ctl, proc, idents, data = sim
    h0, h1 = idents[0], idents[1]
    # Ping -> Pong with the store's size
    ctl.send(h0, m.Ping(7))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 7)
    assert (pong.shards, pong.nbytes, pong.device_bytes) == (0, 0, [0, 0])
    # a program declaring 30 ms; an SPMD computation over both hosts makes x (no inputs)
    blob = sim_program(30.0)
    digest = hashlib.sha256(blob).hexdigest()
    for ident in (h0, h1):
        ctl.send(ident, m.RegisterProgram(digest, "f"), [blob])
    x, y = 1 << 32 | 1, 1 << 32 | 2
    make = _execute(1, 0, digest, [], x)
    for ident in (h0, h1):
        ctl.send(ident, make)
    made = [ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 1)[1] for _ in range(2)]
    assert all(d.error is None and d.end - d.start == pytest.approx(0.030, abs=1e-6) for d in made)
    # the same Execute for both hosts, its input's shards left to them (in place)
    read = _execute(2, 1, digest, [m.ExecInput(x, AV, ["x"], [])], y)
    for ident in (h0, h1):
        ctl.send(ident, read)
    dones = [ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 2)[1] for _ in range(2)]
    assert all(d.error is None for d in dones)
    # (it started once its input was made, on the emulated clock)
    assert min(d.start for d in dones) >= min(d.end for d in made) - 1e-6
    ctl.send(h0, m.Ping(8))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 8)
    assert (pong.shards, pong.nbytes, pong.device_bytes) == (4, 16, [8, 8])   # x and y: 2 shards each
    # Fetch from the data port: zeros of the shard's shape, once it exists
    reply, bufs = _request(ctl, data, m.Fetch(5, y, 2, [[2, 3]], 10.0))
    assert reply == m.FetchReply(5, m.Aval([1], "float32"), None) and bytes(bufs[0]) == bytes(4)
    reply, bufs = _request(ctl, data, m.Fetch(6, y, 2, [[2, 3]], 10.0, True))     # wait only: no data
    assert reply == m.FetchReply(6, m.Aval([], ""), None) and not bufs
    # Free (after the computations before it): the shards go
    for ident in (h0, h1):
        ctl.send(ident, m.Free([x]))
    ctl.send(h1, m.Ping(9))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 9)
    assert pong.shards == 2 and pong.device_bytes == [4, 4]     # host 1 keeps y only
    # a piece: host 0 sends part of y to host 1, which reads it
    ctl.send(h0, m.SendPiece(11, y, 0, [[0, 1]], [[0, 1]], 1, proc.data_address, "ICI", proc.machine, ""))
    piece_in = m.ExecInput(y, m.Aval([1], "float32"), [None], [
        m.ShardInput(2, [[0, 1]], [m.PieceSource(11, 0, [[0, 1]], [[0, 1]])])])
    ctl.send(h1, m.Execute(3, 2, digest, "g", [1], ["x"], [2], [2], [piece_in], []))
    _, done = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 3)
    assert done.error is None
    # a fused program: defined once, run as one computation (one report)
    inner = m.Execute(0, 0, digest, "f", [4], ["x"], [0, 1, 2, 3], [0, 1, 2, 3],
                      [m.ExecInput(-1, AV, ["x"], [])], [m.ExecOutput(0, AV, ["x"])])
    ctl.send(h0, m.DefineFused(5, [inner, dataclasses.replace(inner, inputs=[m.ExecInput(0, AV, ["x"], [])],
                                                             outputs=[m.ExecOutput(1, AV, ["x"])])], [0]))
    ctl.send(h0, m.RunFused(4, 3, 5, [y], 1 << 32 | 10))
    _, done = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 4)
    assert done.error is None and done.end - done.start == pytest.approx(0.060, abs=1e-6)
    ctl.send(h0, m.DropFused([5]))
    ctl.send(h0, m.RunFused(5, 4, 5, [y], 1 << 32 | 20))
    _, done = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 5)
    assert done.error.kind == ErrorKind.FUSED_UNKNOWN
    # FailBuffers: what waits on a buffer that will never come fails with the error
    z = 2 << 32 | 1
    err = m.ErrorInfo(ErrorKind.REMOTE_ERROR, "client 2 left", None, "", "")
    waits = _execute(6, 5, digest, [m.ExecInput(z, AV, ["x"], [])], None)
    for ident in (h0, h1):
        ctl.send(ident, waits)
        ctl.send(ident, m.FailBuffers([z], err))
    dones = [ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 6)[1] for _ in range(2)]
    assert all(d.error == err for d in dones)
    # FailPieces: a computation waiting on a piece fails
    ctl.send(h1, m.Execute(7, 6, digest, "g", [1], ["x"], [2], [2], [m.ExecInput(y, m.Aval([1], "float32"), [None], [
        m.ShardInput(2, [[0, 1]], [m.PieceSource(99, 0, [[0, 1]], [[0, 1]])])])], []))
    ctl.send(h1, m.FailPieces([99], err))
    _, done = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 7)
    assert done.error == err
    # ClientGone: the client's buffers go (client 1's values; then client 2's failed ones)
    ctl.send(h1, m.ClientGone(1))
    ctl.send(h1, m.Ping(10))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 10)
    assert pong.nbytes == 0 and pong.shards > 0           # z's failed shards are left
    ctl.send(h1, m.ClientGone(2))
    ctl.send(h1, m.Ping(12))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 12)
    assert pong.shards == 0
    # Shutdown: that host leaves (the other stays)
    ctl.send(h1, m.Shutdown("test"))
    ctl.send(h0, m.Ping(11))
    ctl.expect(m.Pong, where=lambda p: p.seq == 11)


def test_the_data_port_takes_puts_answers_fetches_and_refuses_the_rest(sim):
    ctl, proc, idents, data = sim
    b = 3 << 32 | 1
    put = m.Put(b, 1, [[2, 4]], m.Aval([2], "float32"))
    _client_ep(3).send(data, put, buffers=[np.zeros(2, np.float32)])
    reply, bufs = _request(ctl, data, m.Fetch(1, b, 1, [[2, 4]], 10.0))
    assert reply.error is None and reply.aval == m.Aval([2], "float32") and len(bytes(bufs[0])) == 8
    # another client (or the worker key) may not fetch it, nor put in its place
    for signer in (4, 0):
        reply, _ = _request(ctl, data, m.Fetch(9, b, 1, [[2, 4]], 10.0), signer=signer)
        assert isinstance(reply, m.Error) and "not the signer's" in reply.message
    # a Put whose bytes do not make its shape is refused
    reply, _ = _request(ctl, data, m.Put(b + 1, 1, [[0, 2]], m.Aval([2], "float32")), [b"xyz"])
    assert isinstance(reply, m.Error) and reply.code == ErrorKind.BAD_REQUEST
    # a device no host of the process has
    reply, _ = _request(ctl, data, m.Fetch(2, b, 99, [[0, 1]], 1.0))
    assert isinstance(reply, m.Error) and "device 99" in reply.message
    # a fetch of what never comes answers at its deadline
    reply, _ = _request(ctl, data, m.Fetch(3, b + 7, 0, [[0, 1]], 0.2))
    assert reply.error.kind == ErrorKind.DEADLINE_EXCEEDED
    reply, _ = _request(ctl, data, m.ChannelStatsRequest(False))
    assert isinstance(reply, m.ChannelStats)
    reply, _ = _request(ctl, data, m.Ping(1))
    assert isinstance(reply, m.Error) and "not accepted" in reply.message
    # a message under another key: a protocol error, and the host keeps serving
    Endpoint(b"o" * 32, "x").send(data, m.Ping(1))
    assert data.poll(10_000)
    _, _, reply, _ = ctl.ep.recv(data)
    assert isinstance(reply, m.Error) and reply.code == ErrorKind.PROTOCOL


def test_hosts_that_run_the_same_computations_answer_as_lone_ones(sim_groups):
    """A relay's computations for both hosts run as one group record (or per
    host): every host answers on the wire the same either way; a message to
    one host splits it off, its queued and running work with it."""
    ctl, proc, idents, data = sim_groups
    h0, h1 = idents[0], idents[1]
    blob = sim_program(30.0)
    digest = hashlib.sha256(blob).hexdigest()
    for ident in (h0, h1):
        ctl.send(ident, m.RegisterProgram(digest, "f"), [blob])
    ids = iter(range(100, 200))

    def relay(msg: m.Record, collect: list[int]) -> None:
        frames = codec.encode(KEY, msg, msg_id=next(ids), sender="controller")
        ctl.send(h0, m.Relay([0, 1], [proc.data_address] * 2, [1, 1], collect), frames)

    def rows(exec_id: int) -> list[tuple[int, float, float]]:
        """The relay's rows for ``exec_id``, both hosts': (host, start, end) of
        each. They come in one batch, or in two when one host's row came more
        than the relay's hold after the other's (a loaded machine)."""
        got: list[tuple[int, float, float]] = []
        while len(got) < 2:
            _, batch = ctl.expect(m.ExecDoneBatch, where=lambda b: exec_id in b.exec_ids)
            assert set(batch.exec_ids) == {exec_id} and not batch.errors
            got += zip(batch.hosts, batch.starts, batch.ends, strict=True)
        return sorted(got)

    x, y, z, w, v = (1 << 32 | k for k in range(1, 6))
    relay(_execute(1, 0, digest, [], x), [1])
    made = rows(1)
    assert [h for h, _, _ in made] == [0, 1]
    assert all(e - s == pytest.approx(0.030, abs=1e-6) for _, s, e in made)
    relay(_execute(2, 1, digest, [m.ExecInput(x, AV, ["x"], [])], y), [2])
    read = rows(2)
    assert [h for h, _, _ in read] == [0, 1] and min(s for _, s, _ in read) >= max(e for _, _, e in made) - 1e-6
    reply, bufs = _request(ctl, data, m.Fetch(5, y, 2, [[2, 3]], 10.0))
    assert reply == m.FetchReply(5, m.Aval([1], "float32"), None) and bytes(bufs[0]) == bytes(4)
    ctl.send(h1, m.Ping(1))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 1)
    assert (pong.shards, pong.nbytes, pong.device_bytes) == (4, 16, [8, 8])   # x and y: 2 shards each
    relay(m.Free([x]), [])
    ctl.send(h0, m.Ping(2))             # (on the relay's socket: after the Free)
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 2)
    assert (pong.shards, pong.device_bytes) == (2, [4, 4])      # y only
    # a computation for host 1 alone (it splits off), then one for both again
    ctl.send(h1, m.Execute(3, 2, digest, "g", [2], ["x"], [2, 3], [2, 3], [],
                           [m.ExecOutput(z, m.Aval([2], "float32"), ["x"])]))
    _, alone = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 3)
    assert alone.error is None
    ctl.send(h1, m.Ping(3))
    _, pong = ctl.expect(m.Pong, where=lambda p: p.seq == 3)
    assert (pong.shards, pong.nbytes, pong.device_bytes) == (4, 16, [8, 8])   # y and z
    relay(_execute(4, 3, digest, [m.ExecInput(y, AV, ["x"], [])], w), [4])
    assert [h for h, _, _ in rows(4)] == [0, 1]
    # host 1 splits off while both hosts' computation runs: it still reports
    # that one through the relay, and runs its own after it, on its devices
    relay(_execute(5, 4, digest, [m.ExecInput(w, AV, ["x"], [])], v), [5])
    ctl.send(h1, m.Execute(6, 5, digest, "g", [2], ["x"], [2, 3], [2, 3], [], []))
    both = rows(5)
    _, after = ctl.expect(m.ExecDone, where=lambda d: d.exec_id == 6)
    assert [h for h, _, _ in both] == [0, 1] and after.start >= both[1][2] - 1e-6
    reply, _ = _request(ctl, data, m.Fetch(6, v, 3, [[3, 4]], 10.0))
    assert reply.error is None
    assert (proc.group_runs > 0) == proc.groups


def test_a_program_comes_through_a_relay_with_its_bytes_and_a_malformed_relay_is_dropped(sim, caplog):
    """A ``RegisterProgram`` carried by a ``Relay`` (its frames and its one
    buffer) reaches both hosts: their computation runs for the program's
    declared 30 ms, not the process's default 5 ms. A ``Relay`` with too many
    buffers, or whose message's bytes were changed, is dropped with a log
    line, and the hosts go on. So is a ``DefineFused`` with a bad run in a
    device list, and one with good runs is run."""
    ctl, proc, idents, data = sim
    h0, h1 = idents[0], idents[1]
    blob = sim_program(30.0)
    digest = hashlib.sha256(blob).hexdigest()
    ids = iter(range(100, 200))
    sent = [0]                   # direct messages to host 0 (its Relays): each host's `after`

    def relay(msg: m.Record, collect: list[int], buffers: list = (), extra: list = (), spoil: bool = False,
              body: bytes | None = None) -> None:
        frames = codec.encode(KEY, msg, msg_id=next(ids), sender="controller", buffers=buffers, body=body)
        if spoil:
            frames[-1] = bytes(frames[-1])[:-1] + b"?"
        sent[0] += 1
        ctl.send(h0, m.Relay([0, 1], [proc.data_address] * 2, [sent[0], 0], collect), [*frames, *extra])

    with caplog.at_level("WARNING", logger="zpath.worker.simulate"):
        relay(m.RegisterProgram(digest, "f"), [], [blob], extra=[b""] * m.RELAY_BUFFERS)    # too many
        relay(m.RegisterProgram(digest, "f"), [], [blob], spoil=True)                        # not as signed
        ctl.send(h0, m.Ping(1))
        sent[0] += 1
        ctl.expect(m.Pong, where=lambda p: p.seq == 1)
        assert any("at most 4 of its buffers" in r.getMessage() for r in caplog.records), caplog.text
        assert any("rejected a message relay 0 forwarded" in r.getMessage() for r in caplog.records), caplog.text
        relay(m.RegisterProgram(digest, "f"), [], [blob])
        relay(_execute(1, 0, digest, [], 1 << 32 | 1), [1])
        _, batch = ctl.expect(m.ExecDoneBatch, where=lambda b: 1 in b.exec_ids)
    assert sorted(batch.hosts) == [0, 1] and not batch.errors
    assert all(e - s == pytest.approx(0.030, abs=1e-6) for s, e in zip(batch.starts, batch.ends, strict=True))
    # a fused program whose device lists come as runs (as the controller sends a long
    # list), relayed; one with a bad run is refused with its place, and the hosts go on
    inner = m.Execute(0, 0, digest, "f", [4], ["x"], [0, 1, 2, 3], [0, 1, 2, 3], [], [m.ExecOutput(0, AV, ["x"])])

    def define(runs: list) -> bytes:
        wire = inner.to_wire()
        return msgpack.packb([7, [wire[:6] + [runs, runs] + wire[8:]], []])

    with caplog.at_level("WARNING", logger="zpath.worker.simulate"):
        relay(m.DefineFused(7, [], []), [], body=define([[0, 4, 0]]))
        relay(m.DefineFused(7, [], []), [], body=define([[0, 4, 1]]))
        relay(m.RunFused(2, 1, 7, [], 1 << 32 | 50), [2])
        _, batch = ctl.expect(m.ExecDoneBatch, where=lambda b: 2 in b.exec_ids)
    assert "rejected a message relay 0 forwarded: DefineFused.executes[0].devices[0]: a run's step is 0" \
        in caplog.text
    assert sorted(batch.hosts) == [0, 1] and not batch.errors
    assert all(e - s == pytest.approx(0.030, abs=1e-6) for s, e in zip(batch.starts, batch.ends, strict=True))


def test_a_block_of_rows_makes_the_columns_its_rows_would():
    err = m.ErrorInfo(ErrorKind.REMOTE_ERROR, "x", 3, "", "")
    row = m.ExecRow(3, 8, err, 1.0, 2.0, 0.5)
    block = relays.RowBlock(7, [5, 6], 3.0, 4.0)
    rows = [m.ExecRow(5, 7, None, 3.0, 4.0), row, m.ExecRow(6, 7, None, 3.0, 4.0)]
    got = relays.batch_of([block, row], 2)
    by_host = lambda rs: sorted(rs, key=lambda r: r.host)  # noqa: E731
    assert by_host(m.rows_of(got)) == by_host(rows) and got.relay == 2
    assert relays.batch_of([row], 2) == m.batch_of([row], 2)
    state = relays.RelayState()
    state.collect([7], [5, 6, 9])
    state.rows_in(block, 0.0)
    assert state.take_rows(0.0) == []                # host 9's row is still to come
    state.row_in(m.ExecRow(9, 7, None, 3.0, 4.0), 0.0)
    assert len(m.rows_of(relays.batch_of(state.take_rows(0.0)))) == 3
    state.validate_state()


def test_the_simulator_cpu_benchmark_counts_both_ways():
    res = run_script([str(ROOT / "benchmarks" / "sim_cpu.py"), "--hosts", "64", "--nodes", "4", "--repeats", "2",
                      "--per-host", "--json"], timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["hosts"] == 64 and len(got["groups_us_per_host_per_node"]) == 2
    assert got["groups_median"] > 0 and got["per_host_median"] > 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a process's CPU clock: Linux")
def test_the_scale_benchmarks_read_another_process_cpu_finer_than_proc_steps():
    """scale.py's controller CPU per node over a short --quick run read 0 from
    /proc's 10 ms steps (a flaky test above): it reads the process's CPU clock.
    Watched while a child spins, its CPU time grows by less than a step at a time."""
    import psutil
    scale = _scale_module()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 30: pass"])
    try:
        proc = psutil.Process(child.pid)
        steps, last, deadline = [], scale.cpu_s(proc), time.monotonic() + 20
        while len(steps) < 20 and time.monotonic() < deadline:
            now = scale.cpu_s(proc)
            if now > last:
                steps.append(now - last)
            last = now
        assert len(steps) == 20 and min(steps) < 0.009, steps
        assert 0 < last <= sum(proc.cpu_times()[:2]) + 0.02     # the same time psutil counts, finer
    finally:
        child.kill()
        child.wait(10)


def test_the_simulated_worker_imports_no_jax():
    code = ("import sys, zpath.worker.simulate, zpath.cluster.cli; "
            "sys.exit(1 if any(n == 'jax' or n.startswith('jax.') for n in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("relays", [False, True], ids=["direct", "relays"])
def test_sixteen_simulated_hosts_end_to_end_through_the_scale_benchmark(relays):
    """(With relays: groups of 4, for every message of 4 hosts or more.)"""
    flags = ["--relay-min-hosts", "4", "--relay-group", "4"] if relays else ["--relay-min-hosts", "0"]
    p = run_script([str(ROOT / "benchmarks" / "scale.py"), "--hosts", "16", "--quick", "--big-nodes", "300",
                    "--repeats", "1", "--fused-nodes", "8", "--fused-runs", "2", "--json", *flags], timeout=100)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out + err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["hosts"] == 16 and r["devices"] == 64
    for k in ("spmd_nodes_per_s", "traced_nodes_per_s", "sequential_nodes_per_s", "ctl_cpu_us_per_spmd_node",
              "ctl_rss_mib", "max_stall_ms", "pipeline_parallel_over_sequential"):
        assert r[k] > 0, (k, r)
    assert r["big_program_nodes"] == 300 and r["pipeline_stages"] == 16
    assert r["busy"] and all(0 < v <= 1.05 for v in r["busy"].values())
    assert r["busy_warm"].keys() == r["busy"].keys() == r["busy_fixed_ms"].keys()
    assert all(0 < v <= 1.05 for v in r["busy_warm"].values())
    assert (r["relayed_messages"] > 0) == relays, r["relayed_messages"]
    # a template of 8 nodes over the 64 devices (device lists as runs): run, fused, run fused
    assert r["fused_nodes"] == 8 and r["fused_timeline_names"] == ["scale_fused (8 nodes, fused)"], r
    assert r["fused_first_run_ms"] > 0 and r["fused_define_run_ms"] > 0 and r["fused_max_stall_ms"] > 0
    assert len(r["fused_runs_ms"]) == 2 and all(v > 0 for v in r["fused_runs_ms"])


def test_a_killed_simulated_process_loses_its_hosts_as_real_ones_are():
    scale = _scale_module()
    env = {"ZPATH_HOST_TIMEOUT": "2", "ZPATH_PING_INTERVAL": "0.2"}
    with SimulatedCluster(4, 2, islands=2, processes=2, cost_ms=1.0, env=env, start_timeout=60) as c:
        d = scale.Driver(c.address, c.key)
        try:
            island1 = [h for h in d.hosts if h.island == 1]
            devs1 = [dev.id for h in island1 for dev in h.devices]
            slow = d.program(60_000.0)                 # a minute: still running when the hosts go
            call, out = d.spmd(slow, devs1, None)
            d.send_calls([call])
            victim = c.process_of(island1[0].name)
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            deadline = time.monotonic() + 30
            down: dict[int, m.HostDown] = {}
            while time.monotonic() < deadline and set(down) != {h.rank for h in island1}:
                if d.sock.poll(200):
                    _, header, msg, buffers = d.ep.recv(d.sock)
                    down.update((x.rank, x) for _, x, _ in unbatched(header, msg, buffers)
                                if isinstance(x, m.HostDown))
            assert set(down) == {h.rank for h in island1}, down
            assert all(x.error.kind == ErrorKind.HOST_LOST for x in down.values())
            # a call there is refused with HostLost; island 0 keeps working
            call, _ = d.spmd(d.program(1.0), devs1, None)
            d.send_calls([call])
            refused = None
            while refused is None and time.monotonic() < deadline:
                if d.sock.poll(200):
                    _, header, msg, buffers = d.ep.recv(d.sock)
                    refused = next((x for _, x, _ in unbatched(header, msg, buffers)
                                    if isinstance(x, m.CallFailed) and x.call_id == call.call_id), None)
            assert refused is not None and refused.error.kind == ErrorKind.HOST_LOST
            devs0 = [dev.id for h in d.hosts if h.island == 0 for dev in h.devices]
            call, out0 = d.spmd(d.program(1.0), devs0, None)
            d.send_calls([call])
            d.wait_for(out0, devs0[0], len(devs0), timeout=20)
        finally:
            d.close()


def test_relays_in_two_islands_and_a_transfer_between_them():
    """Two islands of 8 simulated hosts (two devices each), relays for
    messages of 4 hosts or more in groups of 4: SPMD nodes on each island go
    through relays (the controller's count grows with each), and so does the
    program, to each island's hosts before their first node; a node on
    island 1 reads island 0's output (a transfer between the islands): its
    Executes go directly, after the program that came through the relays."""
    scale = _scale_module()
    env = {"ZPATH_RELAY_MIN_HOSTS": "4", "ZPATH_RELAY_GROUP": "4"}
    with SimulatedCluster(16, 2, islands=2, cost_ms=1.0, env=env, start_timeout=60) as c:
        d = scale.Driver(c.address, c.key)
        try:
            devs = {i: [dev.id for h in d.hosts if h.island == i for dev in h.devices] for i in (0, 1)}
            assert len(devs[0]) == len(devs[1]) == 16
            prog = d.program(1.0)
            relayed = d.relayed()
            calls, outs = scale.chain(d, prog, devs[0], 3)            # island 0
            d.send_calls(calls)
            d.wait_for(outs[-1], devs[0][0], 16, timeout=30)
            after0 = d.relayed()
            # 2 groups of 4 hosts per node, and the program first
            assert after0 == relayed + 3 * 2 + 2, (relayed, after0)
            # island 1 reads island 0's last output (moved between the islands), then goes on
            calls, outs1 = scale.chain(d, prog, devs[1], 3, x=outs[-1])
            d.send_calls(calls)
            d.wait_for(outs1[-1], devs[1][0], 16, timeout=30)
            d.drain()                                                 # (raises on a refused call)
            # (the first node's Execute differs per host, each naming its pieces: it goes
            # directly; the program through the relays)
            assert d.relayed() == after0 + 2 * 2 + 2
            d.release(outs + outs1)
        finally:
            d.close()
