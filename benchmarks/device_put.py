"""What putting an array onto a device costs a worker: ``jax.device_put`` against
``executor.to_device`` (the same XLA call without JAX's Python path in front of
it; docs/design.md, "Speed mechanisms, kept apart"), in one process, for:

* a numpy array (a client's Put, a received piece made a shard);
* a JAX array on another local device (a shard read on another device of the
  same host);
* a JAX array already on that device (wrapped, not copied, both ways).

Each case is timed both ways in alternating rounds of ``--calls`` calls; the
script prints the median µs per call of each way over ``--rounds`` rounds, the
interquartile range, and the ratio of the medians. JAX runs on the CPU with 2
emulated devices (set here, before JAX is imported).

    .venv/bin/python benchmarks/device_put.py [--calls 2000] [--rounds 9] [--size 256] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from zpath.worker.executor import to_device  # noqa: E402


def _per_call_us(fn, x, device, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x, device)
    out = fn(x, device)
    out.block_until_ready()
    return (time.perf_counter() - t0) / (calls + 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round and way (2000)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (9)")
    ap.add_argument("--size", type=int, default=256, help="float32 elements per array (256: 1 KiB)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    devs = jax.devices()
    if len(devs) < 2:
        raise SystemExit(f"needs 2 devices, JAX has {len(devs)}: leave XLA_FLAGS unset or ask for 2")
    d0, d1 = devs[:2]
    host = np.arange(args.size, dtype=np.float32)
    on_d0 = jax.device_put(host, d0)
    cases = {"numpy array": (host, d0), "JAX array, another device": (on_d0, d1),
             "JAX array, its own device": (on_d0, d0)}
    ways = {"jax.device_put": jax.device_put, "to_device": to_device}
    times: dict[str, dict[str, list[float]]] = {c: {w: [] for w in ways} for c in cases}
    for case, (x, dev) in cases.items():      # warm: compile nothing, but fill caches
        for fn in ways.values():
            _per_call_us(fn, x, dev, 100)
    for r in range(args.rounds):
        for case, (x, dev) in cases.items():
            order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
            for name, fn in order:
                times[case][name].append(_per_call_us(fn, x, dev, args.calls))
    out = {}
    for case, by_way in times.items():
        row = {}
        for name, ts in by_way.items():
            q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
            row[name] = {"median_us": statistics.median(ts), "p25_us": q[0], "p75_us": q[2]}
        row["ratio"] = row["to_device"]["median_us"] / row["jax.device_put"]["median_us"]
        out[case] = row
    if args.json:
        print(json.dumps({"size_bytes": host.nbytes, "calls": args.calls, "rounds": args.rounds, "cases": out}))
        return
    print(f"{host.nbytes} bytes, {args.rounds} alternating rounds of {args.calls} calls "
          f"(µs per call: median [p25-p75])")
    print(f"{'case':28} {'jax.device_put':>24} {'to_device':>24} {'ratio':>7}")
    for case, row in out.items():
        cells = [f"{row[w]['median_us']:7.1f} [{row[w]['p25_us']:.1f}-{row[w]['p75_us']:.1f}]" for w in ways]
        print(f"{case:28} {cells[0]:>24} {cells[1]:>24} {row['ratio']:7.3f}")


if __name__ == "__main__":
    main()
