"""The controller core as a pure state machine: driven with fake peers and a
fake clock, no sockets and no sleeps (timeouts are exercised by advancing the
clock), its state checked with ``validate_state`` after every event (the Rig
of test_controller_tenancy does that)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from zpath.controller.admission import SEND_BUDGET, SEND_COST
from zpath.controller.core import ControllerCore, RemoveSegments, Send
from zpath.controller.dispatch import BUCKET_PIECE_BYTES
from zpath.controller.failures import PEER_ANSWER_S
from zpath.controller.records import Timeline, call_buffers
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION
from tests.test_controller_tenancy import _fill_window, make_rig  # noqa: F401  (fixture)
from tests.test_templates import define, run, sent

pytestmark = pytest.mark.timeout(60)

CONTROLLER = pathlib.Path(__file__).parent.parent / "zpath" / "controller"


def test_ticks_ping_the_workers_and_a_silent_worker_is_lost_when_the_clock_passes_its_timeout(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)), host_timeout_s=10.0, client_timeout_s=30.0)
    a, _ = rig.client("a")
    call, out = rig.call(a, 1)
    rig.handle(a, call)                            # runs on host 1, which goes silent
    mark = len(rig.log)
    rig.tick(1.0)
    assert sorted(i for i, _ in sent(rig, mark, m.Ping)) == [b"w0", b"w1"]
    seqs = {x.seq for _, x in sent(rig, mark, m.Ping)}
    rig.tick(1.0)
    assert {x.seq for _, x in sent(rig, mark, m.Ping)} - seqs    # each round its own seq
    for _ in range(9):                             # host 0 and the client answer; host 1 does not
        rig.now += 1.0
        rig.handle(b"w0", m.Pong(0, 0, 0, [0]))
        rig.handle(a, m.Ping(1))
        rig.tick()
        assert rig.c.rm.hosts[1].alive == (rig.now - 1000.0 <= 10.0)
    assert not rig.c.late(rig.now)
    assert not rig.c.rm.hosts[1].alive and rig.c.rm.hosts[0].alive
    assert out in rig.failed(a)
    assert {i for i, x in rig.log if isinstance(x, m.HostDown) and x.rank == 1} == {a, b"w0"}
    assert not rig.c.in_flight and b"w1" not in rig.c.peers


def test_a_silent_client_is_treated_as_gone_and_everything_it_holds_is_freed(make_rig):
    rig = make_rig(host_timeout_s=10.0, client_timeout_s=15.0)
    a, ca = rig.client("a")
    call, out = rig.call(a, 0)
    rig.handle(a, call)
    rig.drain()
    assert out in rig.c.directory.buffers
    for _ in range(20):
        rig.now += 1.0
        rig.handle(b"w0", m.Pong(0, 0, 0, [0]))    # the worker answers, the client does not
        assert rig.c.late(rig.now) == (a in rig.c.peers and rig.now - 1000.0 > 15.0)
        rig.tick()
        assert (a in rig.c.peers) == (rig.now - 1000.0 <= 15.0)
    assert a not in rig.c.peers and out not in rig.c.directory.buffers
    assert (b"w0", m.ClientGone(ca)) in rig.log
    assert rig.idle()


def test_time_the_loop_was_held_up_does_not_count_as_silence(make_rig):
    rig = make_rig(host_timeout_s=10.0)
    rig.now += 12.0
    assert rig.c.late(rig.now)
    rig.c.stalled(rig.now, 5.0)                   # the loop was busy for 5 s beyond its tolerance
    assert not rig.c.late(rig.now)
    rig.tick()
    assert rig.c.rm.hosts[0].alive
    rig.tick(4.0)
    assert not rig.c.rm.hosts[0].alive


def test_a_long_program_stops_at_flush_points_and_resume_goes_on(make_rig):
    """Planning stops after nodes 1, 2, 4, 8, ... (``busy``) so that the loop
    sends what is ready; ``resume`` goes on; nothing else differs."""
    rig = make_rig()
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    calls, prev = [], None
    for _ in range(40):
        call, prev = rig.call(a, 0, prev)
        calls.append(call)
    groups = []
    out = rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), [])
    while True:
        rig.c.validate_state()
        groups.append(sum(isinstance(e, Send) and isinstance(e.msg, m.Execute) for e in out))
        if not rig.c.busy:
            break
        out = rig.c.resume(rig.now)
    assert groups == [1, 1, 2, 4, 8, 16, 8]
    assert not rig.c.resume(rig.now)               # not busy: nothing to do
    # one call is planned at once
    out = rig.c.handle(rig.now, a, 2, rig.call(a, 0, prev)[0], [])
    assert not rig.c.busy and sum(isinstance(e.msg, m.Execute) for e in out) == 1


def _chain(rig, a, n: int, device: int = 0, prev=None):
    calls = []
    for _ in range(n):
        call, prev = rig.call(a, device, prev)
        calls.append(call)
    return calls, prev


def _slices(rig, out) -> list[int]:
    """Executes sent per slice while the core is busy (resumed by hand)."""
    groups = []
    while True:
        rig.c.validate_state()
        groups.append(sum(isinstance(e, Send) and isinstance(e.msg, m.Execute) for e in out))
        if not rig.c.busy:
            return groups
        out = rig.c.resume(rig.now)


def test_a_long_program_is_planned_in_slices_of_at_most_64_nodes(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    calls, _ = _chain(rig, a, 300)
    out = rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), [])
    assert _slices(rig, out) == [1, 1, 2, 4, 8, 16, 32, 64, 64, 64, 44]


def test_other_clients_are_served_between_slices_and_the_same_client_waits_its_turn(make_rig):
    """While client a's long program is planned a slice at a time, client b's
    call is planned at once; a's own later call (it reads the program's last
    output) and release wait until the program is planned, then go in order."""
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, _ = rig.client("a")
    b, _ = rig.client("b")
    for dev in (0, 1):
        rig.c.tenants._cost[(rig.programs["f"][0], (dev,))] = 1e-6
    calls, last = _chain(rig, a, 40)
    out = rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), [])
    assert rig.c.busy and rig.c.paused_client(rig.c.peers[a])
    first = sum(isinstance(e.msg, m.Execute) for e in out)
    later, after = rig.call(a, 0, last)
    assert not rig.c.handle(rig.now, a, 2, later, [])                 # a's: deferred
    assert not rig.c.handle(rig.now, a, 3, m.Release([calls[0].outputs[0].buffer]), [])
    pong = rig.c.handle(rig.now, a, 4, m.Ping(9), [])                 # a ping is answered at once
    assert [type(e.msg) for e in pong] == [m.Pong]
    theirs, out_b = rig.call(b, 1)
    got = rig.c.handle(rig.now, b, 5, theirs, [])                     # b's: planned now
    assert [e.msg.outputs[0].buffer for e in got if isinstance(e.msg, m.Execute)] == [out_b]
    rig.c.validate_state()
    groups = [first] + _slices(rig, rig.c.resume(rig.now))
    # once the program is planned, a's deferred call went with its last slice
    assert groups == [1, 1, 2, 4, 8, 16, 8 + 1]
    assert not rig.c.busy and not rig.c.deferred_msgs
    assert after in rig.c.directory.buffers and calls[0].outputs[0].buffer not in rig.c.directory.buffers


def test_a_client_that_leaves_while_its_program_is_paused_has_nothing_more_planned(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6
    calls, _ = _chain(rig, a, 100)
    out = rig.c.handle(rig.now, a, 1, m.Program(1, "chain", "parallel", calls, []), [])
    planned = sum(isinstance(e.msg, m.Execute) for e in out)
    rig.c.handle(rig.now, a, 2, rig.call(a, 0)[0], [])                # deferred
    rig.c.handle(rig.now, a, 3, m.Goodbye("bye"), [])
    rig.c.validate_state()
    assert not rig.c.busy and not rig.c.deferred_msgs and planned < 100
    assert not rig.c.resume(rig.now)


def test_what_one_event_sends_of_planned_nodes_is_bounded_and_resume_goes_on(make_rig):
    """When the computations that fill a device's window finish, the 1,000
    nodes queued behind them may all go: one round of messages sends a budget's worth
    (SEND_BUDGET / (SEND_COST + hosts' parts) nodes), then the core is busy
    and each resume sends the next share, so no event holds the loop up."""
    rig = make_rig()
    _fill_window(rig, 0)
    a, ca = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    calls, _ = _chain(rig, a, 1000)
    rig.handle(a, m.Program(1, "chain", "parallel", calls, []))
    assert rig.c._queued(ca) == 1000 and not rig.c.busy
    per_event = SEND_BUDGET // (SEND_COST + 1) + 1
    groups = []
    rig.c.begin_turn()                            # the loop reads a round of messages:
    for exec_id in list(rig.c.in_flight):         # the window's computations finish
        for h in list(rig.c.in_flight[exec_id].hosts):
            out = rig.c.handle(rig.now, rig.c.worker_ident[h], 9, m.ExecDone(exec_id, None, 1000.0, 1001.0), [])
            groups.append(sum(isinstance(e.msg, m.Execute) for e in out))
    assert sum(groups) <= per_event                # one budget for the round
    while rig.c.busy:
        rig.c.validate_state()
        groups.append(sum(isinstance(e.msg, m.Execute) for e in rig.c.resume(rig.now)))
    assert max(groups) <= per_event and len([g for g in groups if g]) > 5, groups
    assert sum(groups) == 1000 and rig.c._queued(ca) == 0      # all of them, in the end


def test_a_template_is_fused_once_its_stopped_first_run_is_planned(make_rig):
    """The fusion that follows a template's first run waits for the end of that
    run's planning, across flush points; its next run goes fused."""
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6      # the window takes them all
    define(rig, a, 1, [0] * 6, 0)                 # stops after nodes 1, 2, 4
    assert len(rig.executes()) == 6 and rig.c.templates[(rig.c.peers[a].id, 1)].fused is not None
    rig.drain()
    mark = len(rig.log)
    run(rig, a, 1, 6, 1)
    assert len(sent(rig, mark, m.RunFused)) == 1 and not sent(rig, mark, m.Execute)
    rig.drain()


def test_a_lost_host_of_this_machine_has_its_segments_removed(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)))
    rig.c.machine = "machine1"
    rig.c.rm.hosts[1].pid = 4242
    rig.run(rig.c._host_lost, 1, "test")
    assert RemoveSegments(1, 4242) in rig.effects
    rig.c.machine = "elsewhere"
    rig.c.rm.hosts[0].pid = 4343
    rig.run(rig.c._host_lost, 0, "test")
    assert RemoveSegments(0, 4343) not in rig.effects


