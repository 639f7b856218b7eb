"""Relays (issue #20): the controller's groups, relayed sends, order counts
and report batches as a pure ControllerCore (fake workers and clock, state
validated after every event, the Rig of test_controller_tenancy); a worker's
side (worker/relay.py's RelayState) as pure state."""
from __future__ import annotations

import collections
import dataclasses
import random
import time
from typing import Any

import pytest
import zmq

from zpath.config import ControllerConfig
from zpath.controller import dispatch
from zpath.controller.records import Send
from zpath.controller.relays import Inner
from zpath.errors import ErrorKind, ZpathError
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION
from zpath.worker import relay as relays
from zpath.worker.relay import RelayState
from tests.test_controller_tenancy import Rig, loop_on  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


def _rig(n: int = 8, group: int = 4, minimum: int = 4, runtime: str = "rt", **config) -> Rig:
    """``n`` one-device hosts of one island runtime (SPMD over all of them;
    ``runtime=""``: hosts that share none, each lost alone)."""
    rig = Rig(hosts=(), relay_min_hosts=minimum, relay_group=group, **config)
    for h in range(n):
        rig.handle(f"w{h}".encode(), m.RegisterWorker(f"h{h}", 0, f"tcp://x:{h}", 1, "cpu", 1, PROTOCOL_VERSION,
                                                      [h], runtime, h if runtime else 0, n if runtime else 1,
                                                      f"machine{h}", "", ""))
    return rig


def _spmd(rig: Rig, ident: bytes, n: int, inp: int | None = None) -> tuple[m.Call, int]:
    av = m.Aval([n, 4], "float32")
    put = inp is None
    inp = rig.new_id(ident) if put else inp
    out = rig.new_id(ident)
    return m.Call(next(rig.ids), rig.programs["f"][0], [n], ["i"], list(range(n)),
                  [m.CallInput(inp, av, ["i", None], put)], [m.CallOutput(out, av, ["i", None])]), out


def _running(rig: Rig) -> tuple[bytes, int, int]:
    """A client's SPMD call over 8 hosts, handled: (the client, its output,
    its exec id)."""
    a, _ = rig.client("a")
    call, out = _spmd(rig, a, 8)
    rig.handle(a, call)
    return a, out, next(iter(rig.c.in_flight))


def _relays(rig: Rig, since: int = 0) -> list:
    return [e for e in rig.effects[since:] if type(e.msg) is m.Relay]


def _rows(exec_id: int, hosts, error: m.ErrorInfo | None = None) -> list[m.ExecRow]:
    return [m.ExecRow(h, exec_id, error, 1000.0, 1000.001) for h in hosts]


def test_an_spmd_computation_goes_once_per_group_to_its_relay_with_the_order_counts():
    rig = _rig()
    a, _ = rig.client("a")
    mark = len(rig.effects)
    call, out = _spmd(rig, a, 8)
    rig.handle(a, call)
    ex = next(iter(rig.c.in_flight))
    sent = _relays(rig, mark)
    executes = [e for e in sent if type(e.buffers.msg) is m.Execute]
    assert [(e.ident, e.msg.hosts) for e in executes] == [(b"w0", [0, 1, 2, 3]), (b"w4", [4, 5, 6, 7])]
    assert all(isinstance(e.buffers, Inner) and e.msg.collect == [ex] for e in executes)
    assert executes[0].buffers is executes[1].buffers            # one message, encoded once by the loop
    assert executes[0].msg.addresses == [f"tcp://x:{h}" for h in range(4)]
    # the program came first, through the same relays (one message with its bytes, for
    # all hosts), so each host is told of no direct message before it but the relay's own
    # Relays
    programs = [e for e in sent if type(e.buffers.msg) is m.RegisterProgram]
    assert [(e.ident, e.msg.hosts, e.msg.after) for e in programs] == [
        (b"w0", [0, 1, 2, 3], [1, 0, 0, 0]), (b"w4", [4, 5, 6, 7], [1, 0, 0, 0])]
    assert programs[0].buffers is programs[1].buffers and programs[0].msg.collect == []
    assert list(programs[0].buffers.buffers) == [rig.c.programs[call.program][1]]
    assert sent.index(programs[0]) < sent.index(executes[0])
    assert executes[0].msg.after == [2, 0, 0, 0]
    assert not [x for i, x in rig.log[mark:] if type(x) in (m.Execute, m.RegisterProgram)]   # none went directly
    assert rig.c.in_flight[ex].relay_of == {h: 0 if h < 4 else 4 for h in range(8)}
    assert rig.c.relayed_messages == len(sent)


