"""Fetch latency: how long ``result()`` takes for a small value, and a call's
whole round trip, after the cluster has been idle for a while.

A local cluster of one island of two hosts with one device each, and
``f = zp.pmap(lambda x: psum(x, 'i') + 1., axis_name='i')`` on its two devices
(the computation of benchmarks/island_dispatch.py): its value is one float64
per device, so a fetch asks each host for 8 bytes.

* done value: ``y = f(x)``, then ``--gap-ms`` idle (the computation is done
  by then), then ``y.result()`` timed: the client's request to both hosts and
  their replies, as in reading a loss after a step.
* round trip: ``--gap-ms`` idle, then ``f(x).result()`` timed: the call through
  the controller to the hosts, the computation, and the fetch.
* tree: ``--tree`` (8) calls, then ``--gap-ms`` idle (8 computations take
  about 3 ms here: they are done by then), then
  ``jax.device_get`` of the list of them timed (as in reading a step's
  metrics; each leaf's ``copy_to_host_async`` first, so the fetches go out
  together), and the same number read one by one with ``result()``.
* big value: ``b = g(v)`` (``g`` doubles a ``--big-mib`` MiB float64 shard
  per device), then ``--gap-ms`` idle, then ``b.block_until_ready()`` timed
  (a value over 64 KiB is waited for without being copied here), and a
  second such value's ``result()`` (the copy itself) beside it; and
  ``jax.block_until_ready`` of the ``--big-outputs`` (4) outputs of one call,
  ``--big-mib`` in all (the parameters a training step returns), and of as
  many outputs of one ``zp.program`` run, each made by a computation of its
  own (a program's step); and, back to back, ``--count`` steps of
  ``state = step(state)`` with ``donate_argnums=0`` on a ``--big-mib`` state,
  each waited for with ``jax.block_until_ready(state)`` (as a training loop
  does): whether the steps donated, and their time.

Each is measured ``--count`` times per gap, the gaps alternated. How long the
machine was idle before matters on a virtual machine: code and data the last
request left in the caches are gone after a few tens of milliseconds (see
docs/benchmarks.md, fetch.py). Medians and the 10th and 90th percentiles, in
µs. This is a benchmark that prints figures, not a test.

    python benchmarks/fetch.py [--count 60] [--gap-ms 5,20,80] [--tree 8] [--big-mib 16] [--big-outputs 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dispatch_latency import _quantiles  # noqa: E402  (benchmarks/dispatch_latency.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=60, help="fetches and round trips per gap (default 60)")
    p.add_argument("--gap-ms", default="5,20,80",
                   help="idle time before each, ms, comma-separated (default 5,20,80; at least 5)")
    p.add_argument("--tree", type=int, default=8, help="values read together by jax.device_get (default 8)")
    p.add_argument("--big-mib", type=float, default=16.0,
                   help="MiB per device of the big value (default 16; 0: leave it out)")
    p.add_argument("--big-outputs", type=int, default=4,
                   help="big outputs of the one call, and of the one program run, waited for together "
                        "(default 4)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        gaps = [float(g) for g in args.gap_ms.split(",")]
    except ValueError:
        p.error(f"--gap-ms: numbers of ms separated by commas, not {args.gap_ms!r}")
    if args.count < 2 or not gaps or min(gaps) < 5 or args.tree < 1 or not 0 <= args.big_mib <= 1024 \
            or not 1 <= args.big_outputs <= 64:
        p.error("--count must be >= 2, --tree >= 1, --big-mib in [0, 1024], --big-outputs in [1, 64] "
                "and every --gap-ms >= 5 "
                "(a computation is done by then)")

    import jax

    import zpath as zp

    jax.config.update("jax_enable_x64", True)
    cluster = zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
    done: dict[float, list[float]] = {g: [] for g in gaps}
    trip: dict[float, list[float]] = {g: [] for g in gaps}
    tree: dict[float, list[float]] = {g: [] for g in gaps}
    each: dict[float, list[float]] = {g: [] for g in gaps}
    big_block: dict[float, list[float]] = {g: [] for g in gaps}
    big_result: dict[float, list[float]] = {g: [] for g in gaps}
    big_outputs: dict[float, list[float]] = {g: [] for g in gaps}
    program_outputs: dict[float, list[float]] = {g: [] for g in gaps}
    steps: list[float] = []
    donated = None
    try:
        devs = zp.make_virtual_device_set().add_slice(devices=2).devices

        def psum_plus_one(x):
            return jax.lax.psum(x, "i") + 1.

        f = zp.pmap(psum_plus_one, axis_name="i", devices=devs)
        x = f(np.zeros(2))
        for _ in range(20):              # warm: compiled, the call's form kept
            f(x).result(timeout=120)
        want = float(np.asarray(x.result())[0]) * 2 + 1
        n_big = int(args.big_mib * (1 << 20)) // 8
        if n_big:
            double = zp.pmap(lambda v: v * 2., axis_name="i", devices=devs)
            v = double(np.ones((2, n_big)) / 2)      # 1. on each device, kept there
            double(v).result(timeout=120)            # (compiled, the call's form kept)
            k = args.big_outputs
            part = n_big // k        # k outputs of --big-mib in all, done by the end of the idle time
            several = zp.pmap(lambda v: tuple(v[:part] * (j + 2.) for j in range(k)), axis_name="i",
                              devices=devs)
            jax.block_until_ready(several(v))
            parts = [zp.pmap(lambda v, j=j: v[:part] * (j + 2.), axis_name="i", devices=devs) for j in range(k)]
            program = zp.program(lambda v: tuple(p(v) for p in parts))
            for _ in range(2):              # (its template defined, then run)
                jax.block_until_ready(program(v))
        for _ in range(args.count):
            for g in gaps:
                y = f(x)
                time.sleep(g / 1000)
                t0 = time.perf_counter()
                got = y.result(timeout=60)
                done[g].append((time.perf_counter() - t0) * 1e6)
                time.sleep(g / 1000)
                t0 = time.perf_counter()
                f(x).result(timeout=60)
                trip[g].append((time.perf_counter() - t0) * 1e6)
                for way, times in ((lambda ys: jax.device_get(ys), tree[g]),
                                   (lambda ys: [y.result(timeout=60) for y in ys], each[g])):
                    ys = [f(x) for _ in range(args.tree)]
                    time.sleep(g / 1000)
                    t0 = time.perf_counter()
                    vals = way(ys)
                    times.append((time.perf_counter() - t0) * 1e6)
                    got = np.concatenate([got, *vals])
                if not (got == want).all():
                    raise AssertionError(f"f(x) fetched {got}, expected {want} on each device")
                if n_big:
                    for times, read in ((big_block[g], lambda b: b.block_until_ready()),
                                        (big_result[g], lambda b: b.result(timeout=60))):
                        b = double(v)
                        time.sleep(g / 1000)
                        t0 = time.perf_counter()
                        read(b)
                        times.append((time.perf_counter() - t0) * 1e6)
                    if not (b.result(timeout=60)[:, ::4099] == 2.).all():
                        raise AssertionError("the big value is not 2 everywhere")
                    for times, run, what in ((big_outputs[g], several, "call"),
                                             (program_outputs[g], program, "program run")):
                        outs = run(v)
                        time.sleep(g / 1000)
                        t0 = time.perf_counter()
                        jax.block_until_ready(outs)
                        times.append((time.perf_counter() - t0) * 1e6)
                        if not (outs[-1].result(timeout=60)[:, ::4099] == k + 1.).all():
                            raise AssertionError(f"the {what}'s last output is not {k + 1} everywhere")
                        del outs
        if n_big:
            step = zp.pmap(lambda w: w * 0.5 + 0.5, axis_name="i", devices=devs, donate_argnums=0)
            state = double(v) * 0.5        # 1. on each device: the step keeps it so
            for i in range(args.count + 2):          # (the first two: compiled, warm)
                t0 = time.perf_counter()
                state = step(state)
                jax.block_until_ready(state)
                if i >= 2:
                    steps.append((time.perf_counter() - t0) * 1e6)
            if not (state.result(timeout=60)[:, ::4099] == 1.).all():
                raise AssertionError("the donating step's state is not 1 everywhere")
            donated = sorted({donate for _, donate in step._cache})
    finally:
        zp.shutdown()

    def by_gap(times: dict[float, list[float]]) -> dict:
        return {f"g{g:g}": _quantiles(times[g]) for g in gaps}

    out = {"python": platform.python_version(), "jax": jax.__version__, "cpus": os.cpu_count(),
           "count": args.count, "gaps_ms": gaps, "done_us": by_gap(done), "round_trip_us": by_gap(trip),
           "tree": args.tree, "tree_us": by_gap(tree), "one_by_one_us": by_gap(each),
           "big_mib": args.big_mib}
    if n_big:
        out.update(big_block_us=by_gap(big_block), big_result_us=by_gap(big_result),
                   big_outputs=args.big_outputs, big_outputs_us=by_gap(big_outputs),
                   program_outputs_us=by_gap(program_outputs), donating_step_us=_quantiles(steps),
                   step_variants_donating=donated)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print(f"fetch latency, 1 island x 2 hosts x 1 device, psum(x) + 1 of a float64 per device "
          f"(python {out['python']}, jax {out['jax']}, {out['cpus']} CPUs), {args.count} of each per gap")
    print(f"{'':52} {'p10':>8} {'median':>8} {'p90':>8}  (µs)")
    for g in gaps:
        for label, key in (("result() of a done value", "done_us"), ("f(x).result(), round trip", "round_trip_us"),
                           (f"jax.device_get of {args.tree} done values", "tree_us"),
                           (f"{args.tree} done values one by one", "one_by_one_us"),
                           (f"block_until_ready, done {args.big_mib:g} MiB/device", "big_block_us"),
                           (f"result(), done {args.big_mib:g} MiB/device", "big_result_us"),
                           (f"block_until_ready, a call's {args.big_outputs} outputs", "big_outputs_us"),
                           (f"block_until_ready, a program's {args.big_outputs} outputs", "program_outputs_us")):
            if key not in out:
                continue
            q = out[key][f"g{g:g}"]
            print(f"{label + f', {g:g} ms idle':52} {q['p10']:>8,.0f} {q['median']:>8,.0f} {q['p90']:>8,.0f}")
    if n_big:
        q = out["donating_step_us"]
        label = f"donating step + block_until_ready, {args.big_mib:g} MiB/device"
        print(f"{label:52} {q['p10']:>8,.0f} {q['median']:>8,.0f} {q['p90']:>8,.0f}  "
              f"(variants run, donating: {out['step_variants_donating']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
