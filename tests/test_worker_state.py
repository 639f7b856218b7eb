"""The worker's decisions as pure state (zpath/worker/state.py): events in,
what to do out, on a fake clock; ``validate_state()`` after every event."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from zpath import sharding
from zpath.ids import buffer_id, client_of, serial_of
from zpath.net import channels
from zpath.net import messages as m
from zpath.worker.state import (FETCH_HEAP_MIN, FreeOrder, IDLE_WAIT_S, MAX_FETCH_TIMEOUT_S, Chunks, FusedRun,
                                LocalShards, ShapedLink, WorkerState, fetch_timeout)

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def advance(self, s: float) -> float:
        self.now += s
        return self.now


def checked(state: WorkerState | ShapedLink | Chunks):
    """Call ``validate_state`` after every call of one of the state's methods."""
    class Proxy:
        def __getattr__(self, name):
            attr = getattr(state, name)
            if not callable(attr):
                return attr

            def call(*a, **k):
                out = attr(*a, **k)
                state.validate_state()
                return out
            return call
    state.validate_state()
    return Proxy()


def execute(inputs: list[int], outputs: list[int], devices: list[int]) -> m.Execute:
    av = m.Aval([2], "float32")
    return m.Execute(0, 0, "p" * 64, "f", [len(devices)], ["i"], devices, devices,
                     [m.ExecInput(b, av, ["i"], []) for b in inputs],
                     [m.ExecOutput(b, av, ["i"]) for b in outputs])


def fetch(request: int, buffer: int, timeout_s: float) -> m.Fetch:
    return m.Fetch(request, buffer, 0, [[0, 2]], timeout_s)


def test_buffer_ids_pack_the_client():
    b = buffer_id(7, 42)
    assert client_of(b) == 7 and serial_of(b) == 42
    assert b == (7 << 32) | 42
    assert client_of(buffer_id(0, 2 ** 32 - 1)) == 0


def test_fused_programs_are_defined_run_and_dropped():
    clock = Clock()
    raw = WorkerState(15.0, clock.now)
    raw.rank = 3
    s = checked(raw)
    # reads inputs -1 and -2 (codes), makes 0 and 1; releases 0; devices 2, 0, 1
    define = m.DefineFused(9, [execute([-1, -2], [0], [2, 0]), execute([0], [1], [1, 0])], [0])
    s.define_fused(define)
    assert raw.fused[9].devices == [0, 1, 2] and raw.fused[9].reads == 2
    run = s.run_fused(m.RunFused(100, 5, 9, [buffer_id(1, 1), buffer_id(1, 2)], buffer_id(1, 10), True))
    assert isinstance(run, FusedRun)
    assert (run.exec_id, run.seq, run.devices, run.hold) == (100, 5, [0, 1, 2], True)
    assert [run.buffer(c) for c in run.release] == [buffer_id(1, 10)]       # what is freed after it
    assert run.buffer(-2) == buffer_id(1, 2) and run.buffer(1) == buffer_id(1, 11)
    again = s.run_fused(m.RunFused(101, 6, 9, [buffer_id(1, 3), buffer_id(1, 4)], buffer_id(1, 20)))
    assert again.plan is run.plan and not again.hold        # runs share what the executor learns
    # a run that gives fewer inputs than the program reads, and an unknown one
    err = s.run_fused(m.RunFused(102, 7, 9, [buffer_id(1, 3)], buffer_id(1, 30)))
    assert err == m.ErrorInfo("FusedUnknown", "fused program 9 reads more inputs than the run gives",
                              3, "", "")
    s.drop_fused(m.DropFused([9, 12]))                      # 12 was never defined: no matter
    err = s.run_fused(m.RunFused(103, 8, 9, [1, 2], 100))
    assert err == m.ErrorInfo("FusedUnknown", "fused program 9 is unknown here", 3, "", "")
    # defined again (the controller fused it again): a fresh plan
    s.define_fused(define)
    assert s.run_fused(m.RunFused(104, 9, 9, [1, 2], 100)).plan is not run.plan


