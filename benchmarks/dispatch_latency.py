"""Dispatch latency: how long after a call its computation starts on the
workers, when the caller goes on running Python.

A local cluster of one island of two hosts with one device each, and
``f = zp.pmap(lambda x: psum(x, 'i') + 1., axis_name='i')`` on its two devices
(the computation of benchmarks/island_dispatch.py). Two measures, from this
process's wall clock at the call to the computation's start on the first of
its hosts (the controller's timeline: one machine, one clock):

* busy caller: the cluster idle, one call ``y = f(x)``, then the caller runs
  ``--busy-ms`` of pure Python (as a training loop preparing its next step
  does) before it waits for ``y``; ``--count`` times, ``--gap-ms`` apart. The
  call is sent by the client's I/O thread, which needs the GIL the caller
  holds.
* burst: a chain of ``--chain`` calls ``x = f(x)`` made as fast as the caller
  can (the -O run of island_dispatch.py), then the result fetched; the delay
  to the first computation's start, and the whole run's time. ``--bursts``
  runs.

Medians and the 10th and 90th percentiles. This is a benchmark that prints
figures, not a test.

    python benchmarks/dispatch_latency.py [--count 100] [--busy-ms 10] [--gap-ms 20]
                                          [--bursts 10] [--chain 500] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])


def _busy(seconds: float) -> int:
    """Pure Python for ``seconds`` (the GIL held throughout)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def _quantiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=10, method="inclusive")      # (at least 2: main checks)
    return {"p10": q[0], "median": statistics.median(xs), "p90": q[8], "n": len(xs)}


def _first_start(client: Any, name: str, since: float, limit: int, wait_s: float = 10.0) -> float:
    """The earliest start (wall clock) of a computation ``name`` that started
    after ``since``, from the controller's timeline. Asked again until it is
    there, for up to ``wait_s``: the value fetched from a worker may reach the
    caller before that worker's report reaches the controller."""
    from zpath.net import messages as m

    deadline = time.monotonic() + wait_s
    while True:
        recs = client.request(m.TimelineRequest(limit)).records
        starts = [r.start for r in recs if r.name == name and r.start >= since]
        if starts or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    if not starts:
        raise RuntimeError(f"no computation {name!r} on the timeline {wait_s:g} s after the call")
    return min(starts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=100, help="busy-caller calls (default 100)")
    p.add_argument("--busy-ms", type=float, default=10.0,
                   help="Python the caller runs after each call, ms (default 10)")
    p.add_argument("--gap-ms", type=float, default=20.0, help="idle time before each call, ms (default 20)")
    p.add_argument("--bursts", type=int, default=10, help="chained runs (default 10)")
    p.add_argument("--chain", type=int, default=500, help="calls per chained run (default 500)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.count < 2 or args.bursts < 2 or args.chain < 1 or args.busy_ms < 0 or args.gap_ms < 0:
        p.error("--count and --bursts must be >= 2, --chain >= 1, --busy-ms and --gap-ms >= 0")

    import jax

    import zpath as zp

    jax.config.update("jax_enable_x64", True)
    cluster = zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
    try:
        devs = zp.make_virtual_device_set().add_slice(devices=2).devices

        def psum_plus_one(x):
            return jax.lax.psum(x, "i") + 1.

        f = zp.pmap(psum_plus_one, axis_name="i", devices=devs)
        client = cluster.client
        x = f(np.zeros(2))
        for _ in range(50):              # warm: compiled, the call's form kept
            x = f(x)
        x.result(timeout=120)

        busy = []
        for _ in range(args.count):
            time.sleep(args.gap_ms / 1000)
            t0 = time.time()
            y = f(x)
            _busy(args.busy_ms / 1000)
            x = y
            x.result(timeout=60)
            busy.append((_first_start(client, "psum_plus_one", t0, 8) - t0) * 1e6)

        first, runs = [], []
        for _ in range(args.bursts):
            time.sleep(args.gap_ms / 1000)
            t0 = time.time()
            for _ in range(args.chain):
                x = f(x)
            x.result(timeout=600)
            runs.append((time.time() - t0) * 1e3)
            first.append((_first_start(client, "psum_plus_one", t0, 2 * args.chain + 8) - t0) * 1e6)
    finally:
        zp.shutdown()

    out = {"python": platform.python_version(), "jax": jax.__version__, "cpus": os.cpu_count(),
           "busy_ms": args.busy_ms, "gap_ms": args.gap_ms, "chain": args.chain,
           "busy_caller_us": _quantiles(busy), "burst_first_start_us": _quantiles(first),
           "burst_run_ms": _quantiles(runs)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"dispatch latency, 1 island x 2 hosts, psum(x) + 1 (python {out['python']}, jax {out['jax']}, "
          f"{out['cpus']} CPUs)")
    print(f"{'':42} {'p10':>9} {'median':>9} {'p90':>9}")
    for label, key, unit in ((f"call -> start, caller busy {args.busy_ms:g} ms (us)", "busy_caller_us", 1),
                             (f"chain of {args.chain}: first start (us)", "burst_first_start_us", 1),
                             (f"chain of {args.chain}: whole run (ms)", "burst_run_ms", 1)):
        q = out[key]
        print(f"{label:42} {q['p10']:>9,.1f} {q['median']:>9,.1f} {q['p90']:>9,.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