def test_few_hosts_and_the_pings_go_directly():
    rig = _rig(minimum=9)
    a, _ = rig.client("a")
    mark = len(rig.effects)
    rig.handle(a, _spmd(rig, a, 8)[0])
    assert not _relays(rig, mark) and len(rig.executes(0)) == 8
    # the program too, to each host with its bytes
    registers = [e for e in rig.effects[mark:] if type(e.msg) is m.RegisterProgram]
    assert sorted(e.ident for e in registers) == [f"w{h}".encode() for h in range(8)]
    assert all(list(e.buffers) == [rig.c.programs[e.msg.digest][1]] for e in registers)
    rig = _rig()
    mark = len(rig.effects)
    rig.tick(1.0)
    assert not _relays(rig, mark) and sum(type(x) is m.Ping for _, x in rig.log[mark:]) == 8
    # below the minimum, a host that reported is pinged every tick all the same
    rig = _rig(minimum=9)
    a, _ = rig.client("a")
    for _ in range(3):
        rig.handle(a, _spmd(rig, a, 8)[0])
        ex = max(rig.c.in_flight)
        rig.now += 0.5
        for h in range(8):
            rig.handle(f"w{h}".encode(), m.ExecDone(ex, None, 1000.0, 1000.001))
        mark = len(rig.log)
        rig.tick(0.5)
        assert sum(type(x) is m.Ping for _, x in rig.log[mark:]) == 8


def test_hosts_whose_reports_came_since_the_last_tick_skip_one_ping_and_their_rows_keep_them_alive():
    """Liveness from traffic: a host that reported since the last tick (its
    row passed on by its relay) and was pinged then is not pinged this tick;
    every host gets a ping at least every second tick (a worker hears the
    controller only directly); a host whose rows come without Pongs stays
    alive, and one silent in both ways is lost at the timeout, as before."""
    rig = _rig(host_timeout_s=5.0)
    a, _ = rig.client("a")

    def pinged(mark: int) -> list[int]:
        return sorted(int(i[1:]) for i, x in rig.log[mark:] if type(x) is m.Ping)

    mark = len(rig.log)
    rig.tick(1.0)
    assert pinged(mark) == list(range(8))
    for step in range(12):
        call, _ = _spmd(rig, a, 8)
        rig.handle(a, call)
        ex = max(rig.c.in_flight)
        rig.now += 0.5
        rig.handle(b"w0", m.batch_of(_rows(ex, [0, 1, 2, 3])))
        rig.handle(b"w4", m.batch_of(_rows(ex, [4, 5, 6] if step < 4 else [4, 5, 6, 7])))
        if step < 4:                               # host 7 is slow: it reports directly, later
            rig.handle(b"w7", m.ExecDone(ex, None, 1000.0, 1000.001))
        mark = len(rig.log)
        rig.tick(0.5)
        # every host reported: pinged every second tick (a Pong is not a report)
        assert pinged(mark) == ([] if step % 2 == 0 else list(range(8))), step
    assert all(h.alive for h in rig.c.rm.hosts.values())
    assert rig.now - rig.c.peers[b"w5"].last_seen > 5.0       # no Pong for longer than the timeout
    assert not rig.c.late(rig.now) and rig.c.late(rig.now + 5.0)
    rig.c.stalled(rig.now + 5.0, 4.0)       # a held-up loop: its time counts from the last report
    assert not rig.c.late(rig.now + 5.0)
    # hosts 4-7 fall silent (their relay too: no rows, no Pongs); 0-3 go on
    # reporting through theirs, and are pinged every second tick
    quiet = rig.now - 0.5 + 4.0                 # when their last rows came, and the stall's 4 s
    while rig.c.rm.hosts[4].alive:
        call, _ = _spmd(rig, a, 4)
        rig.handle(a, call)
        ex = max(rig.c.in_flight)
        rig.now += 0.5
        rig.handle(b"w0", m.batch_of(_rows(ex, [0, 1, 2, 3])))
        mark = len(rig.log)
        rig.tick(0.5)
        assert rig.c.rm.hosts[4].alive == (rig.now - quiet <= 5.0)
        if rig.c.rm.hosts[4].alive:
            assert set(pinged(mark)) >= {4, 5, 6, 7}
    assert rig.now - quiet <= 6.0
    assert rig.c.rm.hosts[4].lost_why.startswith("no answer for")        # not the island's loss
    assert not rig.c.heard.keys() & set(range(8))                       # (lost hosts are forgotten)


def test_a_relay_s_batch_finishes_its_group_s_hosts_and_the_computation():
    rig = _rig()
    a, out, ex = _running(rig)
    rig.handle(b"w0", m.batch_of(_rows(ex, [1, 0, 3, 2])))
    assert rig.c.in_flight[ex].hosts == {4, 5, 6, 7}
    rig.handle(b"w4", m.batch_of(_rows(ex, [4, 5])))
    rig.handle(b"w4", m.batch_of(_rows(ex, [6, 7, 7])))     # a row twice: dropped
    assert ex not in rig.c.in_flight and out in rig.c.directory.buffers
    assert len([r for r in rig.c.timeline_records(100) if r.exec_id == ex]) == 8


