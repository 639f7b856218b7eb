"""Program templates and fused runs, in process: the template rules
(zpath/controller/templates.py) and a Controller driven by hand (the rig of
test_controller_tenancy): which runs are fused, what they send, and how they
fail, leave and clean up. Also, with the same rig, where a copy of a value is
located after a host loss (Locate): only copies that were made count."""
from __future__ import annotations

import dataclasses

import pytest

from zpath.controller import templates
from zpath.controller.directory import Plan
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION
from tests.test_controller_tenancy import _fill_window, make_rig  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

AV = m.Aval([1, 4], "float32")
SPEC = [None, None]


def block(rig, ident, k):
    """The k-th block of new ids of a client (a run's new buffers)."""
    return rig.c.peers[ident].id << 32 | (k + 1) << 16


def chain(rig, devices, first, x, put, program="f"):
    """Calls of a chain, one node per device of ``devices``: node 0 reads ``x``
    (a value put, or an existing buffer), node k reads node k-1's output."""
    calls, prev, prev_put = [], x, put
    for k, dev in enumerate(devices):
        calls.append(m.Call(7, rig.programs[program][0], [1], ["i"], [dev],
                            [m.CallInput(prev, AV, SPEC, prev_put)], [m.CallOutput(first + k, AV, SPEC)]))
        prev, prev_put = first + k, False
    release = [first + k for k in range(len(devices) - 1)] + ([x] if put else [])
    return calls, release


def define(rig, ident, template, devices, k, x=None):
    """Define (and run) a chain as template ``template``; returns (x, result)."""
    put = x is None
    x = block(rig, ident, 1000 + k) if put else x
    first = block(rig, ident, k)
    calls, release = chain(rig, devices, first, x, put)
    rig.handle(ident, m.DefineProgram(template, [x], first, len(devices),
                                      m.Program(k, "chain", "parallel", calls, release)))
    return x, first + len(devices) - 1


def run(rig, ident, template, n, k, x=None):
    """Run template ``template`` (a chain of ``n`` nodes) again; returns (x, result)."""
    x = block(rig, ident, 1000 + k) if x is None else x
    first = block(rig, ident, k)
    rig.handle(ident, m.RunProgram(k, template, [x], first, [first + n - 1]))
    return x, first + n - 1


def fused_chain(rig, ident):
    """Template 1 of ``ident``, a 2-node chain on device 0, defined and run
    fused once; returns its fused program's id."""
    define(rig, ident, 1, [0, 0], 0)
    rig.drain()
    run(rig, ident, 1, 2, 1)
    rig.drain()
    return rig.c.templates[(rig.c.peers[ident].id, 1)].fused.id


def sent(rig, since, kind):
    return [(i, x) for i, x in rig.log[since:] if isinstance(x, kind)]


def test_a_template_is_fused_after_its_first_run(make_rig):
    rig = make_rig(hosts=((0, 2),))
    a, _ = rig.client("a")
    devs = [0, 0, 0]
    n0 = len(rig.log)
    define(rig, a, 1, devs, 0)
    assert len(sent(rig, n0, m.Execute)) == 3 and not sent(rig, n0, m.RunFused)
    rig.drain()
    for k in (1, 2, 3):
        n0 = len(rig.log)
        calls0 = rig.c.calls
        x, out = run(rig, a, 1, 3, k)
        assert not sent(rig, n0, m.Execute)
        (ident, rf), = sent(rig, n0, m.RunFused)
        assert ident == rig.c.worker_ident[0] and rf.inputs == [x] and rf.first_buffer == out - 2
        defines = sent(rig, n0, m.DefineFused)
        assert len(defines) == (1 if k == 1 else 0)      # each host gets it once
        if defines:
            assert defines[0][1].fused == rf.fused and len(defines[0][1].executes) == 3
            assert defines[0][1].release == [0, 1]       # the intermediates, as codes
        assert rig.c.calls - calls0 == 3
        # the result is in the directory, the intermediates never were; the
        # value put was released once the run was sent
        assert out in rig.c.directory.buffers
        assert out - 1 not in rig.c.directory.buffers and out - 2 not in rig.c.directory.buffers
        assert x not in rig.c.directory.buffers
        assert [f for _, f in sent(rig, n0, m.Free) if x in f.buffers]
        rig.finish(rf.exec_id)
        rig.handle(a, m.Release([out]))
    assert rig.idle()
    assert [r.name for r in rig.c.timeline_records(10)][-1] == "chain (3 nodes, fused)"


def test_a_program_on_several_devices_of_a_host_is_not_fused(make_rig):
    """A fused run is one computation per host: nodes on other devices of a
    host, which could run beside each other, are not fused (they would run one
    after the other)."""
    rig = make_rig(hosts=((0, 2),))
    a, _ = rig.client("a")
    define(rig, a, 1, [0, 1, 0], 0)      # device 1 reads device 0's output: a local copy
    rig.drain()
    for k in (1, 2, 3, 4):
        n0 = len(rig.log)
        run(rig, a, 1, 3, k)
        assert len(sent(rig, n0, m.Execute)) == 3 and not sent(rig, n0, m.RunFused)
        rig.drain()


def test_a_run_that_reads_a_future_is_fused_too(make_rig):
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    _, y = define(rig, a, 1, [0, 0], 0)
    rig.drain()
    _, z = define(rig, a, 2, [0, 0], 1, x=y)        # a second template reads a future
    rig.drain()
    n0 = len(rig.log)
    _, w = run(rig, a, 2, 2, 2, x=z)
    (_, rf), = sent(rig, n0, m.RunFused)
    assert rf.inputs == [z] and z in rig.c.directory.buffers
    rig.drain()
    # an input whose computation failed: the run is not fused, its calls fail
    rig.c.directory.poison([w], rig.c.peers[a].id, m.ErrorInfo("RemoteError", "boom", 0, "f", ""))
    n0 = len(rig.log)
    _, v = run(rig, a, 2, 2, 3, x=w)
    assert not sent(rig, n0, m.RunFused) and v in rig.failed(a)