def test_a_fused_program_whose_shards_were_left_empty_names_this_host_s():
    """The controller sends hosts whose parts are alike one DefineFused with
    the in-place inputs' shards empty: each host names its own devices' (as
    for an Execute), inputs it names itself kept as they are."""
    s = checked(WorkerState(15.0, 0.0))
    av = m.Aval([4], "float32")
    named = [m.ShardInput(2, [[2, 3]], [m.PieceSource(0, 3, [[3, 4]], [[0, 1]])])]
    ex = m.Execute(0, 0, "p" * 64, "f", [4], ["i"], [0, 1, 2, 3], [0, 1, 2, 3],
                   [m.ExecInput(-1, av, ["i"], []), m.ExecInput(-2, av, ["i"], named)],
                   [m.ExecOutput(0, av, ["i"])])
    ex2 = m.Execute(0, 0, "p" * 64, "g", [4], ["i"], [0, 1, 2, 3], [0, 1, 2, 3],
                    [m.ExecInput(0, av, ["i"], [])], [m.ExecOutput(1, av, ["i"])])
    define = m.DefineFused(9, [ex, ex2], [0])
    s.define_fused(define, LocalShards({2: "cpu:2", 3: "cpu:3"}))
    p = s.fused[9]
    assert p.devices == [0, 1, 2, 3] and p.reads == 2
    mine = [m.ShardInput(2, [[2, 3]], []), m.ShardInput(3, [[3, 4]], [])]
    assert [[i.shards for i in x.inputs] for x in p.definition.executes] == [[mine, named], [mine]]
    assert define.executes[0].inputs[0].shards == []         # the message itself is left as it was
    run = s.run_fused(m.RunFused(100, 5, 9, [buffer_id(1, 1), buffer_id(1, 2)], buffer_id(1, 10)))
    assert isinstance(run, FusedRun) and run.executes is p.definition.executes


def test_puts_of_departed_clients_are_dropped():
    s = checked(WorkerState(15.0, 0.0))
    for c in (5, 3, 4, 9):
        s.client_gone(c)
    assert len(s.gone_clients) == 2                         # [3-5], [9]
    assert s.put_from_gone_client(buffer_id(4, 1))
    assert s.put_from_gone_client(buffer_id(9, 2 ** 32 - 1))
    assert not s.put_from_gone_client(buffer_id(6, 1)) and not s.put_from_gone_client(buffer_id(2, 7))


def test_a_silent_controller_is_given_up_after_its_timeout():
    clock = Clock()
    s = checked(WorkerState(15.0, clock.now))
    assert not s.controller_lost(clock.advance(15.0))       # not more than the timeout yet
    s.heard_from_controller(clock.now)
    assert not s.controller_lost(clock.advance(14.9))
    assert s.controller_lost(clock.advance(0.2))


def test_fetches_are_answered_once_at_their_deadline_or_before():
    clock = Clock()
    raw = WorkerState(15.0, clock.now)
    raw.rank = 1
    s = checked(raw)
    assert s.next_deadline_in(clock.now) == IDLE_WAIT_S
    a = s.fetch(b"c1", fetch(1, 11, 2.0), clock.now)
    b = s.fetch(b"c1", fetch(2, 12, 0.25), clock.now)
    c = s.fetch(b"c2", fetch(3, 13, 1.0), clock.now)
    assert s.next_deadline_in(clock.now) == pytest.approx(0.25)
    assert s.expire_fetches(clock.advance(0.2)) == []
    assert s.next_deadline_in(clock.now) == pytest.approx(0.05)
    assert c.claim()                                    # its shard came: answered with it
    assert s.expire_fetches(clock.advance(0.9)) == [b]  # c's deadline passed too, but it was answered
    assert not b.claim()                                # a value that comes now is not sent
    err = s.deadline_error(b)
    assert err.kind == "DeadlineExceeded" and err.host == 1 and "buffer 12" in err.message
    assert s.next_deadline_in(clock.now) == IDLE_WAIT_S         # a: 0.9 s away; looked at twice a second
    assert s.next_deadline_in(clock.now + 0.7) == pytest.approx(0.2)
    assert s.expire_fetches(clock.advance(5.0)) == [a]
    assert raw.fetches == []