def test_a_batch_charges_its_tenant_what_each_host_ran():
    rig = _rig()
    a, out, ex = _running(rig)
    secs = {h: 0.001 * (h + 1) for h in range(8)}
    rows = lambda hosts: [m.ExecRow(h, ex, None, 1000.0, 1000.0 + secs[h]) for h in hosts]   # noqa: E731
    rig.handle(b"w0", m.batch_of(rows([1, 0, 3, 2])))
    run = rig.c.tenants._running[ex]
    assert run.charged == pytest.approx(sum(secs[h] for h in range(4)))      # one device each
    assert run.longest == pytest.approx(secs[3])
    used = sum(rig.c.tenants.used.values())
    rig.handle(b"w4", m.batch_of(rows([7, 4, 6, 5])))      # the last row finishes it
    assert ex not in rig.c.in_flight
    assert sum(rig.c.tenants.used.values()) - used == pytest.approx(sum(secs.values()))


def _forwarded_in_log(rig: Rig) -> dict[tuple[int, int], int]:
    """(host, relay) -> the Relays in the effects that named the host."""
    counts: dict[tuple[int, int], int] = {}
    for e in rig.effects:
        if type(e.msg) is m.Relay:
            r = int(e.ident[1:])
            for h in e.msg.hosts:
                counts[h, r] = counts.get((h, r), 0) + 1
    return counts


def test_order_counts_kept_per_group_match_every_relay_sent_through_a_regrouping():
    rig = _rig()
    a, _ = rig.client("a")
    x = None
    for _ in range(3):                   # whole groups: each relay's count is one counter
        call, x2 = _spmd(rig, a, 8, x)
        rig.handle(a, call)
        ex = next(iter(rig.c.in_flight))
        rig.handle(b"w0", m.batch_of(_rows(ex, range(4))))
        rig.handle(b"w4", m.batch_of(_rows(ex, range(4, 8))))
        x = x2
    counts = _forwarded_in_log(rig)
    assert counts[5, 4] >= 3 and rig.c._whole
    assert all(rig.c.forwarded(h, r) == n for (h, r), n in counts.items())
    # six of the eight hosts: the second group only in part (per-host counts)
    av = m.Aval([6, 4], "float32")
    call = m.Call(next(rig.ids), rig.programs["f"][0], [6], ["i"], list(range(6)),
                  [m.CallInput(rig.new_id(a), av, ["i", None], True)], [m.CallOutput(rig.new_id(a), av, ["i", None])])
    rig.handle(a, call)
    ex = max(rig.c.in_flight)
    assert [e.msg.hosts for e in _relays(rig) if e.msg.collect == [ex]] == [[0, 1, 2, 3], [4, 5]]
    counts = _forwarded_in_log(rig)
    assert all(rig.c.forwarded(h, r) == n for (h, r), n in counts.items())
    assert rig.c.forwarded(6, 4) < rig.c.forwarded(5, 4)
    # a host registers: the groups change and the counters become each host's
    rig.handle(b"w8", m.RegisterWorker("h8", 0, "tcp://x:8", 1, "cpu", 1, PROTOCOL_VERSION, [8], "", 0, 1,
                                       "machine8", "", ""))
    rig.c.relay_of_hosts()
    assert not rig.c._whole
    assert all(rig.c.forwarded(h, r) == n for (h, r), n in counts.items())
    # and a direct message to host 5 awaits all of them
    mark = len(rig.log)
    rig.handle(a, rig.call(a, 5, inp=None)[0])
    to5 = [x for i, x in rig.log[mark:] if i == b"w5"]
    assert type(to5[0]) is m.Await and (to5[0].relay, to5[0].count) == (4, counts[5, 4])


def test_a_batch_of_several_computations_is_taken_run_by_run_as_row_by_row():
    assert dispatch.RUN_ROWS <= 8          # (the long runs below are taken as a whole)
    rig = _rig(n=24, group=24)
    a, _ = rig.client("a")
    call1, out1 = _spmd(rig, a, 24)
    rig.handle(a, call1)
    call2, out2 = _spmd(rig, a, 24)
    rig.handle(a, call2)
    ex1, ex2 = sorted(rig.c.in_flight)
    err = m.ErrorInfo(ErrorKind.REMOTE_ERROR, "boom", None, "", "")
    rows = _rows(ex1, range(8)) + _rows(ex2, range(10)) + _rows(ex1, [8, 8])
    rows[9] = dataclasses.replace(rows[9], error=err)            # host 1 of ex2 failed
    before = len(rig.c.timeline)
    rig.handle(b"w0", m.batch_of(rows))
    assert rig.c.in_flight[ex1].hosts == set(range(9, 24)) and rig.c.in_flight[ex2].hosts == set(range(10, 24))
    assert rig.c.in_flight[ex2].error is not None and rig.c.in_flight[ex1].error is None
    assert len(rig.c.timeline) - before == 19                     # the row given twice: once
    assert rig.c.tenants._running[ex1].charged == pytest.approx(9 * 0.001)
    # long runs that finish their computations (the last row of each does)
    rig.handle(b"w0", m.batch_of(_rows(ex1, range(9, 24)) + _rows(ex2, range(23, 9, -1))))
    assert not rig.c.in_flight and len(rig.c.timeline) - before == 48
    assert out1 in rig.c.directory.buffers and rig.c.directory.buffers[out1].error is None