def test_a_program_that_moves_data_between_hosts_is_never_fused(make_rig):
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, _ = rig.client("a")
    define(rig, a, 1, [0, 1], 0)          # node 1 on host 1 reads host 0's output
    rig.drain()
    for k in range(1, 6):
        n0 = len(rig.log)
        run(rig, a, 1, 2, k)
        assert len(sent(rig, n0, m.Execute)) == 2 and sent(rig, n0, m.SendPiece)
        assert not sent(rig, n0, m.RunFused)
        rig.drain()
    assert rig.c.templates[(rig.c.peers[a].id, 1)].fuse_tries == templates.FUSE_TRIES


def spmd_rig(make_rig, n, **config):
    """``n`` hosts of 2 devices each, one island runtime (SPMD over all)."""
    rig = make_rig(hosts=(), **config)
    for h in range(n):
        rig.handle(f"w{h}".encode(), m.RegisterWorker(f"h{h}", 0, f"tcp://x:{h}", 1, "cpu", 2, PROTOCOL_VERSION,
                                                      [0, 1], "rt", h, n, f"machine{h}", "", ""))
    return rig


def spmd_define(rig, ident, template, nodes, k):
    """Define (and run) template ``template``: node j an SPMD call over the
    devices ``nodes[j]`` reading float32[8, 4] split by rows, node 0 a value
    put, node j > 0 node j-1's output where its devices are node j-1's, else
    a value put of its own. Returns the values put and the result."""
    av, spec = m.Aval([8, 4], "float32"), ["i", None]
    first = block(rig, ident, k)
    calls, puts, release, prev = [], [], [], None
    for j, devs in enumerate(nodes):
        if prev is not None and nodes[j - 1] == devs:
            inp = m.CallInput(prev, av, spec, False)
            release.append(prev)
        else:
            puts.append(block(rig, ident, 1000 + 10 * k + j))
            inp = m.CallInput(puts[-1], av, spec, True)
        calls.append(m.Call(7, rig.programs["f"][0], [len(devs)], ["i"], devs, [inp],
                            [m.CallOutput(first + j, av, spec)]))
        prev = first + j
    release += puts
    rig.handle(ident, m.DefineProgram(template, puts, first, len(nodes),
                                      m.Program(k, "spmd", "parallel", calls, release)))
    return puts, first + len(nodes) - 1


def spmd_run(rig, ident, template, puts, n, k):
    first = block(rig, ident, k)
    xs = [block(rig, ident, 1000 + 10 * k + j) for j in range(len(puts))]
    rig.handle(ident, m.RunProgram(k, template, xs, first, [first + n - 1]))
    return xs, first + n - 1


def test_the_hosts_of_an_spmd_fused_program_share_one_definition(make_rig):
    """Where every input is in place, each host's part of a fused program is
    alike: one DefineFused object for all of them (encoded once, through
    relays from relay_min_hosts hosts on), its shards left to the workers,
    as an op-by-op Execute's; the value put's layout still covers every
    device."""
    rig = spmd_rig(make_rig, 2)
    a, _ = rig.client("a")
    devs = [0, 1, 2, 3]
    puts, _ = spmd_define(rig, a, 1, [devs, devs, devs], 0)
    rig.drain()
    n0 = len(rig.log)
    xs, out = spmd_run(rig, a, 1, puts, 3, 1)
    assert len(sent(rig, n0, m.RunFused)) == 2
    (i0, d0), (i1, d1) = sent(rig, n0, m.DefineFused)
    assert {i0, i1} == {rig.c.worker_ident[0], rig.c.worker_ident[1]}
    assert d0 is d1 and len(d0.executes) == 3
    assert all(not i.shards for ex in d0.executes for i in ex.inputs)
    fused = rig.c.templates[(rig.c.peers[a].id, 1)].fused
    assert [(s, lay) for s, _, lay, _ in fused.puts] == [
        (0, {((2 * r, 2 * r + 2), (0, 4)): [r] for r in range(4)})]
    assert rig.c.directory.buffers[out].layouts == [{((2 * r, 2 * r + 2), (0, 4)): [r] for r in range(4)}]
    rig.drain()
    n0 = len(rig.log)
    spmd_run(rig, a, 1, puts, 3, 2)                 # defined on both hosts already
    assert len(sent(rig, n0, m.RunFused)) == 2 and not sent(rig, n0, m.DefineFused)
    rig.drain()


def test_a_fused_definition_many_hosts_share_goes_through_relays(make_rig):
    """From relay_min_hosts hosts on, the one DefineFused goes as one Relay
    per group (encoded once), not to each host."""
    rig = spmd_rig(make_rig, 4, relay_min_hosts=4, relay_group=2)
    a, _ = rig.client("a")
    devs = list(range(8))
    puts, _ = spmd_define(rig, a, 1, [devs, devs], 0)
    rig.drain()
    n0, e0 = len(rig.log), len(rig.effects)
    spmd_run(rig, a, 1, puts, 2, 1)
    assert not sent(rig, n0, m.DefineFused)
    carried = [e.buffers.msg for e in rig.effects[e0:] if type(e.msg) is m.Relay
               and type(e.buffers.msg) is m.DefineFused]
    assert len(carried) == 2 and carried[0] is carried[1]
    assert sorted(h for e in rig.effects[e0:] if type(e.msg) is m.Relay
                  and e.buffers.msg is carried[0] for h in e.msg.hosts) == [0, 1, 2, 3]
    assert rig.c.host_fused == {h: {carried[0].fused} for h in range(4)}
    rig.drain()


