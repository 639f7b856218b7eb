"""Where a worker's CPU goes per computation, thread by thread: CPU time and
context switches (voluntary: the thread slept and was woken; involuntary: it
was preempted) of every thread of both workers, per computation, over runs of
the island_dispatch.py workload (``psum(x) + 1.`` on a 2-host island, one
device each): -O (one call per computation) and -F (128 computations in one
call).

    .venv/bin/python benchmarks/worker_threads.py [--calls-o 500] [--calls-f 10] [--repeats 3] [--json PATH]

Counters come from ``/proc/<pid>/task/<tid>/{schedstat,status}`` before and after
each run (Linux only). A worker names its own threads for the kernel
(``zpath-exec_0``, ``zpath-settle``, ``zpath-send``); its main thread runs the
I/O loop; ``ZMQbg/...`` are ZeroMQ's; JAX's threads keep the process's name
(``python``), the busiest of them being gloo's TCP loop, which receives the
all-reduce's bytes. Other processes on the machine change the involuntary
counts and the CPU times; the voluntary counts (wake-ups) move much less.
A script that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

LOOP = 128


def snapshot(pid: int) -> dict[int, tuple[str, int, int, int]]:
    """tid -> (name, ns on a CPU, voluntary, involuntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/schedstat") as f:      # ns on a CPU, ns waiting for one, slices
                ran_ns = int(f.read().split()[0])
            with open(f"{base}/status") as f:
                status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue       # the thread ended meanwhile
        out[int(tid)] = (name, ran_ns,
                         int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls-o", type=int, default=500, help="calls per -O run")
    p.add_argument("--calls-f", type=int, default=10, help="calls per -F run (128 computations each)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    import jax

    import zpath as zp

    jax.config.update("jax_enable_x64", True)
    cluster = zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
    results: dict[str, Any] = {}
    try:
        devs = zp.make_virtual_device_set().add_slice(devices=2).devices

        def body(i: Any, y: Any) -> Any:
            return jax.lax.pcast(jax.lax.psum(y, "i") + 1., "i", to="varying")

        fns = {"O": zp.pmap(lambda x: jax.lax.psum(x, "i") + 1., axis_name="i", devices=devs),
               "F": zp.pmap(lambda x: jax.lax.fori_loop(0, LOOP, body, x), axis_name="i", devices=devs)}
        workers = {name: p.pid for name, p in cluster.local.procs if name.startswith("worker")}
        for v, calls, per in (("O", args.calls_o, 1), ("F", args.calls_f, LOOP)):
            fn = fns[v]
            x = np.full(2, -1.0)
            for _ in range(20 if v == "O" else 2):        # warm-up
                x = fn(x)
            x.result(timeout=600)
            totals: dict[tuple[str, int], list[float]] = {}
            wall = 0.0
            for _ in range(args.repeats):
                before = {w: snapshot(pid) for w, pid in workers.items()}
                t0 = time.perf_counter()
                x = np.full(2, -1.0)      # the fixed point of psum(x) + 1 over 2 devices
                for _ in range(calls):
                    x = fn(x)
                got = x.result(timeout=600)
                wall += time.perf_counter() - t0
                if not np.all(np.asarray(got) == -1.0):
                    raise AssertionError(f"-{v}: expected -1 everywhere, got {got}")
                for w, pid in workers.items():
                    for tid, (name, cpu, vol, invol) in snapshot(pid).items():
                        c0, v0, i0 = before[w].get(tid, (name, 0, 0, 0))[1:]
                        t = totals.setdefault((w, tid), [0.0, 0, 0])
                        t[0] += cpu - c0
                        t[1] += vol - v0
                        t[2] += invol - i0
            comps = calls * per * args.repeats
            print(f"-{v}: {comps} computations, {wall / comps * 1e6:,.1f} us wall per computation")
            out: dict[str, Any] = {"wall_us_per_comp": wall / comps * 1e6, "workers": {}}
            for w, pid in sorted(workers.items()):
                names = {tid: n for tid, (n, *_) in snapshot(pid).items()}
                rows = []
                for (ww, tid), (cpu, vol, invol) in totals.items():
                    if ww != w:
                        continue
                    name = "main (I/O loop)" if tid == pid else names.get(tid, "?")
                    rows.append({"thread": name, "tid": tid, "cpu_us": cpu / comps / 1e3,
                                 "voluntary": vol / comps, "involuntary": invol / comps})
                rows.sort(key=lambda r: -r["cpu_us"])
                total = sum(r["cpu_us"] for r in rows)
                print(f"  {w}: CPU {total:,.0f} us per computation; voluntary {sum(r['voluntary'] for r in rows):.2f}, "
                      f"involuntary {sum(r['involuntary'] for r in rows):.2f} switches")
                for r in rows:
                    if r["cpu_us"] > 0 or r["voluntary"] >= 0.05:
                        print(f"    {r['thread']:18s} CPU {r['cpu_us']:7.1f} us   voluntary {r['voluntary']:5.2f}"
                              f"   involuntary {r['involuntary']:5.2f}")
                out["workers"][w] = {"cpu_us": total, "voluntary": sum(r["voluntary"] for r in rows),
                                     "involuntary": sum(r["involuntary"] for r in rows), "threads": rows}
            results[v] = out
        print(f"(load {os.getloadavg()[0]:.1f})")
    finally:
        zp.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