def test_a_batch_s_interleaved_rows_are_taken_computation_by_computation():
    """A relay's batch of computations in flight together (op by op, back to
    back) holds their rows interleaved, host by host: each computation's rows
    are taken as a whole, with the same outcome as the same rows run by run."""
    def state(interleaved: bool) -> tuple:
        rig = _rig(n=24, group=24)
        a, _ = rig.client("a")
        for _ in range(2):
            rig.handle(a, _spmd(rig, a, 24)[0])
        ex1, ex2 = sorted(rig.c.in_flight)
        one_by_one = []
        rows_one_by_one = rig.c._rows_one_by_one
        rig.c._rows_one_by_one = lambda x, *rest: (one_by_one.append(x), rows_one_by_one(x, *rest))
        for hosts in (range(20), range(20, 24)):      # 20 rows of each, then the last 4 (row by row)
            by_host = [row for h in hosts for row in _rows(ex1, [h]) + _rows(ex2, [h])]
            rig.handle(b"w0", m.batch_of(by_host if interleaved else _rows(ex1, hosts) + _rows(ex2, hosts)))
            if hosts == range(20):
                assert one_by_one == [] and rig.c.in_flight[ex1].hosts == rig.c.in_flight[ex2].hosts == \
                    set(range(20, 24))
                charged = (rig.c.tenants._running[ex1].charged, rig.c.tenants._running[ex2].charged)
        assert not rig.c.in_flight and one_by_one == [ex1, ex2]
        timeline = sorted((r.exec_id, r.host, r.start, r.end, r.ok) for r in rig.c.timeline_records(100))
        return charged, timeline, sorted(rig.c.directory.buffers), rig.log[-1]

    assert state(True) == state(False)


def test_a_batch_with_a_row_its_sender_does_not_relay_is_rejected_whole(caplog):
    rig = _rig()
    a, _ = rig.client("a")
    rig.handle(a, _spmd(rig, a, 8)[0])
    ex = next(iter(rig.c.in_flight))
    # host 4 relays 4..7, not 1; host 1 is no relay at all
    rig.handle(b"w4", m.batch_of(_rows(ex, [4, 1])))
    rig.handle(b"w1", m.batch_of(_rows(ex, [1, 2])))
    assert rig.c.in_flight[ex].hosts == set(range(8))
    # nor is a batch taken in part whose bad row is of a later computation
    rig.handle(a, _spmd(rig, a, 8)[0])
    ex3 = max(rig.c.in_flight)
    rig.handle(b"w4", m.batch_of(_rows(ex, range(4, 8)) + _rows(ex3, [4, 5, 3])))
    assert rig.c.in_flight[ex].hosts == rig.c.in_flight[ex3].hosts == set(range(8))
    assert "which it does not relay it to: rejected" in caplog.text
    # a host's own rows it takes from the host itself (resent after its relay was lost)
    rig.handle(b"w5", m.batch_of(_rows(ex, [5])))
    assert 5 not in rig.c.in_flight[ex].hosts
    # and a computation sent directly takes no row of another host
    rig2 = _rig(minimum=0)
    b, _ = rig2.client("b")
    rig2.handle(b, _spmd(rig2, b, 8)[0])
    ex2 = next(iter(rig2.c.in_flight))
    rig2.handle(b"w0", m.batch_of(_rows(ex2, [0, 1])))
    assert rig2.c.in_flight[ex2].hosts == set(range(8))


def test_a_batch_whose_columns_do_not_agree_is_rejected(caplog):
    rig = _rig()
    a, _ = rig.client("a")
    rig.handle(a, _spmd(rig, a, 8)[0])
    ex = next(iter(rig.c.in_flight))
    good = m.batch_of(_rows(ex, range(4)))
    for bad in (dataclasses.replace(good, starts=good.starts[:3]),
                dataclasses.replace(good, errors=[m.RowError(4, m.ErrorInfo("RemoteError", "x", 0, "", ""))])):
        rig.handle(b"w0", bad)
    assert rig.c.in_flight[ex].hosts == set(range(8)) and "columns do not agree" in caplog.text
    with pytest.raises(ValueError):
        m.rows_of(dataclasses.replace(good, hosts=good.hosts[:1]))
    rows = _rows(ex, [0, 1], m.ErrorInfo("RemoteError", "x", 0, "", ""))
    assert m.rows_of(m.batch_of(rows, 3)) == rows