def test_hosts_with_other_parts_of_a_fused_program_get_their_own(make_rig):
    """Host 0 runs a node host 1 does not: each gets its own DefineFused,
    sharing the fused Execute of the node both run."""
    rig = spmd_rig(make_rig, 2)
    a, _ = rig.client("a")
    puts, _ = spmd_define(rig, a, 1, [[0, 1, 2, 3], [0, 1]], 0)
    rig.drain()
    n0 = len(rig.log)
    spmd_run(rig, a, 1, puts, 2, 1)
    defines = dict(sent(rig, n0, m.DefineFused))
    d0, d1 = defines[rig.c.worker_ident[0]], defines[rig.c.worker_ident[1]]
    assert d0 is not d1 and len(d0.executes) == 2 and len(d1.executes) == 1
    assert d0.executes[0] is d1.executes[0] and d0.executes[1].devices == [0, 1]
    fused = rig.c.templates[(rig.c.peers[a].id, 1)].fused
    assert [(s, lay) for s, _, lay, _ in fused.puts] == [
        (0, {((2 * r, 2 * r + 2), (0, 4)): [r] for r in range(4)}),
        (1, {((0, 4), (0, 4)): [0], ((4, 8), (0, 4)): [1]})]
    rig.drain()


def test_a_fused_run_under_a_memory_limit_counts_its_intermediates_while_it_runs(make_rig):
    """Under a device memory limit a fused run's intermediates (which never
    enter the directory) are counted on their devices from when it is sent
    until it has finished; a run that would not fit runs as plain calls, which
    wait for memory node by node."""
    rig = make_rig(hosts=((0, 1),))
    rig.c.memory_limit = 10 ** 9
    a, _ = rig.client("a")
    define(rig, a, 1, [0, 0, 0], 0)
    rig.drain()
    bytes0 = rig.c.directory.device_bytes[0]
    n0 = len(rig.log)
    _, out = run(rig, a, 1, 3, 1)
    (_, rf), = sent(rig, n0, m.RunFused)
    # its result and 2 intermediates of float32[1, 4] (the value put was
    # released once the run was sent)
    assert rig.c.directory.device_bytes[0] - bytes0 == 3 * 16
    rig.finish(rf.exec_id)
    assert rig.c.directory.device_bytes[0] - bytes0 == 16
    rig.handle(a, m.Release([out]))
    # room for the value put, the result and one intermediate at a time: too
    # little for the fused run, enough for its nodes one by one
    rig.c.memory_limit = rig.c.directory.device_bytes[0] + 3 * 16
    n0 = len(rig.log)
    _, out = run(rig, a, 1, 3, 2)
    assert not sent(rig, n0, m.RunFused) and sent(rig, n0, m.Execute)
    rig.drain()
    assert out not in rig.failed(a) and rig.c.directory.buffers[out].error is None


def test_bad_templates_are_refused_and_their_runs_fail(make_rig):
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    first = block(rig, a, 0)
    x = block(rig, a, 1000)
    calls, release = chain(rig, [0, 0], first, x, True)
    n0 = len(rig.log)
    # the slots do not name the calls' inputs: refused, but run as a plain program
    rig.handle(a, m.DefineProgram(1, [x + 1], first, 2, m.Program(1, "chain", "parallel", calls, release)))
    assert [e for i, e in sent(rig, n0, m.Error) if i == a and "not kept as template" in e.message]
    assert len(sent(rig, n0, m.Execute)) == 2
    rig.drain()
    # so a run of it fails its outputs (it was never kept)
    _, out = run(rig, a, 1, 2, 1)
    assert out in rig.failed(a)
    assert rig.c.directory.buffers[out].error is not None
    # a run whose new buffers are not the client's
    define(rig, a, 2, [0, 0], 2)
    rig.drain()
    n0 = len(rig.log)
    rig.handle(a, m.RunProgram(9, 2, [x + 5], (77 << 32) | 1, [(77 << 32) | 2]))
    assert [f for i, f in sent(rig, n0, m.CallFailed) if i == a] and not sent(rig, n0, m.Execute)


def test_a_lost_host_fails_a_fused_run_s_results(make_rig):
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, _ = rig.client("a")
    define(rig, a, 1, [0, 0], 0)
    rig.drain()
    _, out = run(rig, a, 1, 2, 1)
    assert rig.c.in_flight
    rig.run(rig.c._host_lost, 0, "test")
    assert rig.c.directory.buffers[out].error.kind == "HostLost"
    # later runs are not fused onto the lost host: they fail as plain calls
    n0 = len(rig.log)
    _, out2 = run(rig, a, 1, 2, 2)
    assert not sent(rig, n0, m.RunFused) and out2 in rig.failed(a)


def _template(calls, inputs, first, n, release=(), dispatch="parallel", client=1):
    return templates.ProgramTemplate(m.DefineProgram(1, inputs, first, n, m.Program(
        1, "p", dispatch, calls, list(release))), client)


def _call(ins, outs):
    return m.Call(1, "d", [1], ["i"], [0], [m.CallInput(b, AV, SPEC, put) for b, put in ins],
                  [m.CallOutput(b, AV, SPEC) for b in outs])


