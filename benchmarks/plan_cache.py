"""Directory.plan with the plan cache on vs. off (pure controller-side planning:
no sockets, no workers).

Workloads, each a chain of ``--calls`` (128) calls where call k reads call
k-1's output, planned on a 2-host island of a ResourceManager (4 devices per
host; the Directory is wired as in the controller):

* ``pmap``: a 2-device pmap-like computation with a float64 scalar per device
  (``[2]`` sharded over ``i``) on one device of each host, as in
  benchmarks/chained.py. The first call puts its input.
* ``reshard``: a ``[64, 64]`` float32 array, row-sharded over the 4 devices of
  one host, read column-sharded by the next call on the other host's 4
  devices (16 pieces cross hosts per call), alternating hosts.
* ``pmap-miss``: ``pmap`` with the cache on but a new shape per call (call k
  reads ``[2 (k + 1)]`` and makes ``[2 (k + 2)]``), so every call misses (the
  cost of looking up and filling the cache; a new program or computation name
  alone is not a new key: plans do not depend on them).

Each repeat plans the whole chain with a fresh Directory; cache-on and cache-off
runs alternate (which goes first alternates too). Prints the median microseconds
per plan over ``--repeats`` (and min/max), the ratio off/on, and the cache's
hits/misses per chain. A script that prints figures, not a test.

    .venv/bin/python benchmarks/plan_cache.py [--calls 128] [--repeats 21]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zpath.controller.directory import Directory  # noqa: E402
from zpath.controller.resources import ResourceManager  # noqa: E402
from zpath.net import messages as m  # noqa: E402

PROGRAM = "c0ffee" * 10 + "abcd"
OWNER = 1


def cluster() -> ResourceManager:
    rm = ResourceManager()
    for h in range(2):
        rm.add_host(name=f"h{h}", island=0, data_address=f"tcp://127.0.0.1:{7000 + h}", pid=100 + h,
                    platform="cpu", num_devices=4, runtime="tcp://127.0.0.1:6999", machine="m0")
    return rm


def directory(rm: ResourceManager, cache: bool) -> Directory:
    return Directory(lambda d: rm.devices[d].host, lambda h: rm.hosts[h].data_address,
                     lambda d: rm.devices[d].jax_id, rm.route, mapping_version=lambda: rm.version,
                     plan_cache_size=4096 if cache else 0)


def pmap_chain(n: int, fresh_shapes: bool = False) -> list[tuple[m.Call, str]]:
    calls = []
    for k in range(n):
        av_in = m.Aval([2 * (k + 1) if fresh_shapes else 2], "float64")
        av_out = m.Aval([2 * (k + 2) if fresh_shapes else 2], "float64")
        buf_in, buf_out = OWNER << 32 | k + 1, OWNER << 32 | k + 2
        calls.append((m.Call(k + 1, PROGRAM, [2], ["i"], [0, 4], [m.CallInput(buf_in, av_in, ["i"], k == 0)],
                             [m.CallOutput(buf_out, av_out, ["i"])]), "f"))
    return calls


def reshard_chain(n: int) -> list[tuple[m.Call, str]]:
    av = m.Aval([64, 64], "float32")
    calls = []
    for k in range(n):
        devs = [0, 1, 2, 3] if k % 2 == 0 else [4, 5, 6, 7]
        buf_in, buf_out = OWNER << 32 | k + 1, OWNER << 32 | k + 2
        ins = [m.CallInput(buf_in, av, ["x", None] if k == 0 else [None, "x"], k == 0)]
        calls.append((m.Call(k + 1, PROGRAM, [4], ["x"], devs, ins,
                             [m.CallOutput(buf_out, av, ["x", None])]), "g"))
    return calls


def time_chain(calls: list[tuple[m.Call, str]], cache: bool) -> tuple[float, int, int]:
    """Microseconds per plan, cache hits, cache misses."""
    d = directory(cluster(), cache)
    plan = d.plan
    t0 = time.perf_counter_ns()
    for call, name in calls:
        plan(call, OWNER, name)
    dt = time.perf_counter_ns() - t0
    assert len(d.buffers) == len(calls) + 1
    return dt / 1e3 / len(calls), d.cache_hits, d.cache_misses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    workloads = {"pmap": pmap_chain(args.calls), "reshard": reshard_chain(args.calls),
                 "pmap-miss": pmap_chain(args.calls, fresh_shapes=True)}
    print(f"# Directory.plan, {args.calls} chained calls per repeat, {args.repeats} repeats; "
          f"python {platform.python_version()} on {platform.machine()}")
    print(f"{'workload':<10} {'off us/plan':>12} {'on us/plan':>11} {'off/on':>7}  "
          f"{'off min..max':>14} {'on min..max':>14}  hits/misses per chain")
    for label, calls in workloads.items():
        for cache in (False, True):       # warm up
            time_chain(calls, cache)
        times: dict[bool, list[float]] = {False: [], True: []}
        stats = (0, 0)
        for r in range(args.repeats):
            for cache in ((False, True) if r % 2 == 0 else (True, False)):
                us, hits, misses = time_chain(calls, cache)
                times[cache].append(us)
                if cache:
                    stats = (hits, misses)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{label:<10} {off:>12.1f} {on:>11.1f} {off / on:>7.2f}  "
              f"{min(times[False]):>6.1f}..{max(times[False]):<6.1f} "
              f"{min(times[True]):>6.1f}..{max(times[True]):<6.1f}  {stats[0]}/{stats[1]}")


if __name__ == "__main__":
    main()