def test_a_batch_from_a_client_is_refused():
    rig = _rig()
    a, _ = rig.client("a")
    rig.handle(a, _spmd(rig, a, 8)[0])
    ex = next(iter(rig.c.in_flight))
    mark = len(rig.log)
    rig.handle(a, m.batch_of(_rows(ex, range(8))))
    assert rig.c.in_flight[ex].hosts == set(range(8))
    assert [x.code for i, x in rig.log[mark:] if i == a and type(x) is m.Error] == [ErrorKind.BAD_REQUEST]


def test_a_direct_message_after_relayed_ones_comes_after_an_await():
    rig = _rig()
    a, out, ex = _running(rig)
    rig.handle(b"w0", m.batch_of(_rows(ex, range(4))))
    rig.handle(b"w4", m.batch_of(_rows(ex, range(4, 8))))
    # a one-device call on host 5 goes directly: first an Await for what relay 4 forwarded it
    mark = len(rig.log)
    call, _ = rig.call(a, 5, inp=None)
    rig.handle(a, call)
    to5 = [x for i, x in rig.log[mark:] if i == b"w5"]
    assert type(to5[0]) is m.Await and to5[0].relay == 4 and to5[0].count == rig.c.forwarded(5, 4)
    assert m.Execute in [type(x) for x in to5[1:]]
    mark = len(rig.log)
    rig.handle(a, rig.call(a, 5, inp=None)[0])          # nothing relayed since: no second Await
    assert not [x for i, x in rig.log[mark:] if type(x) is m.Await]


def _hosts_handle(rig: Rig, seed: int, forward_bias: float) -> dict[int, list]:
    """What each host handles, in order, of what the core sent, as workers'
    RelayStates take it when the two paths interleave at random: each host's
    direct messages in the order sent, each relay's forwarded ones in the order
    it handled their Relays, but one path's next message delivered before the
    other's with odds ``forward_bias`` (a forwarded one first) for each
    pick."""
    rng = random.Random(seed)
    rank = {ident: r for r, ident in rig.c.worker_ident.items()}
    states = {r: RelayState() for r in rank.values()}
    handled: dict[int, list] = {r: [] for r in rank.values()}
    direct: dict[int, collections.deque] = {r: collections.deque() for r in rank.values()}
    forwarded: dict[tuple[int, int], collections.deque] = {}
    for e in rig.effects:
        if isinstance(e, Send) and e.ident in rank:
            direct[rank[e.ident]].append((e.msg, e.buffers.msg if type(e.msg) is m.Relay else None))
    while True:
        ds = [h for h, q in direct.items() if q]
        fs = [k for k, q in forwarded.items() if q]
        if not ds and not fs:
            break
        if fs and (not ds or rng.random() < forward_bias):
            h, relay = rng.choice(fs)
            after, collect, inner = forwarded[(h, relay)].popleft()
            handled[h] += [x for x, _ in states[h].forwarded(relay, "", after, collect, inner, [], 0.0)]
            continue
        h = rng.choice(ds)
        msg, inner = direct[h].popleft()
        for x, _ in states[h].direct(msg, [], 0.0):
            if type(x) is m.Relay:
                for host, after in zip(x.hosts, x.after, strict=True):
                    forwarded.setdefault((host, h), collections.deque()).append((after, x.collect, inner))
            else:
                handled[h].append(x)
    for st in states.values():
        st.validate_state()
        assert not st.waiting and not st.held and st.blocked is None
    return handled


