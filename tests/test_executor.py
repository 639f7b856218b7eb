"""The worker's executor and store in one process, without sockets.

The executor learns, on a program's first calls, how to build its input arrays
and take its outputs apart without JAX's checks; these tests check that later
calls give the same results, and that an input that no longer fits what it
learnt gets the same error as on a fresh executor. JAX runs in a subprocess
with 4 emulated CPU devices (XLA_FLAGS set here would not work once another
test has imported jax)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from zpath.worker.store import Store, shard_key

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent("""
    import dataclasses, hashlib, json, os, queue, types
    import numpy as np
    import jax
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from zpath import sharding
    from zpath.net import messages as m
    from zpath.worker.executor import Executor
    from zpath.worker.store import Store, shard_key

    devs = jax.devices()
    assert len(devs) >= 4, devs
    made = [0]
    make = jax.make_array_from_single_device_arrays
    def counting_make(*a, **k):
        made[0] += 1
        return make(*a, **k)
    jax.make_array_from_single_device_arrays = counting_make

    def export(fn, shape, dtype, mesh_devs, in_spec, out_spec):
        mesh = Mesh(np.array(mesh_devs), ("i",))
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
        arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, in_spec))
        blob = jax.export.export(f)(arg).serialize()
        return hashlib.sha256(blob).hexdigest(), bytes(blob)

    def wire(spec):
        return [list(e) if isinstance(e, tuple) else e for e in spec]

    class Host:
        def __init__(self):
            self.store = Store()
            self.done = queue.Queue()
            self.ex = Executor(self.store, {d.id: d for d in devs},
                               lambda i, err, s, e, hold: self.done.put((i, err)))
            self.ids = iter(range(1, 10**6))

        def put(self, buffer, value, mesh_devs, spec):
            regs = sharding.regions(value.shape, [len(mesh_devs)], ["i"], wire(spec))
            for d, r in zip(mesh_devs, regs):
                self.store.set(shard_key(buffer, d.id, r), jax.device_put(sharding.cut(value, r), d))

        def run(self, digest, blob, mesh_devs, inp, out, shape, dtype, in_spec, out_spec, out_shape):
            self.ex.add_program(digest, blob)
            n = len(mesh_devs)
            regs = sharding.regions(shape, [n], ["i"], wire(in_spec))
            shards = [m.ShardInput(d.id, sharding.to_wire(r), []) for d, r in zip(mesh_devs, regs)]
            i = next(self.ids)
            ids = [d.id for d in mesh_devs]
            self.ex.submit(m.Execute(i, i, digest, "f", [n], ["i"], ids, ids,
                                     [m.ExecInput(inp, m.Aval(list(shape), dtype), wire(in_spec), shards)],
                                     [m.ExecOutput(out, m.Aval(list(out_shape), dtype), wire(out_spec))]))
            got, err = self.done.get(timeout=60)
            assert got == i
            return err

        def fetch(self, buffer, mesh_devs, shape, spec):
            regs = sharding.regions(shape, [len(mesh_devs)], ["i"], wire(spec))
            out = []
            for d, r in zip(mesh_devs, regs):
                e = self.store.entry(shard_key(buffer, d.id, r))
                assert e.done and e.error is None, e.error
                assert e.value.sharding.device_set == {d}, (e.value.sharding, d)
                out.append(np.asarray(e.value).tolist())
            return out

    res = {}
    two = devs[:2]

    # a chain on 2 devices: psum + 1, sharded in and out
    digest, blob = export(lambda x: jax.lax.psum(x, "i") + 1., (2,), np.float64, two, P("i"), P("i"))
    h = Host()
    h.put(0, np.zeros(2), two, P("i"))
    for k in range(5):
        assert h.run(digest, blob, two, k, k + 1, (2,), "float64", P("i"), P("i"), (2,)) is None
    res["chain"] = h.fetch(5, two, (2,), P("i"))
    res["chain_makes"] = made[0]

    # the same program, then an input of the wrong dtype and one of the wrong
    # shard shape: the same error as on an executor that learnt nothing
    def bad(host, buffer, shard):
        # every shard of the (2,) input is ``shard``
        for d, r in zip(two, ([[0, 1]], [[1, 2]])):
            host.store.set(shard_key(buffer, d.id, r), jax.device_put(shard, d))
        err = host.run(digest, blob, two, buffer, buffer + 1, (2,), "float64", P("i"), P("i"), (2,))
        return None if err is None else [err.kind, err.message.splitlines()[0]]
    fresh = Host()
    res["bad_dtype"] = [bad(h, 100, np.zeros(1, np.float32)), bad(fresh, 100, np.zeros(1, np.float32))]
    fresh = Host()
    res["bad_shape"] = [bad(h, 200, np.zeros(2)), bad(fresh, 200, np.zeros(2))]
    h.put(300, np.full(2, 3.), two, P("i"))
    assert h.run(digest, blob, two, 300, 301, (2,), "float64", P("i"), P("i"), (2,)) is None
    res["after_errors"] = h.fetch(301, two, (2,), P("i"))

    # a replicated output on 4 devices, and a single-device mesh
    four = devs[:4]
    d4, b4 = export(lambda x: jax.lax.psum(x.sum(keepdims=True), "i"), (4,), np.float64, four, P("i"), P())
    h = Host()
    h.put(0, np.arange(4.), four, P("i"))
    for k in range(3):
        assert h.run(d4, b4, four, 0, k + 1, (4,), "float64", P("i"), P(), (1,)) is None
    res["replicated"] = h.fetch(3, four, (1,), P())
    one = devs[2:3]
    d1, b1 = export(lambda x: x * 2., (3,), np.float64, one, P("i"), P("i"))
    h.put(10, np.arange(3.), one, P("i"))
    for k in range(3):
        assert h.run(d1, b1, one, 10 + k, 11 + k, (3,), "float64", P("i"), P("i"), (3,)) is None
    res["single"] = h.fetch(13, one, (3,), P("i"))

    # empty arrays: every shard is empty
    d0, b0 = export(lambda x: x + 1., (0, 2), np.float64, two, P("i"), P("i"))
    for k in range(3):
        assert h.run(d0, b0, two, 400 + k, 401 + k, (0, 2), "float64", P("i"), P("i"), (0, 2)) is None
    res["empty"] = [np.asarray(h.store.entry(shard_key(403, d.id, ((0, 0), (0, 2)))).value).shape
                    for d in two]

    # a fused run: computations whose inputs were all made earlier in the run,
    # in the sharding they read them in, take the short way, worked out on the
    # first run and kept for the next ones; the others go through _execute
    from zpath.worker.executor import FusedRun
    dr, br = export(lambda x: x * 10., (2,), np.float64, two, P(), P())
    dg, bg = export(lambda x: x - 1., (2,), np.float64, two, P("i"), P("i"))
    hf = Host()
    for dig, bl in ((digest, blob), (dr, br), (dg, bg)):
        hf.ex.add_program(dig, bl)
    ids = [d.id for d in two]
    halves = [sharding.to_wire(r) for r in sharding.regions((2,), [2], ["i"], ["i"])]
    def node(dig, inp, out, in_spec=("i",), out_spec=("i",)):
        if in_spec:
            shards = [m.ShardInput(d.id, r, []) for d, r in zip(two, halves)]
        else:       # whole on each device, from both devices' halves
            pieces = [m.PieceSource(0, d.id, r, r) for d, r in zip(two, halves)]
            shards = [m.ShardInput(d.id, [[0, 2]], pieces) for d in two]
        aval = m.Aval([2], "float64")
        return m.Execute(0, 0, dig, "n", [2], ["i"], ids, ids, [m.ExecInput(inp, aval, list(in_spec), shards)],
                         [m.ExecOutput(out, aval, list(out_spec))])
    template = [node(digest, -1, 0), node(digest, 0, 1), node(digest, 1, 2), node(dr, 2, 3, (), ()),
                node(digest, 2, 4), node(dg, 4, 5), node(digest, 5, 6)]
    plan = [None]
    def fused(r, x):
        hf.put(r * 1000 - 1, np.full(2, x), two, P("i"))
        hf.ex.submit(FusedRun(r, r, "fused", ids, template, [r * 1000 - 1], r * 1000, [0, 1, 2], plan))
        got, err = hf.done.get(timeout=60)
        assert got == r
        out = {}
        for c, spec in ((3, P()), (4, P("i")), (5, P("i")), (6, P("i"))):
            regs = sharding.regions((2,), [2], ["i"], wire(spec))
            es = [hf.store.entry(shard_key(r * 1000 + c, d.id, r_)) for d, r_ in zip(two, regs)]
            out[c] = [e.error.message if e.error else np.asarray(e.value).tolist() for e in es]
        return [None if err is None else err.message, out]
    res["fused"] = [fused(1, 0.)]
    res["fused_steps"] = [s is not None for s in plan[0].steps]
    first_plan = plan[0]
    res["fused"].append(fused(2, 1.))
    res["fused_plan_kept"] = plan[0] is first_plan
    def boom(*a):
        raise RuntimeError("injected")
    plan[0].steps[5][0].fn = boom            # g's prepared program, taken the short way
    res["fused"].append(fused(3, 0.))

    # two computations fail on the short way, one after the other: the second's
    # outputs fail with its own error too, so what reads them does not wait
    hf.ex.stop()
    hf.ex = Executor(hf.store, {d.id: d for d in devs}, lambda i, err, s, e, hold: hf.done.put((i, err)),
                     input_timeout_s=5.0)
    for dig, bl in ((digest, blob), (dr, br), (dg, bg)):
        hf.ex.add_program(dig, bl)
    template2 = [node(digest, -1, 0), node(dg, 0, 1), node(dg, 0, 2), node(digest, 2, 3)]
    plan2 = [None]
    hf.put(3999, np.zeros(2), two, P("i"))
    hf.ex.submit(FusedRun(4, 4, "fused", ids, template2, [3999], 4000, [0], plan2))
    hf.done.get(timeout=60)            # the first run learns the plan: g takes the short way
    plan2[0].steps[1][0].fn = boom
    hf.put(4999, np.zeros(2), two, P("i"))
    hf.ex.submit(FusedRun(5, 5, "fused", ids, template2, [4999], 5000, [0], plan2))
    got, err = hf.done.get(timeout=60)
    res["two_failures"] = [err.message, [[hf.store.entry(shard_key(5000 + c, d.id, r_)).error.message
                                          for d, r_ in zip(two, ([[0, 1]], [[1, 2]]))] for c in (1, 2, 3)]]

    # a computation with two outputs takes the short way too, and so does what
    # reads one of them
    # (g's program on this executor fails, above: the reader is another one)
    d2, b2 = export(lambda x: (x + 10., x * 3.), (2,), np.float64, two, P("i"), (P("i"), P("i")))
    dh, bh = export(lambda x: x - 2., (2,), np.float64, two, P("i"), P("i"))
    for dig, bl in ((d2, b2), (dh, bh)):
        hf.ex.add_program(dig, bl)
    aval = m.Aval([2], "float64")
    two_out = m.Execute(0, 0, d2, "n2", [2], ["i"], ids, ids,
                        [m.ExecInput(0, aval, ["i"], [m.ShardInput(d.id, r, []) for d, r in zip(two, halves)])],
                        [m.ExecOutput(1, aval, ["i"]), m.ExecOutput(2, aval, ["i"])])
    template3 = [node(digest, -1, 0), two_out, node(dh, 2, 3)]
    plan3 = [None]
    def shown(b):       # per device: its shard of buffer b, or its error
        es = [hf.store.entry(shard_key(b, d.id, r_)) for d, r_ in zip(two, ([[0, 1]], [[1, 2]]))]
        return [e.error.message if e.error else np.asarray(e.value).tolist() for e in es]
    def fused3(r):
        hf.put(r * 1000 - 1, np.zeros(2), two, P("i"))
        hf.ex.submit(FusedRun(r, r, "fused", ids, template3, [r * 1000 - 1], r * 1000, [0, 2], plan3))
        got, err = hf.done.get(timeout=60)
        assert got == r
        return [None if err is None else err.message, [shown(r * 1000 + c) for c in (1, 3)]]
    res["fused_general"] = [fused3(6), fused3(7)]
    res["fused_general_steps"] = [s is not None for s in plan3[0].steps]
    plan3[0].steps[1][0].fn = boom           # the two-output program, taken the short way
    res["fused_general"].append(fused3(8))
    res["fused_series"] = [{k: len(v[1]) for k, v in p[0].series.items()} for p in (plan, plan3)]

    # a series: computations whose one output the next one alone reads run as
    # a JAX loop does, the outputs passed on and not recorded
    template4 = [node(digest, -1, 0)] + [node(digest, k, k + 1) for k in range(4)]
    plan4 = [None]
    def fused4(r):
        hf.put(r * 1000 - 1, np.zeros(2), two, P("i"))
        hf.ex.submit(FusedRun(r, r, "fused", ids, template4, [r * 1000 - 1], r * 1000, [0, 1, 2, 3], plan4))
        got, err = hf.done.get(timeout=60)
        assert got == r
        return [None if err is None else err.message,
                [shown(b) if any(hf.store.is_done(shard_key(b, d.id, r_)) for d, r_ in zip(two, halves))
                 else "not stored" for b in (r * 1000 + 2, r * 1000 + 3, r * 1000 + 4)]]
    res["series"] = [fused4(9)]
    res["series_plan"] = {k: [v[0], len(v[1]), v[2]] for k, v in plan4[0].series.items()}
    programs = plan4[0].series[1][1]
    kept = programs[1]
    programs[1] = types.SimpleNamespace(fn=boom)     # the series' second, computation 2, fails
    res["series"].append(fused4(10))
    programs[1] = kept
    res["series"].append(fused4(11))
    res["series_waited"] = [r in hf.ex.waited for r in (9, 10, 11)]
    # an intermediate that nothing reads ends no series and breaks nothing
    template6 = [node(digest, -1, 0), node(digest, 0, 1), node(digest, 0, 2)]
    plan6 = [None]
    hf.put(11999, np.zeros(2), two, P("i"))
    hf.ex.submit(FusedRun(12, 12, "fused", ids, template6, [11999], 12000, [0, 1], plan6))
    got, err = hf.done.get(timeout=60)
    res["unread"] = [got, None if err is None else err.message, shown(12002), plan6[0].series]
    # the executor's own code fails on a fused run (a bug): the run is
    # reported failed, its outputs fail, and the next run on its devices runs
    run_fused = hf.ex._run_fused
    def broken_run_fused(run):
        hf.ex._run_fused = run_fused
        raise KeyError("injected bug")
    hf.ex._run_fused = broken_run_fused
    hf.put(12999, np.zeros(2), two, P("i"))
    hf.ex.submit(FusedRun(13, 13, "fused", ids, template6, [12999], 13000, [0, 1], plan6))
    got, err = hf.done.get(timeout=60)
    res["broken"] = [got, err.message, shown(13002)]
    hf.put(13999, np.zeros(2), two, P("i"))
    hf.ex.submit(FusedRun(14, 14, "fused", ids, template6, [13999], 14000, [0, 1], plan6))
    got, err = hf.done.get(timeout=60)
    res["broken"].append([got, None if err is None else err.message, shown(14002)])

    # completions of short computations run back to back are reported with
    # ``hold`` (but not the last); held reports are released before the thread
    # waits for an input. SHORT_S is raised so that a loaded machine cannot make
    # a computation look long.
    import zpath.worker.executor as executor_module
    executor_module.SHORT_S = 60.0
    reports = queue.Queue()
    ex = Executor(h.store, {d.id: d for d in devs}, lambda i, e, s, t, hold: reports.put([i, e, hold]),
                  release_held=lambda: reports.put("release"))
    ex.add_program(d1, b1)
    reg = [[0, 3]]
    def execute(i, inp, out):
        return m.Execute(i, i, d1, "f", [1], ["i"], [one[0].id], [one[0].id],
                         [m.ExecInput(inp, m.Aval([3], "float64"), ["i"], [m.ShardInput(one[0].id, reg, [])])],
                         [m.ExecOutput(out, m.Aval([3], "float64"), ["i"])])
    def take(k):
        return [reports.get(timeout=60) for _ in range(k)]
    # the first run learns that the program is short
    ex.submit(execute(1, 10, 500))
    res["held_first"] = take(1)
    # a chain of 11 queued behind a computation that waits for its input
    ex.submit(execute(2, 600, 601))
    res["held_chain_release"] = take(1)
    for k in range(1, 11):
        ex.submit(execute(2 + k, 600 + k, 601 + k))
    h.store.set(shard_key(600, one[0].id, ((0, 3),)), jax.device_put(np.arange(3.), one[0]))
    res["held_chain"] = take(11)
    res["held_chain_value"] = np.asarray(h.store.entry(shard_key(611, one[0].id, ((0, 3),))).value).tolist()
    # a computation whose input is missing: the one before is held, then released
    ex.submit(execute(20, 750, 700))
    res["held_before_wait"] = take(1)
    ex.submit(execute(21, 800, 801))
    h.store.set(shard_key(750, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["held_before_wait"] += take(2)
    h.store.set(shard_key(800, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["held_after_wait"] = take(1)
    # a failure is never held, even with another computation queued behind it
    h.store.set(shard_key(12345, one[0].id, ((0, 3),)), error=m.ErrorInfo("RemoteError", "boom", 0, "g", ""))
    ex.submit(execute(30, 950, 900))        # waits for its input
    res["held_error"] = take(1)
    ex.submit(execute(31, 12345, 901))      # its input failed: poisoned
    ex.submit(execute(32, 801, 902))
    h.store.set(shard_key(950, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["held_error"] += [[r[0], r[1] is not None, r[2]] for r in take(3)]
    res["held_nothing_more"] = reports.empty()
    # computations that are not short, whose Execute allows it: held while at
    # least DEEP_QUEUE more wait behind them on their devices (6 queued behind
    # one waiting for its input); the same without ``hold``: never held
    # (the executor's clock advances 4 ms, or 0.1 ms, per reading: each of
    # these computations then takes 12 ms, or 0.3 ms, by it; on a streak, which
    # reads it before and after each call, 4 ms or 0.1 ms)
    import types
    real_time = executor_module.time
    for name, base, may, short_s, step in (("held_deep", 1000, True, 0.0, 0.004),
                                           ("held_deep_not_allowed", 1100, False, 0.0, 0.004),
                                           ("held_deep_short", 1200, True, 60.0, 0.004),
                                           ("held_deep_tiny", 1300, True, 60.0, 0.0001)):
        executor_module.SHORT_S = short_s
        clock = [0.0]
        def perf_counter(clock=clock, step=step):
            clock[0] += step
            return clock[0]
        executor_module.time = types.SimpleNamespace(time=real_time.time, perf_counter=perf_counter,
                                                     monotonic=real_time.monotonic)
        ex.submit(dataclasses.replace(execute(40, base, base + 1), hold=may))
        res[name] = take(1)
        for k in range(1, 7):
            ex.submit(dataclasses.replace(execute(40 + k, base + k, base + 1 + k), hold=may))
        h.store.set(shard_key(base, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
        res[name] += [[r[0], r[2]] for r in take(7)]
        res[name + "_value"] = np.asarray(h.store.entry(shard_key(base + 7, one[0].id, ((0, 3),))).value).tolist()
    # a batch of long ones that a wait for an input ends (52 reads 1490, which
    # comes later): released then; a new batch starts after it
    executor_module.SHORT_S = 0.0
    clock = [0.0]
    def perf_counter(clock=clock):
        clock[0] += 0.004
        return clock[0]
    executor_module.time = types.SimpleNamespace(time=real_time.time, perf_counter=perf_counter,
                                                 monotonic=real_time.monotonic)
    ex.submit(dataclasses.replace(execute(50, 1400, 1401), hold=True))
    res["held_batch_wait"] = take(1)
    for k in range(1, 7):
        ex.submit(dataclasses.replace(execute(50 + k, 1490 if k == 2 else 1400 + k, 1401 + k), hold=True))
    h.store.set(shard_key(1400, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["held_batch_wait"] += [r if r == "release" else [r[0], r[2]] for r in take(3)]
    h.store.set(shard_key(1490, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["held_batch_wait"] += [[r[0], r[2]] for r in take(5)]
    res["held_batch_wait_value"] = np.asarray(h.store.entry(shard_key(1407, one[0].id, ((0, 3),))).value).tolist()
    executor_module.time = real_time
    res["held_deep_nothing_more"] = reports.empty()
    # streaks: held short computations on one device here, each reading the
    # one before's output alone, run back to back (Executor._streak); the
    # executor thread settles them after each whose seq is a multiple of
    # STREAK_SETTLE (8), or once 16 are left (seqs that skip those)
    import sys, threading
    executor_module.SHORT_S = 60.0
    class CountedWakes(queue.SimpleQueue):
        # a settler's wake-up queue that notes who woke it (the function)
        def put(self, item, *a, **k):
            self.names.append(sys._getframe(1).f_code.co_name if item else "stop")
            super().put(item, *a, **k)
    def count_wakes(executor, names):
        counted = CountedWakes()
        counted.names = names
        old_wake, executor._settle_wake = executor._settle_wake, counted
        old_wake.put(True)   # (the settler waits on the old one: it goes round to the new one)
    swakes = []
    count_wakes(ex, swakes)
    def held(i, inp, out):
        return dataclasses.replace(execute(i, inp, out), hold=True)
    def reports_of(n):
        got = []
        while len(got) < n:
            r = reports.get(timeout=60)
            if r != "release":
                got.append([r[0], None if r[1] is None else r[1].message])
        return got
    def value_of(b):
        return np.asarray(h.store.entry(shard_key(b, one[0].id, ((0, 3),))).value).tolist()
    def run_chain(first, n, base, seq=None, change=None):
        # n held computations, ids from ``first``, buffers from ``base`` on
        # (its input put last, so that they are all queued); their reports
        for j in range(n):
            e = held(first + j, base + j, base + 1 + j)
            e = e if seq is None else dataclasses.replace(e, seq=seq(first + j))
            ex.submit(e if change is None else change(j, e))
        h.store.set(shard_key(base, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
        return reports_of(n)
    [sprepared] = ex._by_program[d1]
    srun, left = sprepared.fn, []
    def noting_left(*a):       # (how many were left to settle as each call starts)
        left.append(len(ex._settles))
        return srun(*a)
    sprepared.fn = noting_left
    res["streak"] = run_chain(60, 20, 1500)
    res["streak_wakes"] = list(swakes)
    res["streak_value"] = value_of(1520)
    res["streak_left"] = max(left)
    # seqs that skip the multiples of 8 (every one odd): settled once 16 are left
    left.clear()
    got = run_chain(3000, 24, 3000, seq=lambda i: 2 * i + 1)
    res["streak_odd"] = [got == [[3000 + k, None] for k in range(24)], max(left), value_of(3024)]
    sprepared.fn = srun
    # one that fails on a streak: its report says so, the ones after it fail
    # as they read its output, the ones before it are stored
    calls = [0]
    def failing(*a):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected")
        return srun(*a)
    sprepared.fn = failing
    res["streak_failed"] = run_chain(80, 6, 1600)
    res["streak_failed_value"] = value_of(1603)
    sprepared.fn = srun
    # the 3rd of a streak declares another output than it makes: it fails as
    # the streak's outputs are stored together (seq 8008 is the 5th: a settle
    # of five); the two before it are stored, its output fails, and the ones
    # after it (which read its output as it was made) are stored
    def undeclared(j, e):
        return e if j != 2 else dataclasses.replace(
            e, outputs=[dataclasses.replace(e.outputs[0], aval=m.Aval([64], "float64"))])
    batches, set_many = [], h.store.set_many
    def noting_batches(items):
        batches.append(sorted(k.buffer for k, _ in items))
        return set_many(items)
    h.store.set_many = noting_batches
    got = run_chain(4, 6, 1650, seq=lambda i: 8000 + i, change=undeclared)
    h.store.set_many = set_many
    entry = h.store.entry(shard_key(1653, one[0].id, ((0, 64),)))     # (as declared)
    res["streak_undeclared"] = [got, value_of(1652), entry.error is not None and entry.error.message,
                                value_of(1656), batches]
    # a wait that starts (on another thread) for an output left to settle,
    # while the next one, on a streak, sits in its call (which waits until
    # that output is stored, or gives up after 20 s): the settler stores it
    calls[0], stored, during = 0, threading.Event(), []
    def waiting(*a):
        calls[0] += 1
        if calls[0] == 2:      # (the streak's first call: 90 ran by _run, its settle left)
            t = threading.Thread(target=lambda: h.store.when_done(shard_key(1701, one[0].id, ((0, 3),)),
                                                                   lambda e: stored.set()))
            t.start()
            t.join()
            during.append(stored.wait(timeout=20))
        return srun(*a)
    sprepared.fn = waiting
    ex._late = False     # (as after a streak that settled all it left: the streak sets it)
    res["streak_awaited"] = [run_chain(90, 5, 1700), during, value_of(1701)]
    # a wait named before its computation ran (a SendPiece that came with it):
    # once that one has run on the streak, the settler stores its output,
    # which the next one's call waits for (here: until stored, or 20 s)
    def waiting_in_call(k, event, during):
        # (call k waits until ``event`` is set, or gives up after 20 s)
        def fn(*a):
            calls[0] += 1
            if calls[0] == k:
                during.append(event.wait(timeout=20))
            return srun(*a)
        return fn
    def chain_awaited(first, n, base, awaited, k):
        # n held computations from ``first`` on buffers from ``base``, with
        # a wait for buffer ``awaited`` named before they run; call k waits
        # until that wait is served
        calls[0], stored, during = 0, threading.Event(), []
        h.store.when_done(shard_key(awaited, one[0].id, ((0, 3),)), lambda e: stored.set())
        sprepared.fn = waiting_in_call(k, stored, during)
        return [run_chain(first, n, base), during, value_of(awaited)]
    res["streak_named_before"] = chain_awaited(95, 5, 1800, 1803, 4)
    # the same for the one before the streak's first (it ran by _run): the
    # look as the streak starts finds the wait
    res["streak_named_first"] = chain_awaited(100, 4, 1900, 1901, 2)
    # one whose report the controller waits for (no hold) starts no streak:
    # the settler is woken as the next one starts, as without streaks
    swakes.clear()
    sprepared.fn = srun
    ex._late = False     # (left set by the streak before: a wait for 104's input would wake the settler)
    ex.submit(execute(104, 2000, 2001))
    for k in range(1, 4):
        ex.submit(held(104 + k, 2000 + k, 2001 + k))
    h.store.set(shard_key(2000, one[0].id, ((0, 3),)), jax.device_put(np.ones(3), one[0]))
    res["streak_unheld_first"] = [reports_of(4), list(swakes), value_of(2004)]
    sprepared.fn = srun
    executor_module.SHORT_S = 0.0
    res["hold_s"] = [executor_module.HOLD_SHORT_S, executor_module.HOLD_DEEP_S, executor_module.DEEP_QUEUE]
    res["hold_long"] = [executor_module.LONG_S, executor_module.LONG_QUEUE, executor_module.HOLD_RELEASED_S]
    ex.stop()

    # plain computations queued back to back: the settler thread stores each
    # one's outputs and reports it while the next one runs, which reads it as
    # it is; one that reads it in another sharding waits for the settler
    import collections, sys, threading, time
    executor_module.SHORT_S = 0.001
    reports = queue.Queue()
    slow = set()       # exec ids whose report takes 30 ms (a settler put off by the OS)
    def report(i, e, s, t, hold):
        if i in slow:
            time.sleep(0.03)
        reports.put([i, None if e is None else e.message, threading.current_thread().name])
    ex = Executor(Store(), {d.id: d for d in devs}, report)
    for dig, bl in ((digest, blob), (dr, br), (dg, bg)):
        ex.add_program(dig, bl)
    class CountingDeque(collections.deque):
        appended = 0
        def append(self, item):
            CountingDeque.appended += 1
            super().append(item)
    ex._settles = CountingDeque()
    wakes = []          # per wake of the settler: the function that woke it
    class WakeQueue(queue.SimpleQueue):
        def put(self, item, *a, **k):
            wakes.append(sys._getframe(1).f_code.co_name if item else "stop")
            super().put(item, *a, **k)
    old_wake, ex._settle_wake = ex._settle_wake, WakeQueue()
    old_wake.put(True)      # (the settler waits on the old one: it goes round to the new one)
    reads = []
    input_shard = ex._input_shard
    def counting_input_shard(buffer, inp, s):
        reads.append(buffer)
        return input_shard(buffer, inp, s)
    ex._input_shard = counting_input_shard
    def numbered(i, execute):
        return dataclasses.replace(execute, exec_id=i, seq=i)
    # 5000 -> psum + 1, 8 times -> 5008; 5008 whole (from both halves) x10 -> 5009;
    # 5008 again -> psum + 1 -> 5010. The first waits for its input: all are queued.
    for k in range(8):
        ex.submit(numbered(60 + k, node(digest, 5000 + k, 5001 + k)))
    ex.submit(numbered(68, node(dr, 5008, 5009, (), ())))
    ex.submit(numbered(69, node(digest, 5008, 5010)))
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(5000, d.id, r), jax.device_put(np.zeros(1), d))
    got = [reports.get(timeout=60) for _ in range(10)]
    res["settle_reports"] = [[i, e] for i, e, _ in got]
    res["settle_threads"] = [t for _, _, t in got]
    res["settle_deferred"] = CountingDeque.appended
    res["settle_wakes"] = list(wakes)
    res["settle_reads"] = list(reads)
    res["settle_values"] = [[np.asarray(ex.store.entry(shard_key(b, d.id, r)).value).tolist()
                             for d, r in zip(two, regs)]
                            for b, regs in ((5008, ([[0, 1]], [[1, 2]])), (5009, ([[0, 2]], [[0, 2]])),
                                            (5010, ([[0, 1]], [[1, 2]])))]
    # storing a computation's outputs fails (a bug): its outputs fail with the
    # error and its report carries it; nothing waits for ever
    output_shards = executor_module._Prepared.output_shards
    def failing_output_shards(self, k, o, out, lazy=False):
        if o.buffer == 6001:
            raise RuntimeError("injected")
        return output_shards(self, k, o, out, lazy)
    executor_module._Prepared.output_shards = failing_output_shards
    for k in range(3):
        ex.submit(numbered(70 + k, node(digest, 6000 + k, 6001 + k)))
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(6000, d.id, r), jax.device_put(np.zeros(1), d))
    res["settle_failed"] = [[i, e] for i, e, _ in (reports.get(timeout=60) for _ in range(3))]
    res["settle_failed_stored"] = [[e.error.message if e.error else np.asarray(e.value).tolist()
                                    for e in (ex.store.entry(shard_key(b, d.id, r))
                                              for d, r in zip(two, ([[0, 1]], [[1, 2]])))]
                                   for b in (6001, 6003)]
    executor_module._Prepared.output_shards = output_shards
    # the next one fails (after 10 ms): if it read the one before's outputs as
    # they were, those are stored right (not with its error) though storing
    # them is slow; and the reports go in order though the one before's is
    # slow to give
    ex.submit(numbered(79, node(dg, 7000, 6999)))       # g's prepared program, learnt
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(7000, d.id, r), jax.device_put(np.zeros(1), d))
    assert reports.get(timeout=60)[:2] == [79, None]
    [prepared_g] = ex._by_program[dg]
    run_g = prepared_g.fn
    def boom_later(*a):
        time.sleep(0.01)
        raise RuntimeError("injected")
    prepared_g.fn = boom_later
    def slow_output_shards(self, k, o, out, lazy=False):
        if o.buffer == 7001:
            time.sleep(0.03)
        return output_shards(self, k, o, out, lazy)
    executor_module._Prepared.output_shards = slow_output_shards
    slow.add(82)
    ex.submit(numbered(80, node(digest, 7100, 7001)))
    ex.submit(numbered(81, node(dg, 7001, 7002)))        # reads 7001 as it is
    ex.submit(numbered(82, node(digest, 7200, 7201)))
    ex.submit(numbered(83, node(dg, 7000, 7202)))        # reads 7000 from the store
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(7200, d.id, r), jax.device_put(np.zeros(1), d))
        ex.store.set(shard_key(7100, d.id, r), jax.device_put(np.zeros(1), d))
    res["settle_next_failed"] = [[i, e] for i, e, _ in (reports.get(timeout=60) for _ in range(4))]
    res["settle_next_failed_stored"] = [
        [e.error.message if e.error else np.asarray(e.value).tolist()
         for e in (ex.store.entry(shard_key(b, d.id, r)) for d, r in zip(two, ([[0, 1]], [[1, 2]])))]
        for b in (7001, 7002)]
    prepared_g.fn = run_g
    executor_module._Prepared.output_shards = output_shards
    res["settle_nothing_more"] = reports.empty()
    # one without outputs (it passes nothing on to the next one) left to the
    # settler: reported while the next one runs, not after it (the next one's
    # call waits until the first report is here, or gives up after 20 s)
    dz, bz = export(lambda x: (), (2,), np.float64, two, P("i"), ())
    ex.add_program(dz, bz)
    first_reported, during = threading.Event(), []
    def gated_g(*a):
        during.append(first_reported.wait(timeout=20))
        return run_g(*a)
    prepared_g.fn = gated_g
    ex.submit(numbered(85, dataclasses.replace(node(dz, 7500, 0), outputs=[])))
    ex.submit(numbered(86, node(dg, 7500, 7501)))
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(7500, d.id, r), jax.device_put(np.zeros(1), d))
    first = reports.get(timeout=60)
    first_reported.set()
    second = reports.get(timeout=60)
    res["settle_no_outputs"] = [first[:2], second[:2], during == [True]]
    prepared_g.fn = run_g
    # a bug in the executor thread (outside what a computation's failure
    # covers) after the one before was left to the settler: that one is
    # still settled and reported
    run = ex._run
    def failing_run(entry, devs, index, chain=None):
        if entry.exec_id == 91:
            raise RuntimeError("injected bug")
        return run(entry, devs, index, chain)
    ex._run = failing_run
    ex.submit(numbered(90, node(digest, 7300, 7301)))
    ex.submit(numbered(91, node(digest, 7301, 7302)))
    for d, r in zip(two, ([[0, 1]], [[1, 2]])):
        ex.store.set(shard_key(7300, d.id, r), jax.device_put(np.zeros(1), d))
    try:
        res["settle_after_bug"] = reports.get(timeout=20)[:2]
    except queue.Empty:
        res["settle_after_bug"] = None
    ex.stop()
    # an output other than the call declared (the controller counts the declared
    # one): that computation fails, alone; the next one runs
    digest, blob = export(lambda x: jax.lax.psum(x, "i") + 1., (2,), np.float64, two, P("i"), P("i"))
    h = Host()
    h.put(0, np.zeros(2), two, P("i"))
    err = h.run(digest, blob, two, 0, 1, (2,), "float64", P("i"), P("i"), (64,))
    res["undeclared"] = None if err is None else [err.kind, err.message.splitlines()[0]]
    assert h.run(digest, blob, two, 0, 2, (2,), "float64", P("i"), P("i"), (2,)) is None
    res["after_undeclared"] = h.fetch(2, two, (2,), P("i"))

    # a program that donates its input (the client exports one only for a value
    # that call alone reads): XLA takes the input's buffers over (the arrays are
    # deleted; whether it writes the output into them is XLA's choice), also
    # when the input is the output of the computation just before (queued back
    # to back: that one's outputs are stored before they are donated)
    mesh2 = Mesh(np.array(two), ("i",))
    f = jax.jit(jax.shard_map(lambda x: x * 2., mesh=mesh2, in_specs=P("i"), out_specs=P("i")), donate_argnums=0)
    bdon = bytes(jax.export.export(f)(jax.ShapeDtypeStruct((2,), np.float64,
                                                           sharding=NamedSharding(mesh2, P("i")))).serialize())
    ddon = hashlib.sha256(bdon).hexdigest()
    from zpath.worker.executor import donated_inputs
    res["donated_inputs"] = [list(donated_inputs(jax.export.deserialize(bytearray(b)))) for b in (bdon, blob)]
    ex = Executor(Store(), {d.id: d for d in devs}, report)
    ex.add_program(ddon, bdon)
    halves2 = ([[0, 1]], [[1, 2]])
    for d, r in zip(two, halves2):
        ex.store.set(shard_key(8000, d.id, r), jax.device_put(np.ones(1), d))
    def stored(b):
        return [ex.store.entry(shard_key(b, d.id, r)).value for d, r in zip(two, halves2)]
    ex.submit(numbered(90, node(ddon, 8000, 8001)))
    res["donated_reports"] = [reports.get(timeout=60)[:2]]
    for k in range(1, 4):
        ex.submit(numbered(90 + k, node(ddon, 8000 + k, 8001 + k)))
    res["donated_reports"] += [[i, e] for i, e, _ in (reports.get(timeout=60) for _ in range(3))]
    res["donated"] = [[a.is_deleted() for b in range(8000, 8004) for a in stored(b)],
                      [np.asarray(a).tolist() for a in stored(8004)]]
    # a shard still viewed (a fetch's reply frame not yet sent holds a numpy
    # view of it) is copied, not reused: the donating computation runs, the
    # view keeps its values, and the other shard is taken over
    for d, r in zip(two, halves2):
        ex.store.set(shard_key(8100, d.id, r), jax.device_put(np.full(1, 3.), d))
    view = memoryview(np.asarray(stored(8100)[0]))
    ex.submit(numbered(95, node(ddon, 8100, 8101)))
    res["donated_viewed"] = [reports.get(timeout=60)[:2], view.tolist(),
                             [a.is_deleted() for a in stored(8100)], [np.asarray(a).tolist() for a in stored(8101)]]
    del view
    # settling late: with ``hold`` (nothing in the controller waits for the
    # reports) and nothing here waiting for the outputs, the executor thread
    # settles each short computation itself once the next one has run, and
    # the settler is never woken
    executor_module.SHORT_S = 60.0       # (every computation counts as short)
    lreports = queue.Queue()
    def lreport(i, e, s, t, hold):
        lreports.put([i, None if e is None else e.message, threading.current_thread().name])
    lex = Executor(Store(), {d.id: d for d in devs}, lreport)
    for dig, bl in ((digest, blob), (dg, bg)):
        lex.add_program(dig, bl)
    lwakes = []
    count_wakes(lex, lwakes)
    def held(i, execute):
        return dataclasses.replace(execute, exec_id=i, seq=i, hold=True)
    def put_input(store, b):
        for d, r in zip(two, ([[0, 1]], [[1, 2]])):
            store.set(shard_key(b, d.id, r), jax.device_put(np.zeros(1), d))
    def output_of(store, b):
        return [np.asarray(store.entry(shard_key(b, d.id, r)).value).tolist()
                for d, r in zip(two, ([[0, 1]], [[1, 2]]))]
    for k in range(6):
        lex.submit(held(100 + k, node(digest, 10000 + k, 10001 + k)))
    put_input(lex.store, 10000)
    got = [lreports.get(timeout=60) for _ in range(6)]
    res["late"] = [[i, e] for i, e, _ in got]
    res["late_threads"] = sorted({t for _, _, t in got})
    res["late_wakes"] = list(lwakes)
    res["late_values"] = [output_of(lex.store, 10001), output_of(lex.store, 10006)]
    # the same without hold: the settler, woken as the next one starts
    lwakes.clear()
    for k in range(3):
        lex.submit(numbered(110 + k, node(digest, 11000 + k, 11001 + k)))
    put_input(lex.store, 11000)
    res["unheld"] = [lreports.get(timeout=60)[:2] for _ in range(3)]
    res["unheld_wakes"] = list(lwakes)
    # an output something here waits for already (a piece another host
    # awaits) goes to the settler too
    lwakes.clear()
    awaited = threading.Event()
    lex.store.when_done(shard_key(12001, two[0].id, ((0, 1),)), lambda e: awaited.set())
    for k in range(2):
        lex.submit(held(120 + k, node(digest, 12000 + k, 12001 + k)))
    put_input(lex.store, 12000)
    res["awaited"] = [lreports.get(timeout=60)[:2] for _ in range(2)]
    res["awaited_wakes"] = [list(lwakes), awaited.is_set()]
    # a wait that starts on another thread (as the I/O thread's for a piece)
    # while the next one runs (here: its call waits until the one before's
    # output is stored, or gives up after 20 s) wakes the settler, which stores
    # it: a collective the next one sits in, waiting for a host that waits for
    # a piece of that output, is not held up
    lwakes.clear()
    lex.submit(held(130, node(dg, 13000, 13001)))
    put_input(lex.store, 13000)
    lreports.get(timeout=60)                  # (g's time learnt: short)
    [lprepared_g] = lex._by_program[dg]
    lrun_g = lprepared_g.fn
    in_call, stored_meanwhile, during_g = threading.Event(), threading.Event(), []
    def waiting_g(*a):
        in_call.set()
        during_g.append(stored_meanwhile.wait(timeout=20))
        return lrun_g(*a)
    lprepared_g.fn = waiting_g
    lex.submit(held(131, node(digest, 13100, 13002)))
    lex.submit(held(132, node(dg, 13002, 13003)))
    put_input(lex.store, 13100)
    assert in_call.wait(timeout=60)
    lex.store.when_done(shard_key(13002, two[1].id, ((1, 2),)), lambda e: stored_meanwhile.set())
    res["late_awaited"] = [[i, e] for i, e, _ in (lreports.get(timeout=60) for _ in range(2))]
    res["late_awaited_wakes"] = [list(lwakes), during_g, output_of(lex.store, 13002)]
    lprepared_g.fn = lrun_g
    lex.stop()
    executor_module.SHORT_S = 0.001
    # the executor's threads, named for the kernel (running: they have all run by now)
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            names.add(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:
            pass
    res["thread_names"] = sorted(n for n in names if n.startswith("zpath-"))
    ex.stop()
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                          timeout=110, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_chain_builds_inputs_without_jax_checks_after_the_first_call(results):
    want = 0.0
    for _ in range(5):
        want = 2 * want + 1
    assert results["chain"] == [[want], [want]]
    assert results["chain_makes"] == 1      # later calls reuse what the first learnt


def test_inputs_that_do_not_fit_get_the_error_of_a_fresh_executor(results):
    for case in ("bad_dtype", "bad_shape"):
        learnt, fresh = results[case]
        assert learnt is not None and learnt == fresh, case
    assert results["after_errors"] == [[7.0], [7.0]]


def test_replicated_single_device_and_empty_outputs(results):
    assert results["replicated"] == [[6.0]] * 4
    assert results["single"] == [[0.0, 8.0, 16.0]]
    assert results["empty"] == [[0, 2], [0, 2]]


def test_a_fused_run_passes_arrays_on_the_short_way_and_fails_what_a_failure_reaches(results):
    # x -> psum + 1 (1, 3, 7) -> replicated x10 (70), then 15, 14, 29 from 7
    assert results["fused"][0] == [None, {"3": [[70.0, 70.0]] * 2, "4": [[15.0], [15.0]],
                                          "5": [[14.0], [14.0]], "6": [[29.0], [29.0]]}]
    # from 1: 3, 7, 15 -> 150; 31, 30, 61
    assert results["fused"][1] == [None, {"3": [[150.0, 150.0]] * 2, "4": [[31.0], [31.0]],
                                          "5": [[30.0], [30.0]], "6": [[61.0], [61.0]]}]
    # the run's input and a value read in another sharding go through _execute
    assert results["fused_steps"] == [False, True, True, False, True, True, True]
    assert results["fused_plan_kept"]
    # a computation taken the short way fails: its output and what reads it
    # fail with its error, the rest is right, and the run reports the error
    err, out = results["fused"][2]
    assert err == "RuntimeError: injected"
    assert out["3"] == [[70.0, 70.0]] * 2 and out["4"] == [[15.0], [15.0]]
    assert out["5"] == [err, err] and out["6"] == [err, err]
    # a second failure on the short way poisons its outputs as the first did
    err, outs = results["two_failures"]
    assert err == "RuntimeError: injected" and outs == [[err, err]] * 3
    # a short way node with two outputs, then one that reads the second:
    # 0 -> psum + 1 = 1 -> (11, 3) -> 3 - 2 = 1, twice
    assert results["fused_general_steps"] == [False, True, True]
    assert results["fused_general"][:2] == [[None, [[[11.0], [11.0]], [[1.0], [1.0]]]]] * 2
    # the node with two outputs failing: both fail, and what reads them
    err, outs = results["fused_general"][2]
    assert err == "RuntimeError: injected" and outs == [[err, err]] * 2


def test_short_held_computations_are_settled_by_the_executor_thread_after_the_next_one(results):
    # 0 -> 1 -> ... -> 6 (psum + 1), every computation may hold its report and
    # nothing waits for the outputs: the settler is never woken; the reports
    # go in order, all from the executor thread
    assert results["late"] == [[100 + k, None] for k in range(6)]
    # (one executor thread, whichever of them took the first: not the settler)
    assert len(results["late_threads"]) == 1 and results["late_threads"][0].startswith("exec_")
    assert results["late_wakes"] == []
    assert results["late_values"] == [[[1.0], [1.0]], [[63.0], [63.0]]]
    # without hold the settler settles them, woken as the next one starts
    assert results["unheld"] == [[110 + k, None] for k in range(3)]
    assert results["unheld_wakes"] == ["_execute"] * 2
    # an output awaited already goes to the settler as well
    assert results["awaited"] == [[120, None], [121, None]]
    assert results["awaited_wakes"] == [["_execute"], True]


def test_short_held_chains_on_one_device_run_as_streaks(results):
    # 60 -> ... -> 79 (x * 2): in order, right; 60 by _run, the 19 after it on
    # a streak, which settled them itself (no settler woken) after 64 and 72
    # (so at most 8 were left as a call started)
    assert results["streak"] == [[60 + k, None] for k in range(20)]
    assert results["streak_wakes"] == []
    assert results["streak_value"] == [2.0 ** 20] * 3
    assert results["streak_left"] <= 8
    # odd seqs only: settled once 16 were left (so at most 15 as a call
    # started), not only at the streak's end (23)
    assert results["streak_odd"] == [True, 15, [2.0 ** 24] * 3]
    # the 4th call failed: its report says so, the two after it fail reading
    # its output, the three before it are stored
    got = results["streak_failed"]
    assert [r[0] for r in got] == list(range(80, 86)) and [r[1] for r in got[:3]] == [None] * 3
    assert "injected" in got[3][1] and got[4][1] is not None and got[5][1] is not None
    assert results["streak_failed_value"] == [8.0] * 3
    got, before, failed, last, batches = results["streak_undeclared"]
    assert [r[0] for r in got] == list(range(4, 10)) and [r[1] for r in got[:2]] == [None] * 2
    assert "but the call declared float64[64]" in got[2][1] and got[2][1] in failed
    assert [r[1] for r in got[3:]] == [None] * 3
    assert before == [4.0] * 3 and last == [64.0] * 3
    # 1651-1652 were stored as 1653 failed, 1654-1655 with the rest of the settle of five
    assert [1651, 1652] in batches and [1654, 1655] in batches
    # a wait for an output left to settle woke the settler, which stored it
    # while the streak's call waited (not stored: that call gives up after 20 s)
    reports, during, value = results["streak_awaited"]
    assert reports == [[90 + k, None] for k in range(5)] and during == [True] and value == [2.0] * 3
    # a wait named before its computation ran: the settler stored the output
    # once it had run, while the next one's call waited
    reports, during, value = results["streak_named_before"]
    assert reports == [[95 + k, None] for k in range(5)] and during == [True] and value == [8.0] * 3
    reports, during, value = results["streak_named_first"]
    assert reports == [[100 + k, None] for k in range(4)] and during == [True] and value == [2.0] * 3
    # an unheld one before: the settler was woken as the next one started
    # (by _execute: no streak after it), then the held ones went on a streak
    reports, wakes, value = results["streak_unheld_first"]
    assert reports == [[104 + k, None] for k in range(4)] and "_execute" in wakes and value == [16.0] * 3


def test_a_wait_for_an_output_left_to_settle_late_wakes_the_settler(results):
    # the next computation's call waited for the output of the one before,
    # which was left to settle late: the wait woke the settler, which stored it
    # (with the settler not woken, the call would have given up after 20 s)
    reports, (wakes, during, stored) = results["late_awaited"], results["late_awaited_wakes"]
    assert reports == [[131, None], [132, None]]
    assert during == [True] and stored == [[1.0], [1.0]]
    assert wakes == ["_settle_soon"]


def test_a_series_in_a_fused_run_passes_outputs_on_as_a_jax_loop_does(results):
    # computations 1-3 of 0 -> 1 -> ... -> 4 form one series (4 is the run's
    # output); a value that two computations read, or a computation with two
    # outputs, ends a series: the first fused program has one of one, the
    # one with two outputs none
    assert results["series_plan"] == {"1": [0, 3, 3]}
    assert results["fused_series"] == [{"1": 1}, {}]
    # 0 -> 1 -> 3 -> 7 -> 15 -> 31 (the intermediates are not stored)
    assert results["series"][0] == [None, ["not stored", "not stored", [[31.0], [31.0]]]]
    # computation 2 fails inside the series: its output and those after it
    # fail with its error, and the run reports it; the next run is whole again
    err, outs = results["series"][1]
    assert err == "RuntimeError: injected" and outs == [[err, err]] * 3
    # (and no computation waited for an input: the one that failed is not
    # tried again, its output's readers find its error in the store)
    assert results["series_waited"] == [False, False, False]
    # 0 -> 1 -> 3 (code 1, made from code 0 and never read, is no series' link)
    assert results["unread"] == [12, None, [[3.0], [3.0]], {}]
    assert results["series"][2] == results["series"][0]


def test_a_bug_in_the_executor_fails_the_run_and_the_devices_go_on(results):
    got, err, out = results["broken"][:3]
    assert got == 13 and err == "the worker's executor failed: KeyError: 'injected bug'"
    assert out == [err, err]
    assert results["broken"][3] == [14, None, [[3.0], [3.0]]]


def test_short_computations_run_back_to_back_are_reported_with_hold(results):
    short, _, _ = results["hold_s"]
    assert results["held_first"] == [[1, None, 0]]        # nothing followed it
    # the chain's first waited for its input (released, though nothing was held),
    # then all 11 ran back to back: held but the last, in order
    assert results["held_chain_release"] == ["release"]
    assert results["held_chain"] == [[k, None, short if k < 12 else 0] for k in range(2, 13)]
    assert results["held_chain_value"] == [2.0 ** 11 * v for v in (0.0, 1.0, 2.0)]
    # held while the next computation ran, released once that one had to wait
    assert results["held_before_wait"] == ["release", [20, None, short], "release"]
    assert results["held_after_wait"] == [[21, None, 0]]
    assert results["held_error"] == ["release", [30, False, short], [31, True, 0], [32, False, 0]]
    assert results["held_nothing_more"]


def test_computations_the_controller_lets_hold_with_a_deep_queue_are_reported_with_the_long_hold(results):
    short, deep, depth = results["hold_s"]
    long_s, long_queue, released = results["hold_long"]
    assert depth == 4 and deep == 0.05
    assert long_s == 0.004 and long_queue == 2 and released == 0.5
    # 40 waited for its input; then 41-46 were queued behind it. They are long
    # (12 ms each by the executor's clock): 40, with 5 behind the one that
    # starts next, starts a batch, held (``released``: the executor lets it go)
    # until the report that finds at most half of 5 (2) behind it, 43's, which
    # goes at once and takes it along; after it, too few are left to start one
    got = results["held_deep"]
    assert got[0] == "release" and [r[0] for r in got[1:]] == list(range(40, 47))
    assert [r[1] for r in got[1:]] == [released] * 3 + [0] * 4
    assert results["held_deep_value"] == [2.0 ** 7] * 3
    # a batch that a wait for an input ends: released before the wait (52 waits);
    # 52, with 3 behind, starts a new batch that 54's report (1 behind) ends
    assert results["held_batch_wait"] == ["release", [50, released], [51, released], "release",
                                          [52, released], [53, released], [54, 0], [55, 0], [56, 0]]
    assert results["held_batch_wait_value"] == [32.0] * 3
    # an Execute without ``hold`` (something in the controller waits for its report)
    assert results["held_deep_not_allowed"] == ["release"] + [[40 + k, 0] for k in range(7)]
    assert results["held_deep_not_allowed_value"] == [2.0 ** 7] * 3
    # short computations: the long hold while the queue is deep, then the short
    # one (the first by _run, the next ones on a streak: 4 ms each by that clock)
    got = results["held_deep_short"]
    assert [r[1] for r in got[1:]] == pytest.approx([0.030, 0.008] + [short] * 4 + [0])
    assert results["held_deep_short_value"] == [2.0 ** 7] * 3
    # tiny ones: half the queued work is under 2 x the short hold: the short hold
    got = results["held_deep_tiny"]
    assert [r[1] for r in got[1:]] == pytest.approx([short] * 6 + [0])
    assert results["held_deep_tiny_value"] == [2.0 ** 7] * 3
    assert results["held_deep_nothing_more"]


def test_executor_threads_are_named_for_the_kernel(results):
    # (top -H, perf and benchmarks/worker_threads.py tell them apart by these)
    assert {"zpath-exec_0", "zpath-settle"} <= set(results["thread_names"])


def test_store_wait_set_and_callbacks():
    store = Store()
    key = shard_key(1, 0, [[0, 1]])
    assert not store.wait(key, 0.01).done          # times out
    seen = []
    store.when_done(key, lambda e: seen.append(e.value))
    t = threading.Timer(0.05, store.set, (key, "v"))
    t.start()
    e = store.wait(key, 10)
    t.join()
    assert e.done and e.value == "v" and seen == ["v"]
    store.set(key, "other")                         # done once: later sets are ignored
    assert store.entry(key).value == "v"
    store.when_done(key, lambda e: seen.append(e.value))   # already done: called now
    assert seen == ["v", "v"]
    assert store.free_buffers([1]) == 1 and not store.entry(key).done


def test_error_reports_survive_text_that_utf8_cannot_carry():
    from zpath.net import codec
    from zpath.net import messages as m
    from zpath.worker.executor import _text

    name = b"/data/caf\xe9.npy".decode("utf-8", "surrogateescape")   # a lone surrogate
    with pytest.raises(UnicodeEncodeError):
        codec.pack_body(m.ErrorInfo("RemoteError", name, 0, "f", ""))
    err = m.ErrorInfo("RemoteError", _text(f"FileNotFoundError: {name}"), 0, "f", _text(name))
    done = m.ExecDone(1, err, 0.0, 1.0)
    assert codec.decode(b"k" * 32, codec.encode(b"k" * 32, done, msg_id=1, sender="w"))[1] == done
    assert "\\udce9" in err.message and _text("plain é") == "plain é"


def test_back_to_back_computations_are_settled_beside_the_next_one(results):
    # every report, in order, without errors
    assert results["settle_reports"] == [[60 + k, None] for k in range(10)]
    # each one but the last was handed to the settler (which settles it while
    # the next runs, unless the executor thread must wait and does it first);
    # the last, with nothing after it, was settled by its own executor thread
    assert results["settle_deferred"] == 9
    # the settler was woken for each of those as the next one's XLA call
    # started, not before (while that one's inputs were made)
    assert results["settle_wakes"] == ["_execute"] * 9
    assert results["settle_threads"][-1].startswith("exec_")
    # the chain read its predecessors' outputs as they were: the store was read
    # for the first one's input and for 5008 by the two that read it later
    assert sorted(results["settle_reads"]) == [5000, 5000, 5008, 5008, 5008, 5008]
    want = 0.0
    for _ in range(8):
        want = 2 * want + 1
    assert results["settle_values"] == [[[want], [want]], [[10 * want] * 2] * 2,
                                        [[2 * want + 1], [2 * want + 1]]]


def test_a_failure_to_store_outputs_fails_them_and_is_reported(results):
    err = "RuntimeError: injected"
    assert results["settle_failed"] == [[70, err], [71, None], [72, None]]
    # its outputs fail; the next one had read them as they were and went on
    assert results["settle_failed_stored"] == [[err, err], [[7.0], [7.0]]]
    assert results["settle_nothing_more"]


def test_one_without_outputs_is_reported_while_the_next_one_runs(results):
    assert results["settle_no_outputs"] == [[85, None], [86, None], True]


def test_a_bug_in_the_executor_thread_still_settles_the_one_before(results):
    assert results["settle_after_bug"] == [90, None]


def test_a_failure_of_the_next_one_leaves_the_outputs_it_read_as_they_are(results):
    err = "RuntimeError: injected"
    assert results["settle_next_failed"] == [[80, None], [81, err], [82, None], [83, err]]
    assert results["settle_next_failed_stored"] == [[[1.0], [1.0]], [err, err]]


def test_an_output_other_than_declared_fails_that_computation_alone(results):
    kind, message = results["undeclared"]
    assert kind == "RemoteError" and "but the call declared float64[64]" in message, message
    assert results["after_undeclared"] == [[1.0], [1.0]]


def test_a_donating_program_takes_its_inputs_buffers_over(results):
    assert results["donated_inputs"] == [[0], []]
    assert results["donated_reports"] == [[90 + k, None] for k in range(4)]
    deleted, last = results["donated"]
    assert deleted == [True] * 8 and last == [[16.0], [16.0]]
    # (the client donates a value whose fetch has been answered: a worker whose
    # reply still holds a view of a shard makes XLA copy that shard, not fail)
    report, view, viewed_deleted, out = results["donated_viewed"]
    assert report == [95, None] and view == [3.0] and viewed_deleted == [False, True] and out == [[6.0], [6.0]]