def test_rejected_messages_and_farewell(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    out = rig.c.reject(rig.now, a, 5, "bad signature")
    assert out == [Send(a, m.Error("protocol", "bad signature"), 5)]
    assert rig.c.reject(rig.now, None, 0, "garbage") == []
    out = rig.c.farewell("bye")
    assert sorted(e.ident for e in out) == [b"a", b"w0"] and all(e.msg == m.Shutdown("bye") for e in out)
    # a message before Hello, and one a client may not send
    assert rig.c.handle(rig.now, b"stranger", 1, m.Release([1]), [])[0].msg.code == "not_registered"
    assert rig.c.handle(rig.now, a, 2, m.ExecDone(1, None, 0.0, 0.0), [])[0].msg.code == "bad_request"


def test_explain_plans_on_a_scratch_directory_without_effect(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, _ = rig.client("a")
    call, x = rig.call(a, 0)
    rig.handle(a, call)
    rig.drain()
    reads, _ = rig.call(a, 1, x)                  # reads x from the other island
    before = (dict(rig.c.directory.buffers), rig.c.calls, len(rig.log))
    rig.handle(a, m.ExplainRequest([reads]))
    (ident, ex), = sent(rig, before[2], m.Explanation)
    assert ident == a and ex.nodes[0].hosts == [1] and ex.nodes[0].island == 1
    assert [(t.buffer, t.src_host, t.dst_host, t.channel) for t in ex.nodes[0].transfers] == [(x, 0, 1, "DCN")]
    assert (dict(rig.c.directory.buffers), rig.c.calls) == before[:2]
    assert not sent(rig, before[2], m.Execute)


def test_validate_state_finds_a_broken_invariant(make_rig):
    rig = make_rig()
    a, _ = rig.client("a")
    rig.c.tenants._cost[(rig.programs["g"][0], (0,))] = 1.0
    for _ in range(3):                           # the window takes two: the third is held
        rig.handle(a, rig.call(a, 0, program="g")[0])
    held = rig.c.parked_nodes()
    assert len(held) == 1
    rig.c.validate_state()
    b = call_buffers(held[0].call)[0]
    rig.c.pinned[b] += 1
    with pytest.raises(AssertionError, match="pins"):
        rig.c.validate_state()
    rig.c.pinned[b] -= 1
    rig.c.validate_state()
    rig.c.in_flight[next(iter(rig.c.in_flight))].hosts.add(7)
    with pytest.raises(AssertionError, match="in flight on lost host 7"):
        rig.c.validate_state()


def test_the_core_reads_no_clock_no_environment_and_owns_no_socket():
    """Only server.py (the loop) reads the clock or touches sockets; nothing in
    the controller reads the environment; the controller imports neither the
    worker, the cluster tools nor jax."""
    for path in sorted(CONTROLLER.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        attrs = {(n.value.id, n.attr) for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert ("os", "environ") not in attrs and "getenv" not in {a for _, a in attrs}, path
        assert not any(i.startswith(("zpath.worker", "zpath.cluster", "jax")) for i in imports), path
        for fn in ast.walk(tree):          # no imports inside functions
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(fn)), \
                    (path, fn.name)
        if path.name not in ("server.py", "scheduler.py"):
            assert ("time", "monotonic") not in attrs and "zmq" not in imports | names, path
    code = ("import sys, zpath.controller.server\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'jax' or "
            "k.startswith(('zpath.worker', 'zpath.cluster'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_core_is_built_from_config_alone():
    from zpath.config import ControllerConfig
    c = ControllerCore(ControllerConfig(policy="fifo", window_ms=5.0, solo_window_ms=50.0,
                                        alone_window_ms=300.0, device_memory_limit=123))
    assert c.tenants.policy == "fifo" and c.tenants.window_s == 0.005 and c.tenants.solo_window_s == 0.05
    assert c.tenants.alone_window_s == 0.3
    assert c.memory_limit == 123
    c.validate_state()


def test_a_long_program_in_parts_runs_as_one_once_its_last_part_has_come(make_rig):
    rig = make_rig()
    a, ca = rig.client("a")
    rig.c.tenants._cost[(rig.programs["f"][0], (0,))] = 1e-6
    calls, last = _chain(rig, a, 2500)
    release = [c.outputs[0].buffer for c in calls[:-1]]
    parts = m.program_parts(m.Program(7, "chain", "parallel", calls, release))
    assert [len(p.calls) for p in parts] == [1024, 1024, 452] and [p.more for p in parts] == [True, True, False]
    assert parts[-1].release == release and not parts[0].release
    for p in parts[:-1]:
        rig.handle(a, p)
        assert not rig.executes() and (a, 7) in rig.c.program_parts       # kept, nothing runs yet
    rig.handle(a, parts[-1])
    assert not rig.c.program_parts
    assert [x.outputs[0].buffer for x in rig.executes()] == [c.outputs[0].buffer for c in calls]
    rig.drain()
    # the intermediates went as their readers were planned: left are the result
    # and the value put for the first node (the program did not release it)
    assert set(rig.c.directory.buffers) == {last, calls[0].inputs[0].buffer}


def test_a_client_s_program_parts_are_bounded_and_dropped_when_it_leaves(make_rig, monkeypatch):
    monkeypatch.setattr("zpath.controller.admission.MAX_PROGRAM_CALLS", 1500)
    rig = make_rig()
    a, _ = rig.client("a")
    calls, _ = _chain(rig, a, 3000)
    parts = m.program_parts(m.Program(8, "big", "parallel", calls, []))
    rig.handle(a, parts[0])
    rig.handle(a, parts[1])                      # 2,048 calls held: over the bound
    assert {c.outputs[0].buffer for c in calls[:2048]} <= rig.failed(a)
    rig.handle(a, parts[2])                      # its last part is refused too, nothing ran
    assert {c.outputs[0].buffer for c in calls} <= rig.failed(a) and not rig.executes()
    assert not rig.c.program_parts
    rig.handle(a, m.program_parts(m.Program(9, "other", "parallel", _chain(rig, a, 1100)[0], []))[0])
    assert (a, 9) in rig.c.program_parts
    rig.handle(a, m.Goodbye("bye"))
    assert not rig.c.program_parts


@pytest.mark.parametrize("answers", [False, True], ids=["silent", "answers"])
def test_a_host_of_a_failed_collective_is_lost_unless_it_answers_at_once(make_rig, answers):
    """A host reports that a computation's collective with other hosts failed
    (PEER_FAILED, its outputs there left unsettled): the others are pinged; one
    silent for PEER_ANSWER_S is lost, and the call fails with HostLost naming
    it (well before the heartbeat timeout). If all answer, the reporter's
    outputs fail with its error, as a RemoteError."""
    rig = make_rig(hosts=(), host_timeout_s=10.0)
    for n in range(2):                 # one island, one JAX runtime over two hosts
        rig.handle(f"w{n}".encode(), m.RegisterWorker(
            f"h{n}", 0, f"tcp://x:{n}", 1, "cpu", 1, PROTOCOL_VERSION, [n], "coord:1", n, 2, "m", "", ""))
    a, _ = rig.client("a")
    av = m.Aval([2, 4], "float32")
    inp, out = rig.new_id(a), rig.new_id(a)
    rig.handle(a, m.Call(next(rig.ids), rig.programs["f"][0], [2], ["i"], [0, 1],
                         [m.CallInput(inp, av, ["i", None], True)], [m.CallOutput(out, av, ["i", None])]))
    (exec_id, info), = rig.c.in_flight.items()
    assert info.hosts == {0, 1}
    mark = len(rig.log)
    gloo = "JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: Connection closed by peer"
    rig.handle(b"w0", m.ExecDone(exec_id, m.ErrorInfo("PeerFailed", gloo, 0, "f", ""), 1000.0, 1000.0))
    assert [i for i, _ in sent(rig, mark, m.Ping)] == [b"w1"]
    assert rig.c.suspects_due() == pytest.approx(rig.now + PEER_ANSWER_S)
    rig.now += PEER_ANSWER_S / 2
    rig.record(rig.c.check(rig.now))
    assert rig.c.rm.hosts[1].alive and out not in rig.failed(a)
    if answers:
        rig.handle(b"w1", m.Pong(1, 0, 0, [0]))
    rig.now += PEER_ANSWER_S / 2
    rig.record(rig.c.check(rig.now))
    assert rig.c.suspects_due() is None and not rig.c.suspects
    fail = sent(rig, mark, m.FailBuffers)
    if answers:
        assert rig.c.rm.hosts[1].alive and out not in rig.failed(a)
        (ident, msg), = fail
        assert ident == b"w0" and msg.buffers == [out]
        assert msg.error.kind == "RemoteError" and msg.error.message == gloo
        rig.handle(b"w1", m.ExecDone(exec_id, None, 1000.0, 1000.0))
        assert not rig.c.in_flight
    else:
        assert not rig.c.rm.hosts[1].alive and out in rig.failed(a)
        (err,), = {(x.error.kind, x.error.message) for i, x in rig.log[mark:]
                   if i == a and isinstance(x, m.CallFailed) and out in x.buffers},
        assert err == ("HostLost", "host 1 (h1, island 0) was lost: a collective with it failed and it did "
                                   f"not answer for {PEER_ANSWER_S:.1f}s")
        # host 0 shares the runtime: lost with it (told to stop), nothing left to settle there
        assert not rig.c.rm.hosts[0].alive and not fail and not rig.c.in_flight


def test_small_pieces_one_computation_reads_from_one_host_go_as_a_bucket(make_rig):
    """A computation on host 1 reads three small values and a large one made on
    host 0: the small pieces go as one SendPieces order (one message between
    the two), the large one alone."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, _ = rig.client("a")
    made = []
    for width in (4, 4, 4, BUCKET_PIECE_BYTES // 4):
        call, out = rig.call(a, 0, width=width)
        rig.handle(a, call)
        made.append((out, width))
    rig.drain()
    ins = [m.CallInput(b, m.Aval([1, w], "float32"), [None, None], False) for b, w in made]
    out = rig.new_id(a)
    mark = len(rig.log)
    rig.handle(a, m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [1], ins,
                         [m.CallOutput(out, m.Aval([1, 4], "float32"), [None, None])]))
    (ident, bucket), = sent(rig, mark, m.SendPieces)
    assert ident == b"w0" and bucket.dst_host == 1 and bucket.channel == "DCN"
    assert [p.buffer for p in bucket.pieces] == [b for b, _ in made[:3]]
    (ident, alone), = sent(rig, mark, m.SendPiece)
    assert ident == b"w0" and alone.buffer == made[3][0]
    (_, ex), = [(i, x) for i, x in rig.log[mark:] if isinstance(x, m.Execute)]
    wanted = {p.piece_id for inp in ex.inputs for s in inp.shards for p in s.pieces}
    assert wanted == {p.piece_id for p in bucket.pieces} | {alone.piece_id}


def test_the_timeline_and_events_keep_nothing_the_collector_must_walk(make_rig):
    """The history of host reports and controller events (up to 100,000 and
    10,000 entries) holds plain numbers and strings, not the computations'
    records with their lists and sets: after the collector's first looks
    (two: a row, and the tuple of devices in it) it no longer tracks any of
    it. A TimelineRequest still gets every field."""
    import gc

    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, client = rig.client("a")
    outs = []
    for device in (0, 1, 0):
        call, out = rig.call(a, device)
        rig.handle(a, call)
        outs.append(out)
    rig.drain()
    rig.c.events.append(("plan", client, "f", 5.0, 6.0))     # as the loop records a call's planning
    gc.collect()
    gc.collect()
    assert len(rig.c.timeline) == 3 and not any(gc.is_tracked(row) for row in rig.c.timeline)
    assert not any(gc.is_tracked(e) for e in rig.c.events)
    mark = len(rig.log)
    rig.handle(a, m.TimelineRequest(10))
    (timeline,) = [x for _, x in rig.log[mark:] if isinstance(x, m.Timeline)]
    assert [(r.host, r.client, r.name, r.devices, r.ok, r.island) for r in timeline.records] == \
        [(0, client, "p", [0], True, 0), (1, client, "p", [1], True, 0), (0, client, "p", [0], True, 0)]
    assert [r.seq for r in timeline.records] == [0, 1, 2]
    assert timeline.events == [m.ControllerEvent("plan", client, "f", 5.0, 6.0)]


def test_the_timeline_keeps_a_run_of_rows_as_one_block_of_arrays():
    """A run of a batch's rows (Timeline.add_run) is one entry whose fields
    per host are packed into bytes: the young passes get one object, not a
    row per host, and nothing of it once looked at. The rows read back (newest ``limit``,
    oldest first) are those a row per host would give, and the history keeps
    at least its last ``max_rows`` rows and not many more."""
    import gc
    import random

    rng = random.Random(5)
    t, rows = Timeline(600), []
    for x in range(1, 60):
        if rng.random() < 0.3:
            row = (x, None, 1.0 * x, 2.0 * x, 0.0, rng.randrange(512), x, 0, 1, "f", (0, 1))
            t.append(row)
            rows.append(row)
            continue
        hosts = rng.sample(range(512), rng.randrange(0, 40))
        starts, ends, waited = [x + h / 1e3 for h in hosts], [x + 1 + h / 1e3 for h in hosts], [0.5] * len(hosts)
        t.add_run(x, starts, ends, waited, hosts, x, 0, 1, "f", (0, 1))
        rows += [(x, None, s, e, w, h, x, 0, 1, "f", (0, 1))
                 for s, e, w, h in zip(starts, ends, waited, hosts, strict=True)]
        assert 600 - 40 < len(t) <= 600 or len(t) == len(rows)
        for limit in (1, 7, 100, 10_000):
            assert t.last(limit) == rows[-min(limit, len(t)):]
    assert len(t) < len(rows)            # (old entries went)
    blocks = [e for e in t if type(e[5]) is bytes]
    assert blocks and all(type(e[k]) is bytes for e in blocks for k in (2, 3, 4, 5))
    gc.collect()
    assert not any(gc.is_tracked(e) for e in t)


def test_to_hosts_without_relays_counts_each_direct_message_as_the_relay_path_does():
    """``to_hosts``' path for a controller whose relays forwarded nothing
    counts each message sent (per host, and the direct epoch) exactly as
    ``_direct`` does, skips a host that is gone, and once a relay has
    forwarded to a host the general path sends the Await first."""
    from zpath.config import ControllerConfig

    def core_with_hosts() -> ControllerCore:
        core = ControllerCore(ControllerConfig())
        for n in range(2):
            core.handle(0.0, b"w%d" % n, n + 1, m.RegisterWorker(
                f"h{n}", 0, f"tcp://127.0.0.1:{40000 + n}", 1, "cpu", 1, PROTOCOL_VERSION, [n], "127.0.0.1:1",
                n, 2, "t", "", "", n), [])
        core._take()
        return core

    fast, slow = core_with_hosts(), core_with_hosts()
    msgs = [(0, m.Free([1])), (1, m.Free([2])), (7, m.Free([3])), (0, m.Free([4]))]
    fast.to_hosts(msgs)
    for rank, msg in msgs:                     # the general path, one message at a time
        ident = slow.worker_ident.get(rank)
        if ident is not None:
            slow._direct(rank, ident, msg)
            slow._out.append(Send(ident, msg, 0, ()))
    assert fast.direct_sent == slow.direct_sent == {0: 2, 1: 1} and fast._epoch == slow._epoch == 3
    assert [(e.ident, e.msg) for e in fast._take()] == [(e.ident, e.msg) for e in slow._take()]
    fast.forwarded_via[0] = {1: 2}             # host 1 relayed two messages to host 0
    fast.to_hosts([(0, m.Free([5]))])
    out = fast._take()
    assert [type(e.msg) for e in out] == [m.Await, m.Free] and out[0].msg == m.Await(1, 2)
    assert fast.direct_sent[0] == 4 and fast._epoch == 4


def test_a_clients_call_or_release_whose_handler_raises_is_answered_as_any_message_is(monkeypatch):
    """``handle``'s straight path for a client's Call and Release keeps
    ``_handle_safely``'s answer to a handler bug: the call's futures fail
    (CallFailed), a Release gets an Error; the controller goes on."""
    from zpath.config import ControllerConfig
    from zpath.errors import ErrorKind

    core = ControllerCore(ControllerConfig())
    core.handle(0.0, b"c", 1, m.Hello("t", PROTOCOL_VERSION, 1.0, b"n" * 16), [])
    client = core.peers[b"c"].id
    aval = m.Aval([2], "float32")
    call = m.Call(7, "0" * 64, [0], ["i"], [1], [m.CallInput(client << 32 | 1, aval, ["i"], True)],
                  [m.CallOutput(client << 32 | 2, aval, ["i"])])

    def boom(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(core, "_call", boom)
    monkeypatch.setattr(core, "_release", boom)
    out = core.handle(1.0, b"c", 2, call, [])
    assert [type(e.msg) for e in out] == [m.CallFailed] and out[0].ident == b"c"
    assert out[0].msg.error.kind == ErrorKind.REMOTE_ERROR and core.peers[b"c"].last_seen == 1.0
    out = core.handle(2.0, b"c", 3, m.Release([client << 32 | 2]), [])
    assert [type(e.msg) for e in out] == [m.Error] and "Release" in out[0].msg.message
    assert core.peers[b"c"].last_seen == 2.0