def test_each_host_has_the_program_before_the_execute_that_needs_it_whichever_path_each_took():
    """Programs and Executes each go through relays or directly: one-host
    calls (all direct), a new program for 3 of 8 hosts (direct) then for all
    (relayed, and directly to the 3 hosts that lacked it, the Execute relayed),
    and a new program read where pieces move (relayed program, an Execute per
    host sent directly)."""
    rig = _rig()
    a, _ = rig.client("a")
    f, g = rig.programs["f"][0], rig.programs["g"][0]

    def call(program: str, devices: list[int], inp: int | None = None, shape=(8, 4), in_spec=("i", None),
             out_spec=("i", None)) -> tuple[m.Call, int]:
        av = m.Aval(list(shape), "float32")
        put = inp is None
        inp = rig.new_id(a) if put else inp
        out = rig.new_id(a)
        return m.Call(next(rig.ids), program, [len(devices)], ["i"], devices,
                      [m.CallInput(inp, av, list(in_spec), put)], [m.CallOutput(out, av, list(out_spec))]), out

    rig.handle(a, rig.call(a, 5)[0])                          # f on host 5 alone: direct
    rig.handle(a, call(g, [0, 1, 2, 3, 4], shape=(5, 4))[0])  # g for 5 hosts: relayed
    rig.handle(a, call(f, list(range(8)))[0])                 # f for the 7 others: relayed
    rig.handle(a, call(g, list(range(8)))[0])                 # g for hosts 5-7: direct, its Execute relayed
    registers = [(e.ident, e.msg.digest) for e in rig.effects if type(e.msg) is m.RegisterProgram]
    assert registers == [(b"w5", f), (b"w5", g), (b"w6", g), (b"w7", g)]
    # a new program read where the input's pieces move: each host's own Execute, sent
    # directly, its program through the relays
    mixed = rig
    rig = moved = _rig()
    a, _ = rig.client("a")
    f, g = rig.programs["f"][0], rig.programs["g"][0]
    one, x = call(f, [0], shape=(8, 4), in_spec=(None, None), out_spec=(None, None))
    rig.handle(a, one)
    mark = len(rig.effects)
    rig.handle(a, call(g, list(range(8)), inp=x)[0])
    sent = rig.effects[mark:]
    assert [type(e.buffers.msg) for e in sent if type(e.msg) is m.Relay] == [m.RegisterProgram] * 2
    assert sorted(e.ident for e in sent if type(e.msg) is m.Execute) == [f"w{h}".encode() for h in range(8)]
    assert [e.msg for e in sent if type(e.msg) is m.Await and e.ident == b"w5"] == [m.Await(4, 1)]
    for r in (mixed, moved):
        for seed in range(40):
            bias = (0.1, 0.5, 0.9)[seed % 3]
            for host, got in _hosts_handle(r, seed, bias).items():
                assert sum(type(x) is m.Execute for x in got) == len(
                    [1 for e in r.effects if type(e.msg) is m.Execute and r.c.worker_ident.get(host) == e.ident]
                    + [1 for e in r.effects if type(e.msg) is m.Relay and type(e.buffers.msg) is m.Execute
                       and host in e.msg.hosts])
                known: set[str] = set()
                for x in got:
                    if type(x) is m.RegisterProgram:
                        known.add(x.digest)
                    elif type(x) is m.Execute:
                        assert x.program in known, (host, seed, [type(y).__name__ for y in got])


def test_a_lost_relay_fails_what_it_ran_naming_it_and_its_group_gets_a_new_relay():
    rig = _rig(host_timeout_s=5.0)
    a, out, ex = _running(rig)
    rig.handle(b"w0", m.batch_of(_rows(ex, [1, 2])))       # the relay's own row never comes
    mark = len(rig.log)
    rig.run(rig.c._host_lost, 0, "killed")
    failed = [x for i, x in rig.log[mark:] if i == a and type(x) is m.CallFailed and out in x.buffers]
    assert failed and failed[0].error.kind == ErrorKind.HOST_LOST and failed[0].error.host == 0
    assert ex not in rig.c.in_flight
    # (one JAX runtime: its island goes with it.) Hosts of no shared runtime keep
    # theirs, and a group's next live host relays it
    rig = _rig()
    for h in range(8, 12):
        rig.handle(f"w{h}".encode(), m.RegisterWorker(f"h{h}", 1, f"tcp://x:{h}", 1, "cpu", 1, PROTOCOL_VERSION,
                                                      [h], "", 0, 1, f"machine{h}", "", ""))
    assert rig.c.relay_of_hosts()[9] == 8
    rig.run(rig.c._host_lost, 8, "killed")
    assert rig.c.relay_of_hosts()[9] == 9 and 8 not in rig.c.relay_of_hosts()
    assert all(rig.c.relay_of_hosts()[h] == 0 for h in range(4))


def test_a_host_whose_message_is_dropped_is_lost_and_its_group_is_not_left_waiting(loop_on):
    """The controller's queue to host 4 (a relay) is full: the Relay it drops
    would leave hosts 5-7 waiting ORDER_WAIT_S for what 4 forwards. Host 4
    is lost at once instead: its part of the call fails with HostLost and
    every worker gets its HostDown, which releases what waits for it (here
    the island goes with it: its hosts share one JAX runtime)."""
    rig = _rig()
    ctl = loop_on(rig)
    sent: list[tuple[bytes, m.Record]] = []

    def send(sock, msg, to=None, parent=0, buffers=(), msg_id=0, block=True, sign=None):
        if to == b"w4":
            raise zmq.Again()
        sent.append((to, msg))

    def send_batch(sock, msgs, to=None, block=True, sign=None):
        if to == b"w4":
            raise zmq.Again()
        sent.extend((to, e[0]) for e in msgs)
        return []

    ctl.ep.send, ctl.ep.send_batch = send, send_batch
    a, _ = rig.client("a")
    call, out = _spmd(rig, a, 8)
    ctl._run(rig.c.handle(rig.now, a, next(rig.ids), call, []))
    ctl._flush_out()
    rig.c.validate_state()
    assert 4 not in rig.c.worker_ident and b"w4" not in rig.c.peers
    failed = [x for i, x in sent if i == a and type(x) is m.CallFailed and out in x.buffers]
    assert failed and failed[0].error.kind == ErrorKind.HOST_LOST and failed[0].error.host == 4
    assert "queue full" in failed[0].error.message       # (the first message dropped: its RegisterProgram)
    down = {i for i, x in sent if type(x) is m.HostDown and x.rank == 4}
    assert down >= {f"w{h}".encode() for h in (0, 1, 2, 3, 5, 6, 7)}
    assert not rig.c.in_flight and {i for i, x in sent if type(x) is m.Shutdown} == down - {a}
    # a group host that waits for what relay 4 forwards goes on at its HostDown
    s = RelayState()
    s.direct(m.Await(4, 1), [], 0.0)
    s.direct(m.Free([1]), [], 0.0)
    hd = next(x for i, x in sent if i == b"w5" and type(x) is m.HostDown)
    assert _names(s.direct(hd, [], 0.1)) == ["HostDown"]
    assert _names(s.relay_lost(hd.rank, 0.1)) == ["Free[1]"]
    s.validate_state()
    # a drop to a host lost already changes nothing
    assert ctl.core.unreachable(rig.now, 4, "Free") == []