def test_template_rules():
    first = 1 << 32 | 100
    x, y = 1 << 32 | 5, 1 << 32 | 6
    ok = [_call([(x, True)], [first]), _call([(first, False), (y, False), (x, False)], [first + 1])]
    t = _template(ok, [x, y, x], first, 2, release=[first, x])
    assert t.put == [True, False, False] and t.reads_put == [None, None, 0]
    assert t.results == [1] and t.release == [0, -1]
    calls, release = t.expand(9, [x + 10, y + 10, x + 10], first + 50)
    assert [[(i.buffer, i.put) for i in c.inputs] for c in calls] == \
        [[(x + 10, True)], [(first + 50, False), (y + 10, False), (x + 10, False)]]
    assert [[o.buffer for o in c.outputs] for c in calls] == [[first + 50], [first + 51]]
    assert release == [first + 50, x + 10]
    t.check_run(1, [x + 10, y + 10, x + 10], first + 50)
    with pytest.raises(templates.TemplateError, match="must read the value put"):
        t.check_run(1, [x + 10, y + 10, x + 11], first + 50)
    with pytest.raises(templates.TemplateError, match="slots"):
        t.check_run(1, [x + 10], first + 50)
    with pytest.raises(templates.TemplateError, match="not this client's"):
        t.check_run(1, [x + 10, y + 10, x + 10], 2 << 32 | 1)
    bad = [
        ([_call([(first + 1, False)], [first])], [], "read before"),            # reads what is made later
        ([_call([(x, False)], [first + 5])], [x], "not a new one"),              # output outside the block
        ([_call([(x, False)], [first]), _call([(x, False)], [first])], [x, x], "not a new one"),   # made twice
        ([_call([(x, False)], [first])], [y], "slots"),
        ([_call([(x, False)], [first])], [x, y], "slots"),
    ]
    for calls, inputs, match in bad:
        with pytest.raises(templates.TemplateError, match=match):
            _template(calls, inputs, first, 2)
    with pytest.raises(templates.TemplateError, match="releases only"):
        _template([_call([(x, False)], [first])], [x], first, 1, release=[y])
    with pytest.raises(templates.TemplateError, match="parallel"):
        _template([_call([(x, False)], [first])], [x], first, 1, dispatch="sequential")
    with pytest.raises(templates.TemplateError, match="not this client's"):
        _template([_call([(x, False)], [first])], [x], first, 1, client=2)


def two_chains(rig, first, x, y):
    """Two independent one-node chains: x on device 0 (host 0), y on device 1 (host 1)."""
    f = rig.programs["f"][0]
    calls = [m.Call(7, f, [1], ["i"], [0], [m.CallInput(x, AV, SPEC, True)], [m.CallOutput(first, AV, SPEC)]),
             m.Call(7, f, [1], ["i"], [1], [m.CallInput(y, AV, SPEC, True)], [m.CallOutput(first + 1, AV, SPEC)])]
    return calls, [x, y]


def fused_two_chains(rig, finish=True):
    """Client a runs two_chains fused on hosts 0 and 1; host 0 has finished its
    part (unless not ``finish``). Returns (a, the run's first new buffer, its RunFused)."""
    a, _ = rig.client("a")
    first = block(rig, a, 0)
    calls, release = two_chains(rig, first, block(rig, a, 100), block(rig, a, 101))
    rig.handle(a, m.DefineProgram(1, [block(rig, a, 100), block(rig, a, 101)], first, 2,
                                  m.Program(1, "two", "parallel", calls, release)))
    rig.drain()
    first = block(rig, a, 1)
    n0 = len(rig.log)
    rig.handle(a, m.RunProgram(2, 1, [block(rig, a, 102), block(rig, a, 103)], first, [first, first + 1]))
    (_, rf), _ = sent(rig, n0, m.RunFused)
    if finish:
        rig.handle(rig.c.worker_ident[0], m.ExecDone(rf.exec_id, None, 1000.0, 1000.001))
    return a, first, rf


def test_a_lost_host_fails_only_the_fused_results_it_held(make_rig):
    """Hosts of one island without a shared runtime run their parts of a fused
    run on their own: losing one fails what it held, not the other's result."""
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, first, rf = fused_two_chains(rig)
    rig.run(rig.c._host_lost, 1, "test")
    assert rig.c.directory.buffers[first].error is None
    assert rig.c.directory.buffers[first + 1].error.kind == "HostLost"
    assert first + 1 in rig.failed(a) and first not in rig.failed(a)


def test_a_fused_run_holds_its_devices_until_the_hosts_left_have_finished(make_rig):
    """When one host of a fused run is lost, the others still run their parts:
    the run stays in flight, and the tenant scheduler keeps counting its
    devices, until they have reported."""
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, first, rf = fused_two_chains(rig, finish=False)
    rig.run(rig.c._host_lost, 1, "test")
    assert rf.exec_id in rig.c.in_flight and rig.c.in_flight[rf.exec_id].hosts == {0}
    assert rf.exec_id in rig.c.tenants._running
    assert rig.c.directory.buffers[first + 1].error.kind == "HostLost"
    rig.handle(rig.c.worker_ident[0], m.ExecDone(rf.exec_id, None, 1000.0, 1000.001))
    assert not rig.c.in_flight and rf.exec_id not in rig.c.tenants._running
    assert rig.c.directory.buffers[first].error is None and first not in rig.failed(a)


def test_a_worker_without_the_fused_program_fails_its_results(make_rig):
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, first, rf = fused_two_chains(rig)
    err = m.ErrorInfo("FusedUnknown", f"fused program {rf.fused} is unknown here", 1, "", "")
    rig.handle(rig.c.worker_ident[1], m.ExecDone(rf.exec_id, err, 1000.0, 1000.0))
    assert rig.c.directory.buffers[first].error is None
    assert rig.c.directory.buffers[first + 1].error.kind == "FusedUnknown"
    assert first + 1 in rig.failed(a) and first not in rig.failed(a) and not rig.c.in_flight


def test_refused_runs_free_what_was_put_and_keep_existing_buffers(make_rig):
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    _, y = define(rig, a, 1, [0, 0], 0)
    rig.drain()
    # unknown template: its outputs fail, the value put for it is freed
    x = block(rig, a, 1001)
    n0 = len(rig.log)
    rig.handle(a, m.RunProgram(9, 5, [x], block(rig, a, 1), [block(rig, a, 1) + 1]))
    assert block(rig, a, 1) + 1 in rig.failed(a)
    assert [f for _, f in sent(rig, n0, m.Free) if x in f.buffers]
    # new buffers that would overwrite an existing one (y): refused, y is kept
    n0 = len(rig.log)
    rig.handle(a, m.RunProgram(10, 1, [block(rig, a, 1002)], y - 1, [y]))
    assert not sent(rig, n0, m.Execute) and not sent(rig, n0, m.RunFused)
    assert y in rig.c.directory.buffers and rig.c.directory.buffers[y].error is None