def test_fetch_timeouts_are_clamped():
    assert fetch_timeout(float("nan")) == 0.0
    assert fetch_timeout(-3.0) == 0.0
    assert fetch_timeout(math.inf) == MAX_FETCH_TIMEOUT_S
    assert fetch_timeout(2.5) == 2.5
    clock = Clock()
    s = checked(WorkerState(15.0, clock.now))
    p = s.fetch(b"c", fetch(1, 1, float("nan")), clock.now)
    q = s.fetch(b"c", fetch(2, 1, 1e12), clock.now)
    assert s.expire_fetches(clock.now) == [p]
    assert q.deadline == clock.now + MAX_FETCH_TIMEOUT_S


def test_answered_fetches_do_not_grow_the_heap_for_long():
    clock = Clock()
    raw = WorkerState(15.0, clock.now)
    s = checked(raw)
    waiting = [s.fetch(b"c", fetch(0, 1, 100.0), clock.now) for _ in range(10)]
    for k in range(5 * FETCH_HEAP_MIN):             # a busy client: each answered at once
        assert s.fetch(b"c", fetch(k, 2, 100.0), clock.now).claim()
    assert len(raw.fetches) <= FETCH_HEAP_MIN + 1
    # the ones still waiting were kept, and expire at their deadline
    assert s.expire_fetches(clock.advance(100.0)) == waiting


def test_the_shaped_link_paces_pieces_and_forgets_a_lost_peer():
    clock = Clock(0.0)
    # 10 ms latency, 8 Gbit/s = 1 GB/s; chunks of 1 MiB
    link = checked(ShapedLink(channels.Shaper(10.0, 8.0)))
    assert link.active and link.next_due_in(clock.now) == IDLE_WAIT_S
    av = m.Aval([1 << 19], "float32")
    big = np.zeros(1 << 19, np.float32)                     # 2 MiB: two chunks
    link.send(1, m.Piece(7, av, None), [big], clock.now)
    small = m.Piece(8, m.Aval([4], "float32"), None)
    link.send(2, small, [np.zeros(4, np.float32)], clock.now)
    first_due = (1 << 20) / 1e9 + 0.010
    assert link.next_due_in(clock.now) == pytest.approx(first_due)
    assert link.take_due(clock.advance(first_due - 1e-6)) == []
    [(rank, chunk, bufs)] = link.take_due(clock.advance(2e-6))
    assert rank == 1 and chunk == m.PieceChunk(7, av, 0, 2 << 20) and bufs[0].nbytes == 1 << 20
    got = link.take_due(clock.advance(1.0))
    assert [(r, type(msg).__name__) for r, msg, _ in got] == [(1, "PieceChunk"), (2, "Piece")]
    assert got[0][1].offset == 1 << 20 and got[1][1] is small

    # host 1 is lost: its queued pieces go, and the link time they booked is
    # given back to the others
    clock.advance(10.0)
    link.send(1, m.Piece(9, av, None), [big], clock.now)
    link.send(2, small, [np.zeros(4, np.float32)], clock.now)
    assert link.next_due_in(clock.now) == pytest.approx(first_due)
    link.drop_peer(1, clock.now)
    link.drop_peer(5, clock.now)                             # nothing queued for it
    assert link.next_due_in(clock.now) == pytest.approx(16 / 1e9 + 0.010)
    [(rank, msg, _)] = link.take_due(clock.advance(1.0))
    assert rank == 2 and msg is small


def test_an_unshaped_link_is_inactive():
    link = ShapedLink(channels.Shaper())
    assert not link.active


def _typed(aval: m.Aval, flat: np.ndarray) -> np.ndarray:
    return flat.view(np.dtype(aval.dtype)).reshape(aval.shape)