def test_relay_config_is_checked():
    with pytest.raises(ZpathError):
        ControllerConfig(relay_group=0)
    with pytest.raises(ZpathError):
        ControllerConfig(relay_min_hosts=-1)


# ---- a worker's side: RelayState -------------------------------------------------------

def _st() -> RelayState:
    return RelayState()


def _names(items) -> list[str]:
    return [type(x).__name__ + (f"{x.buffers}" if type(x) is m.Free else "") for x, _ in items]


def test_a_forwarded_message_waits_for_the_direct_ones_sent_before_it():
    s = _st()
    # the relay forwards a message sent after two direct ones, which come later
    assert s.forwarded(7, "tcp://r", 2, [5], m.Free([9]), [], 0.0) == []
    s.validate_state()
    assert _names(s.direct(m.Free([1]), [], 0.0)) == ["Free[1]"]
    assert _names(s.direct(m.Free([2]), [], 0.0)) == ["Free[2]", "Free[9]"]
    s.validate_state()
    assert s.route(5) == (7, "tcp://r") and s.route(5) is None


def test_a_direct_message_after_an_await_waits_for_the_forwarded_ones_but_pings_do_not():
    s = _st()
    assert s.direct(m.Await(7, 1), [], 0.0) == []
    assert s.direct(m.Free([1]), [], 0.0) == []
    assert _names(s.direct(m.Ping(1), [], 0.0)) == ["Ping"]
    s.validate_state()
    # the forwarded one was sent before the Await (after 0): it goes, then what waited
    assert _names(s.forwarded(7, "tcp://r", 0, [], m.Free([9]), [], 0.0)) == ["Free[9]", "Free[1]"]
    s.validate_state()
    # (direct: 1 Await, 2 Free[1], 3 Ping, 4 Await, 5 Free[2] held)
    s.direct(m.Await(7, 2), [], 0.0)
    s.direct(m.Free([2]), [], 0.0)
    assert _names(s.forwarded(7, "tcp://r", 3, [], m.Free([4]), [], 0.0)) == ["Free[4]", "Free[2]"]
    # a forwarded message sent after a direct one not here yet waits for it
    assert s.forwarded(7, "tcp://r", 6, [], m.Free([3]), [], 0.0) == []
    s.validate_state()
    assert _names(s.direct(m.Free([5]), [], 0.0)) == ["Free[5]", "Free[3]"]
    s.validate_state()


def test_a_lost_relay_releases_what_waits_for_it_and_its_rows_are_resent():
    s = _st()
    s.forwarded(7, "tcp://r", 0, [5, 6], m.Free([9]), [], 0.0)
    row = relays.row_of(3, m.ExecDone(5, None, 1.0, 2.0))
    s.route(5)
    s.sent_row(7, row, 0.0)
    s.direct(m.Await(7, 5), [], 0.0)
    s.direct(m.Free([1]), [], 0.0)
    assert _names(s.relay_lost(7, 1.0)) == ["Free[1]"]
    assert s.route(6) is None                          # later reports go to the controller
    assert s.rows_for_lost(7, 1.0) == [row] and s.rows_for_lost(7, 1.0) == []
    s.validate_state()
    assert s.direct(m.Await(7, 9), [], 1.0) == []      # a lost relay is not awaited
    assert _names(s.direct(m.Free([2]), [], 1.0)) == ["Free[2]"]


def test_what_waits_too_long_goes_anyway():
    s = _st()
    s.direct(m.Await(7, 1), [], 0.0)
    s.direct(m.Free([1]), [], 0.0)
    assert s.next_due_in(0.0) == relays.ORDER_WAIT_S
    assert s.expire(relays.ORDER_WAIT_S / 2) == []
    assert _names(s.expire(relays.ORDER_WAIT_S + 1)) == ["Free[1]"]
    s.validate_state()