def test_the_same_value_put_in_two_slots_is_refused_as_a_plain_program(make_rig):
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    first = block(rig, a, 0)
    calls, release = two_chains(rig, first, block(rig, a, 100), block(rig, a, 101))
    calls = [dataclasses.replace(c, devices=[0]) for c in calls]
    rig.handle(a, m.DefineProgram(1, [block(rig, a, 100), block(rig, a, 101)], first, 2,
                                  m.Program(1, "two", "parallel", calls, release)))
    rig.drain()
    for k in (1, 2):          # fused from the second run on
        rig.handle(a, m.RunProgram(k, 1, [block(rig, a, 102 + 2 * k), block(rig, a, 103 + 2 * k)],
                                   block(rig, a, k), [block(rig, a, k), block(rig, a, k) + 1]))
        rig.drain()
    dup = block(rig, a, 200)
    n0 = len(rig.log)
    rig.handle(a, m.RunProgram(3, 1, [dup, dup], block(rig, a, 3), [block(rig, a, 3), block(rig, a, 3) + 1]))
    assert not sent(rig, n0, m.RunFused) and rig.failed(a)
    rig.drain()
    rig.handle(a, m.Goodbye("done"))
    assert not +rig.c.directory.device_bytes and rig.idle()


@pytest.mark.parametrize("leaving", [m.Goodbye("done"), m.DropTemplates([1, 99])],
                         ids=["client-leaves", "drop-templates"])
def test_forgotten_templates_drop_their_fused_programs(make_rig, leaving):
    """A client that leaves, or drops a template (its program was collected):
    the hosts forget the fused program."""
    rig = make_rig(hosts=((0, 1),))
    a, _ = rig.client("a")
    fused = fused_chain(rig, a)
    n0 = len(rig.log)
    rig.handle(a, leaving)
    assert [d.fused for _, d in sent(rig, n0, m.DropFused)] == [[fused]]
    assert not rig.c.templates and rig.idle()


def test_a_run_sent_after_its_template_was_dropped_leaves_nothing_behind(make_rig):
    rig = make_rig(hosts=((0, 1),), window_ms=0.001)
    a, _ = rig.client("a")
    b, _ = rig.client("b")
    fid = fused_chain(rig, a)
    for _ in range(4):                   # b fills device 0's window: a's next run waits
        rig.handle(b, rig.call(b, 0)[0])
    n0 = len(rig.log)
    run(rig, a, 1, 2, 2)
    assert not sent(rig, n0, m.RunFused) and rig.c.tenants.queued()
    rig.handle(a, m.DropTemplates([1]))  # the program was collected meanwhile
    assert [d.fused for _, d in sent(rig, n0, m.DropFused)] == [[fid]]
    n1 = len(rig.log)
    rig.drain()
    # the waiting run still goes (with its definition), and the host forgets it after
    kinds = [type(x).__name__ for _, x in rig.log[n1:] if isinstance(x, (m.DefineFused, m.RunFused, m.DropFused))]
    assert kinds == ["DefineFused", "RunFused", "DropFused"]
    assert not any(rig.c.host_fused.values()) and not rig.c.templates


def test_locate_names_a_live_copy_of_the_client_s_own_buffer(make_rig):
    """(Not templates: Locate, answered from the directory this rig drives.)
    A client learns where a copy of its buffer lives; another client's buffer
    and a buffer whose only copy was on a lost host give an error instead."""
    rig = make_rig(hosts=((0, 1), (0, 1)))
    a, _ = rig.client("a")
    b, _ = rig.client("b")
    _, out = define(rig, a, 1, [1], 0)      # one node on device 1 (host 1)
    rig.drain()
    loc = locate(rig, a, out)
    assert loc.error is None and loc.devices == [1] and loc.regions == [[[0, 1], [0, 4]]]
    assert locate(rig, b, out).error.kind == "HostLost"          # not b's buffer
    assert locate(rig, a, out + 99).error.kind == "HostLost"     # unknown
    rig.run(rig.c._host_lost, 1, "test")
    loc = locate(rig, a, out)
    assert loc.error.kind == "HostLost" and "host 1" in loc.error.message and not loc.devices


def locate(rig, ident, buffer):
    n0 = len(rig.log)
    rig.handle(ident, m.Locate(buffer))
    (_, loc), = sent(rig, n0, m.Location)
    return loc