def test_chunks_assemble_a_piece_and_a_refused_piece_drops_its_later_chunks():
    chunks = checked(Chunks(_typed))
    av = m.Aval([4], "float32")
    data = np.arange(4, dtype=np.float32).view(np.uint8)
    assert chunks.take(m.PieceChunk(1, av, 0, 16), [data[:8]]) is None
    got = chunks.take(m.PieceChunk(1, av, 8, 16), [data[8:]])
    np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))
    # a chunk past the piece's end: refused, and so are its later chunks,
    # until the last one (then nothing is left of it)
    assert chunks.take(m.PieceChunk(2, av, 0, 16), [data[:8]]) is None
    with pytest.raises(ValueError):
        chunks.take(m.PieceChunk(2, av, 12, 16), [data[:8]])
    chunks.refuse(2)
    assert chunks.take(m.PieceChunk(2, av, 8, 16), [data[8:]]) is None
    assert chunks.partial == {}
    # a piece that failed (FailPieces) while it came
    assert chunks.take(m.PieceChunk(3, av, 0, 16), [data[:8]]) is None
    chunks.forget(3)
    assert chunks.partial == {}


def test_shared_memory_pieces_are_lent_while_the_budget_allows():
    s = checked(WorkerState(15.0, 0.0))
    big = channels.ZERO_COPY_RECV
    assert not s.lend(0, big - 1)                          # small: copied out
    assert not s.lend(channels.XLA_ALIGN // 2, big)        # XLA would copy it anyway
    n = channels.LEND_MAX_BYTES // big
    for _ in range(n):
        assert s.lend(0, big)
        s.lent(big)
    assert not s.lend(0, big)                              # over the budget: copied out
    s.returned(big)
    assert s.lend(0, big)


def test_a_free_waits_for_every_computation_that_arrived_before_it():
    order = FreeOrder()
    a, b = order.arrive(), order.arrive()
    assert order.free_after_earlier([1], True) == []          # a and b may still read buffer 1
    c = order.arrive()
    assert order.free_after_earlier([2], False) == []
    assert order.finish(b) == []                              # a has not finished
    order.validate_state()
    assert order.finish(a) == [([1], True)]                   # c arrived after the first Free
    assert order.finish(c) == [([2], False)]
    assert order.free_after_earlier([3], True) == [([3], True)]   # nothing before it: at once
    order.validate_state()


def _execute(devices: list[int], mesh_shape: list[int], axis_names: list[str],
             inputs: list[tuple[list[int], list]], exec_id: int = 7) -> m.Execute:
    return m.Execute(exec_id, exec_id, "p" * 64, "f", mesh_shape, axis_names, devices, devices,
                     [m.ExecInput(100 + k, m.Aval(shape, "float32"), spec, [])
                      for k, (shape, spec) in enumerate(inputs)],
                     [m.ExecOutput(200, m.Aval([8], "float32"), [None])], hold=True)


def _expected(ex: m.Execute, local: set[int]) -> list[list[tuple[int, list[list[int]]]]]:
    """Each input's (device, region) of the local devices, worked out afresh."""
    out = []
    for inp in ex.inputs:
        regs = sharding.regions(inp.aval.shape, ex.mesh_shape, ex.axis_names, inp.spec)
        out.append([(d, [list(r) for r in regs[p]]) for p, d in enumerate(ex.devices) if d in local])
    return out


def _named(ex: m.Execute) -> list[list[tuple[int, list[list[int]]]]]:
    for inp in ex.inputs:
        assert all(not s.pieces for s in inp.shards)
    return [[(s.device, s.region) for s in inp.shards] for inp in ex.inputs]


def test_local_shards_remembered_never_stale():
    """LocalShards names each empty input's local shards; what it remembers is
    never served for another placement, mesh, shape or spec."""
    local = {1: object(), 2: object()}
    ls = LocalShards(local)
    cases = [
        _execute([0, 1, 2, 3], [4], ["i"], [([8], ["i"]), ([8, 4], [None, "i"])]),
        _execute([0, 1, 2, 3], [4], ["i"], [([16], ["i"]), ([8, 4], [None, None])]),     # shape, spec
        _execute([3, 2, 1, 0], [4], ["i"], [([8], ["i"]), ([8, 4], [None, "i"])]),       # devices' order
        _execute([0, 1, 2, 3], [2, 2], ["a", "b"], [([8], ["a"]), ([8], ["b"])]),         # mesh, axes
        _execute([0, 1, 2, 3], [2, 2], ["b", "a"], [([8], ["a"]), ([8], [["a", "b"]])]),
        _execute([0, 1, 4, 5], [4], ["i"], [([8], ["i"])]),                              # other devices
    ]
    first = [_named(ls(ex)) for ex in cases]
    for ex, got in zip(cases, first, strict=True):
        assert got == _expected(ex, set(local))
        assert _named(ls(ex)) == got           # asked again: the same
    assert first[0] == [[(1, [[2, 4]]), (2, [[4, 6]])], [(1, [[0, 8], [1, 2]]), (2, [[0, 8], [2, 3]])]]
    assert first[1] == [[(1, [[4, 8]]), (2, [[8, 12]])], [(1, [[0, 8], [0, 4]]), (2, [[0, 8], [0, 4]])]]
    assert first[2][0] == [(2, [[2, 4]]), (1, [[4, 6]])]
    assert first[3] == [[(1, [[0, 4]]), (2, [[4, 8]])], [(1, [[4, 8]]), (2, [[0, 4]])]]
    assert first[5] == [[(1, [[2, 4]])]]
    # the rest of the message is as it came
    got = ls(cases[0])
    assert (got.exec_id, got.seq, got.devices, got.hold, got.outputs) == (7, 7, [0, 1, 2, 3], True, cases[0].outputs)
    assert [i.buffer for i in got.inputs] == [100, 101] and got.inputs[1].spec == [None, "i"]


def test_local_shards_of_a_long_device_list_are_those_of_a_short_one():
    """Over every device of 512 hosts (a list much longer than the host's own,
    searched in C), in any order, the local shards come out as a scan finds them."""
    rng = random.Random(5)
    for local in ({0: 0, 1: 1, 2: 2, 3: 3}, {2044: 0, 2045: 1, 2046: 2, 2047: 3}, {7: 0, 900: 1, 5000: 2}):
        for order in ("up", "down", "shuffled"):
            devices = list(range(2048))
            if order == "down":
                devices.reverse()
            elif order == "shuffled":
                rng.shuffle(devices)
            for mesh, axes, specs in (([2048], ["i"], [([4096], ["i"]), ([8, 2048], [None, "i"])]),
                                      ([512, 4], ["h", "d"], [([1024, 8], ["h", "d"]), ([4096], [["h", "d"]])])):
                ex = _execute(devices, mesh, axes, specs)
                got = _named(LocalShards(local)(ex))
                assert got == _expected(ex, set(local))
                assert [len(x) for x in got] == [len(set(local) & set(devices))] * len(specs)


def test_local_shards_keeps_named_shards_and_starts_over_when_full():
    local = {0: object()}
    ls = LocalShards(local, max_entries=2)
    named = m.ExecInput(5, m.Aval([4], "float32"), ["i"],
                        [m.ShardInput(0, [[0, 2]], [m.PieceSource(1, 1, [[0, 2]], [[0, 2]])])])
    ex = _execute([0, 1], [2], ["i"], [])
    ex = m.Execute(ex.exec_id, ex.seq, ex.program, ex.name, ex.mesh_shape, ex.axis_names, ex.devices, ex.jax_ids,
                   [named], ex.outputs)
    assert ls(ex) is ex                         # every input named: the message itself
    for n in range(2, 12, 2):                   # more shapes than it keeps
        for _ in range(2):
            got = ls(_execute([0, 1], [2], ["i"], [([n], ["i"]), ([2 * n], ["i"])]))
            assert _named(got) == [[(0, [[0, n // 2]])], [(0, [[0, n]])]]
            assert 0 < len(ls) <= 2
    mixed = m.Execute(ex.exec_id, ex.seq, ex.program, ex.name, ex.mesh_shape, ex.axis_names, ex.devices,
                      ex.jax_ids, [named, m.ExecInput(6, m.Aval([4], "float32"), ["i"], [])], ex.outputs)
    got = ls(mixed)
    assert got.inputs[0] is named and [(s.device, s.region) for s in got.inputs[1].shards] == [(0, [[0, 2]])]