def test_a_relay_passes_its_group_s_rows_on_once_all_came_or_after_its_hold():
    s = _st()
    s.collect([5], [0, 1, 2])
    s.row_in(m.ExecRow(1, 5, None, 1.0, 2.0), 0.0)
    s.row_in(m.ExecRow(0, 5, None, 1.0, 2.0), 0.0)
    assert s.take_rows(0.0) == []
    assert s.next_due_in(0.0) == pytest.approx(relays.RELAY_HOLD_S)
    s.row_in(m.ExecRow(2, 5, None, 1.0, 2.0), 0.0)
    assert [r.host for r in s.take_rows(0.0)] == [1, 0, 2] and s.next_due_in(0.0) is None
    s.collect([6], [0, 1])
    s.row_in(m.ExecRow(0, 6, None, 1.0, 2.0), 0.0)
    assert s.take_rows(relays.RELAY_HOLD_S / 2) == []
    assert [r.host for r in s.take_rows(relays.RELAY_HOLD_S)] == [0]
    s.forget_host(1)                                   # lost: its row will not come
    assert not s.collecting
    s.validate_state()


def test_forwards_one_message_per_data_port():
    relay = m.Relay([3, 4, 5, 6], ["tcp://a", "tcp://b", "tcp://b", "tcp://c"], [1, 2, 3, 4], [9])
    mine, after, out = relays.forwards(relay, 4, "tcp://b")
    assert mine and after == 2
    assert [(a, f.hosts, f.after, f.relay, f.address) for a, f in out] == [
        ("tcp://a", [3], [1], 4, "tcp://b"), ("tcp://b", [5], [3], 4, "tcp://b"), ("tcp://c", [6], [4], 4, "tcp://b")]
    assert relays.check_relay(relay, [b"", b"", b""]) == ""


def test_a_relayed_message_may_carry_its_own_buffers_within_bounds():
    relay = m.Relay([3, 4], ["tcp://a", "tcp://b"], [1, 2], [])
    fwd = m.Forwarded(4, "tcp://b", [3], [1], [])
    for msg in (relay, fwd):
        assert relays.check_relay(msg, [b""] * 4) == ""                       # a RegisterProgram's
        assert relays.check_relay(msg, [b""] * (3 + m.RELAY_BUFFERS)) == ""
        for n in (0, 1, 2, 3 + m.RELAY_BUFFERS + 1):
            assert f"got {n}" in relays.check_relay(msg, [b""] * n)
    assert "3 counts" in relays.check_relay(m.Relay([3, 4], ["tcp://a", "tcp://b"], [1, 2, 3], []), [b""] * 4)


# ---- real workers ------------------------------------------------------------------------

def test_real_workers_relay_and_a_killed_relay_is_named_by_hostlost(tmp_path):
    """Two hosts of one island runtime, relays forced on (groups of 2: host 0
    relays host 1): computations over both run through the relay, their results
    right; a value put and freed, and a one-host call between them (direct
    messages after relayed ones), keep their order. Killing the relay fails
    the running calls with HostLost naming it, without a hang."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import zpath as zp
    from tests.conftest import running_cluster
    from zpath.cluster.testing import kill_host, wait_until
    env = {"ZPATH_HOST_TIMEOUT": "30", "ZPATH_RELAY_MIN_HOSTS": "2", "ZPATH_RELAY_GROUP": "2"}
    with running_cluster(islands=1, hosts_per_island=2, devices_per_host=1, log_dir=str(tmp_path), env=env) as c:
        conn = zp.connect(c.address, c.key)
        try:
            both = zp.make_virtual_device_set().add_slice(devices=2).devices
            one = [d for d in both if d.host == 1]
            step = zp.pmap(lambda x: jax.lax.psum(x, "i") + x, axis_name="i", devices=both)
            inc = zp.pmap(lambda x: x + 1, devices=one)
            x = np.arange(2.0, dtype=np.float32).reshape(2, 1)
            for k in range(5):
                y = step(x)
                z = inc(np.full((1, 1), k, np.float32))
                np.testing.assert_allclose(np.asarray(y), x + x.sum(0))
                assert float(np.asarray(z)[0, 0]) == k + 1
                x = np.asarray(y)
            # a result can be fetched from its host before the relay's batch
            # carrying its report reaches the controller: wait for that report
            wait_until(lambda: conn.client.request(m.StatusRequest(False)).running == 0, timeout=20,
                       what="the last computations' reports through the relay")
            st = conn.client.request(m.StatusRequest(False))
            assert st.relayed >= 5 and st.running == 0
            heavy = zp.pmap(lambda x: jax.lax.psum(jnp.tanh(x @ x.T), "i")[:1] + x[:1], axis_name="i",
                            devices=both)
            big = np.ones((2, 400, 400), np.float32) * 1e-3
            running = [heavy(big) for _ in range(60)]
            running[0].result(timeout=60)
            kill_host(c, 0)
            t = time.monotonic()
            with pytest.raises(zp.HostLost) as lost:
                for r in running:
                    r.result(timeout=60)
            assert str(lost.value).startswith("host 0 ("), lost.value
            assert time.monotonic() - t < 20          # not the heartbeat's 30 s
        finally:
            zp.shutdown()