@pytest.mark.parametrize("outcome", ["finished", "failed", "queued"])
def test_locate_names_a_copy_only_once_the_computation_that_makes_it_has_finished(make_rig, outcome):
    """A copy is recorded when the computation reading the value is planned, but
    holds data only once that computation has run: Locate names it only after
    the computation finished without error."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, _ = rig.client("a")
    call, x = rig.call(a, 1)                 # x lives on host 1
    rig.handle(a, call)
    rig.drain()
    if outcome == "queued":
        _fill_window(rig, 0)                 # device 0 busy: the reader waits its turn
    n0 = len(rig.log)
    rig.handle(a, rig.call(a, 0, x)[0])      # reads x on device 0: a copy there is planned
    assert len(rig.c.directory.buffers[x].layouts) == 2
    if outcome != "queued":
        (_, ex), = sent(rig, n0, m.Execute)
        err = None if outcome == "finished" else m.ErrorInfo("RemoteError", "boom", 0, "f", "")
        rig.handle(rig.c.worker_ident[0], m.ExecDone(ex.exec_id, err, 1000.0, 1000.001))
    rig.run(rig.c._host_lost, 1, "test")
    loc = locate(rig, a, x)
    if outcome == "finished":
        assert loc.error is None and loc.devices == [0]
    else:
        assert loc.error.kind == "HostLost" and not loc.devices


def abandoned_reader(rig, before_loss=lambda a, x: None):
    """Client a's node on device 0 that reads x (host 1) and z (host 2) waits
    its turn and is abandoned when host 2 is lost (``before_loss(a, x)`` is
    called just before). Returns (a, x, its output)."""
    a, _ = rig.client("a")
    cx, x = rig.call(a, 1)
    cz, z = rig.call(a, 2)
    rig.handle(a, cx)
    rig.handle(a, cz)
    rig.drain()
    _fill_window(rig, 0)
    out = rig.new_id(a)
    rig.handle(a, m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [0],
                         [m.CallInput(x, AV, SPEC, False), m.CallInput(z, AV, SPEC, False)],
                         [m.CallOutput(out, AV, SPEC)]))
    before_loss(a, x)
    rig.run(rig.c._host_lost, 2, "test")
    rig.drain()
    return a, x, out


def test_a_copy_planned_for_an_abandoned_node_is_never_located(make_rig):
    """The copy of x the abandoned node planned on device 0 never holds data,
    so once host 1 is lost too, x has no copy left."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    a, x, out = abandoned_reader(rig)
    assert out in rig.failed(a) and x not in rig.failed(a)
    rig.run(rig.c._host_lost, 1, "test")
    assert locate(rig, a, x).error.kind == "HostLost"


@pytest.mark.parametrize("held", [False, True])
def test_a_copy_is_confirmed_after_an_unrelated_host_was_lost(make_rig, held):
    """Losing a host rebuilds the layouts of every buffer; copies planned before
    (in flight or still waiting their turn) are still confirmed once their
    computation finishes."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    a, _ = rig.client("a")
    call, x = rig.call(a, 1)
    rig.handle(a, call)
    rig.drain()
    if held:
        _fill_window(rig, 0)
    n0 = len(rig.log)
    rig.handle(a, rig.call(a, 0, x)[0])       # a copy of x on device 0
    rig.run(rig.c._host_lost, 2, "unrelated")
    if held:
        rig.drain()
    else:
        (_, ex), = sent(rig, n0, m.Execute)
        rig.handle(rig.c.worker_ident[0], m.ExecDone(ex.exec_id, None, 1000.0, 1000.001))
    rig.run(rig.c._host_lost, 1, "test")
    loc = locate(rig, a, x)
    assert loc.error is None and loc.devices == [0]


def test_an_abandoned_node_s_copies_are_forgotten(make_rig):
    """The copy of x that the abandoned node planned on device 0 is forgotten: a
    later reader there moves x again, and once x's own host is lost, the copy
    that reader made is the one located."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    a, x, out = abandoned_reader(rig)
    assert out in rig.failed(a) and len(rig.c.directory.buffers[x].layouts) == 1
    n0 = len(rig.log)
    rig.handle(a, rig.call(a, 0, x)[0])       # reads x on device 0 again: a piece moves it
    assert [p for _, p in sent(rig, n0, m.SendPiece) if p.buffer == x]
    rig.drain()
    rig.run(rig.c._host_lost, 1, "test")
    assert locate(rig, a, x).devices == [0]  # the copy that reader made


def _reads(ex, buffer):
    """The shards of ``buffer`` an Execute reads: (device, pieces' (piece id, device))."""
    return [(s.device, [(p.piece_id, p.device) for p in s.pieces])
            for i in ex.inputs if i.buffer == buffer for s in i.shards]


def test_a_node_that_was_to_read_an_abandoned_node_s_copy_reads_another(make_rig):
    """A node planned, while it waited its turn, to read the copy of x that an
    earlier waiting node was to make on device 0 is sent once that node is
    abandoned (host 2, with its other input, is lost): it moves x from its
    owner instead (it used to read the copy that never came, and waited 300 s)."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    later = {}

    def second_reader(a, x):
        c2, later["out"] = rig.call(a, 0, x)      # planned to read first's copy of x on device 0
        rig.handle(a, c2)
        later["n0"] = len(rig.log)
    a, x, first = abandoned_reader(rig, second_reader)
    second, n0 = later["out"], later["n0"]
    assert first in rig.failed(a) and second not in rig.failed(a)
    (ex,) = [e for _, e in sent(rig, n0, m.Execute) if e.outputs[0].buffer == second]
    (dev, pieces), = _reads(ex, x)
    assert dev == 0 and len(pieces) == 1 and pieces[0][1] == 1 and pieces[0][0] > 0
    (to, send), = [(i, p) for i, p in sent(rig, n0, m.SendPiece) if p.buffer == x]
    assert to == rig.c.worker_ident[1] and send.piece_id == pieces[0][0] and send.dst_host == 0
    assert rig.idle()
    _freed_on_both(rig, a, x)


def _freed_on_both(rig, a, x):
    """x lives on host 1 only, but a node assembled it on host 0 as well: freeing
    it frees it on both hosts, and forgets that it was repaired."""
    n0 = len(rig.log)
    rig.handle(a, m.Release([x]))
    assert sorted(i for i, f in sent(rig, n0, m.Free) if x in f.buffers) == [b"w0", b"w1"]
    assert x not in rig.c.copies_dropped


def test_a_copy_made_by_a_failed_computation_is_not_read(make_rig):
    """A computation that was to copy x to device 0 fails: its copy may hold
    its error, so a node that waited its turn, planned to read that copy, and
    a node planned afterwards both move x from its owner again."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, x = _value_on_host_1(rig)
    n0 = len(rig.log)
    c1, _ = rig.call(a, 0, x)
    rig.handle(a, c1)                   # sent at once: it copies x to device 0
    (ex1,) = [e for _, e in sent(rig, n0, m.Execute)]
    assert _reads(ex1, x)[0][1]
    _fill_window(rig, 0)
    c2, second = rig.call(a, 0, x)      # waits its turn, planned to read that copy
    rig.handle(a, c2)
    n1 = len(rig.log)
    rig.handle(rig.c.worker_ident[0], m.ExecDone(ex1.exec_id, m.ErrorInfo("RemoteError", "boom", 0, "f", ""),
                                                 1000.0, 1000.001))
    rig.drain()
    c3, third = rig.call(a, 0, x)
    rig.handle(a, c3)
    rig.drain()
    for out in (second, third):
        (ex,) = [e for _, e in sent(rig, n1, m.Execute) if e.outputs[0].buffer == out]
        (dev, pieces), = _reads(ex, x)
        assert dev == 0 and [d for _, d in pieces] == [1], out
    assert x not in rig.failed(a) and len(rig.c.directory.buffers[x].layouts) == 2   # third's copy
    assert rig.idle()
    _freed_on_both(rig, a, x)


def test_copies_of_freed_buffers_are_not_remembered(make_rig):
    """A node that was to copy a program's intermediate fails after the
    program freed it: nothing is left to repair, so nothing is remembered."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, _ = rig.client("a")
    c1, t = rig.call(a, 1)
    c2, y = rig.call(a, 0, t)            # copies t to device 0
    rig.handle(a, m.Program(1, "p", "parallel", [c1, c2], [t]))
    (ex2,) = [e for _, e in sent(rig, 0, m.Execute) if e.outputs[0].buffer == y]
    rig.finish(next(e.exec_id for _, e in sent(rig, 0, m.Execute) if e.outputs[0].buffer == t))
    rig.handle(rig.c.worker_ident[0], m.ExecDone(ex2.exec_id, m.ErrorInfo("RemoteError", "boom", 0, "f", ""),
                                                 1000.0, 1000.001))
    assert t not in rig.c.directory.buffers and not rig.c.copies_dropped
    assert rig.idle()


def test_an_input_left_only_in_an_abandoned_node_s_copy_fails(make_rig):
    """x's host is lost while a node that was to copy x to device 0 waits its
    turn: the node is abandoned, x has no copy left, and its client is told."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, x = _value_on_host_1(rig)
    _fill_window(rig, 0)
    c2, y = rig.call(a, 0, x)
    rig.handle(a, c2)
    rig.run(rig.c._host_lost, 1, "test")
    rig.drain()
    assert {x, y} <= rig.failed(a)
    assert not rig.c.directory.buffers[x].layouts and rig.c.directory.buffers[x].error.kind == "HostLost"


@pytest.mark.parametrize("end", ["host lost", "client left while held"])
def test_a_fused_run_s_intermediates_are_uncounted_when_it_cannot_finish(make_rig, end):
    """Its host is lost while it runs, or its client leaves while it waits for
    its turn: what it counted for its intermediates is free again."""
    rig = make_rig(hosts=((0, 1), (0, 1)))
    rig.c.memory_limit = 10 ** 9
    a, _ = rig.client("a")
    define(rig, a, 1, [0, 0, 0], 0)
    rig.drain()
    own = rig.c.directory.device_bytes[0]     # a's result of that first run
    others = 0
    if end == "client left while held":
        _fill_window(rig, 0)                  # the run waits for its turn
        others = rig.c.directory.device_bytes[0] - own
    n0 = len(rig.log)
    run(rig, a, 1, 3, 1)
    # its result and 2 intermediates (and, until it is sent, the value put)
    held = 16 if others else 0
    assert rig.c.directory.device_bytes[0] == own + others + 3 * 16 + held
    if end == "host lost":
        assert sent(rig, n0, m.RunFused)
        rig.run(rig.c._host_lost, 0, "test")
        assert rig.c.directory.device_bytes[0] == 0 and not rig.c.in_flight
    else:
        assert not sent(rig, n0, m.RunFused)
        rig.handle(a, m.Goodbye("gone"))
        assert rig.c.directory.device_bytes[0] == others
        rig.drain()                           # the other client's work finishes
        assert rig.c.directory.device_bytes[0] == others and not sent(rig, n0, m.RunFused)


def test_work_waiting_for_memory_resumes_after_a_lost_host_s_copies_are_forgotten(make_rig):
    """The last host of a fused run is lost: what the run counted is free, but
    a call waiting for memory goes on only once the lost host's copies are
    forgotten, so it reads x from the copy on a live host rather than fail."""
    rig = make_rig(hosts=((0, 1), (0, 1), (0, 1)))
    rig.c.memory_limit = 10 ** 9
    a, _ = rig.client("a")
    call, x = rig.call(a, 0)
    rig.handle(a, call)
    rig.drain()
    rig.handle(a, rig.call(a, 2, x)[0])      # x gets a copy on device 2 (host 2)
    rig.drain()
    # chains of 3 nodes on devices 0 and 1 (hosts 0 and 1), as one fused program
    first, ins = block(rig, a, 0), [block(rig, a, 100), block(rig, a, 101)]
    calls, release = [], list(ins)
    for n, (dev, inp) in enumerate(zip((0, 1), ins)):
        c, rel = chain(rig, [dev] * 3, first + 3 * n, inp, True)
        calls += c
        release += [r for r in rel if r != inp]
    rig.handle(a, m.DefineProgram(1, ins, first, 6, m.Program(1, "two", "parallel", calls, release)))
    rig.drain()
    first, n0 = block(rig, a, 1), len(rig.log)
    rig.handle(a, m.RunProgram(2, 1, [block(rig, a, 102), block(rig, a, 103)], first, [first + 2, first + 5]))
    (_, rf), _ = sent(rig, n0, m.RunFused)
    rig.handle(rig.c.worker_ident[1], m.ExecDone(rf.exec_id, None, 1000.0, 1000.001))
    # device 1 has room for its own result only: a call reading x there waits
    rig.c.memory_limit = rig.c.directory.device_bytes[1] + 16
    n0 = len(rig.log)
    call, z = rig.call(a, 1, x)
    rig.handle(a, call)
    assert rig.c.memory_waiting
    rig.run(rig.c._host_lost, 0, "test")              # the run's intermediates on device 1 are free now
    assert [p for i, p in sent(rig, n0, m.SendPiece) if p.buffer == x and i == rig.c.worker_ident[2]]
    assert rig.c.directory.buffers[x].error is None and z not in rig.failed(a)


def _value_on_host_1(rig):
    """Client a, and a value x it made on host 1 (device 1)."""
    a, _ = rig.client("a")
    cx, x = rig.call(a, 1)
    rig.handle(a, cx)
    rig.drain()
    return a, x


def _reader(rig, a, dev, ins):
    out = rig.new_id(a)
    return m.Call(next(rig.ids), rig.programs["f"][0], [1], ["i"], [dev],
                  [m.CallInput(i, AV, SPEC, False) for i in ins], [m.CallOutput(out, AV, SPEC)]), out


def test_a_waiting_node_that_reads_a_value_twice_reads_its_own_copy_once_sent(make_rig):
    """A node that reads x twice, on a device x is not on, moves x once: its
    second read reads the copy its first makes, also after waiting its turn."""
    rig = make_rig(hosts=((0, 1), (1, 1)))
    a, x = _value_on_host_1(rig)
    _fill_window(rig, 0)
    c, y = _reader(rig, a, 0, [x, x])
    rig.handle(a, c)
    n0 = len(rig.log)
    rig.drain()
    (ex,) = [e for _, e in sent(rig, n0, m.Execute) if e.outputs[0].buffer == y]
    first, second = _reads(ex, x)
    assert len(first[1]) == 1 and second == (0, [])
    assert len([p for _, p in sent(rig, n0, m.SendPiece) if p.buffer == x]) == 1
    assert rig.idle() and not rig.c.unsent_copies


def test_a_node_whose_only_copy_left_is_not_made_fails_instead_of_waiting(make_rig):
    """x lives on host 1. In a sequential program, M waits for n1 and is to
    copy x to device 0; H reads x there too and waits only for its turn. Host
    1 is lost, and H's turn comes before M is sent: the only copy left is
    the one M cannot make, so H fails at once (it used to be sent reading a
    copy that never comes)."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    a, x = _value_on_host_1(rig)
    _fill_window(rig, 0)
    c1, o1 = rig.call(a, 2)
    cm, om = _reader(rig, a, 0, [x, o1])
    ch, oh = _reader(rig, a, 0, [x])
    rig.handle(a, m.Program(60, "s", "sequential", [c1, cm, ch], []))
    (e1,) = [e.exec_id for _, e in sent(rig, 0, m.Execute) if e.outputs[0].buffer == o1]
    n0 = len(rig.log)
    rig.run(rig.c._host_lost, 1, "test")
    for eid in [e for e in rig.c.in_flight if e != e1]:    # the window's computations end
        rig.finish(eid)
    assert oh in rig.failed(a)
    assert not [e for _, e in sent(rig, n0, m.Execute) if e.outputs[0].buffer == oh]
    rig.drain()
    assert {om, x} <= rig.failed(a) and rig.idle() and not rig.c.unsent_copies


def test_a_fused_run_that_would_read_a_copy_not_made_yet_runs_as_plain_calls(make_rig):
    """Template 1 reads its input on device 0 and was fused while that input
    had a copy there. A run of it on x2, whose copy on device 0 a waiting
    node is still to make, is not fused: its node moves x2 itself."""
    rig = make_rig(hosts=((0, 1), (1, 1), (2, 1)))
    a, x = _value_on_host_1(rig)
    define(rig, a, 1, [0], 0, x=x)        # copies x to device 0
    rig.drain()
    run(rig, a, 1, 1, 1, x=x)             # reads that copy: fused
    rig.drain()
    assert rig.c.templates[(rig.c.peers[a].id, 1)].fused is not None
    cx2, x2 = rig.call(a, 1)
    rig.handle(a, cx2)
    rig.drain()
    c1, o1 = rig.call(a, 2)
    c2, o2 = _reader(rig, a, 0, [x2, o1])   # waits for c1, is to copy x2 to device 0
    rig.handle(a, m.Program(50, "s", "sequential", [c1, c2], []))
    assert x2 in rig.c.unsent_copies
    n0 = len(rig.log)
    _, out = run(rig, a, 1, 1, 2, x=x2)
    assert not sent(rig, n0, m.RunFused)
    (ex,) = [e for _, e in sent(rig, n0, m.Execute) if e.outputs[0].buffer == out]
    (dev, pieces), = _reads(ex, x2)
    assert dev == 0 and [d for _, d in pieces] == [1]
    rig.drain()
    assert rig.idle() and not rig.failed(a)


def test_hosts_are_grouped_by_the_executes_they_run():
    """SPMD nodes (one Execute for the same hosts) make one group without
    per-host work; otherwise hosts with the same node list share a group."""
    a, b, c = (m.Execute(0, 0, name, name, [1], ["x"], [0], [0], [], []) for name in "abc")
    spmd = [Plan(dict.fromkeys([2, 0, 1], a), []), Plan(dict.fromkeys([2, 0, 1], b), [])]
    assert templates._host_groups(spmd) == [([0, 1, 2], [(0, a), (1, b)])]
    mixed = [Plan({0: a, 1: a, 2: c, 3: c}, []), Plan({0: b, 2: b, 3: b}, [])]
    assert templates._host_groups(mixed) == [
        ([0], [(0, a), (1, b)]), ([1], [(0, a)]), ([2, 3], [(0, c), (1, b)])]
    assert templates._host_groups([]) == []
