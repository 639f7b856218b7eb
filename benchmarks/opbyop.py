"""Op-by-op throughput: zpath vs. plain JAX on a tiny computation.

Measures how many calls per second of ``lambda x: x + 1.`` on a float64[1]
can be dispatched and completed

* through zpath: a local cluster with one worker process and one device,
  ``f = zp.pmap(lambda x: x + 1., devices=devs)``;
* directly with JAX in this process: ``g = jax.jit(lambda x: x + 1.)``.

Variants:

* chained   -- ``x = f(x)`` N times (each output future feeds the next call),
               then fetch the final value (the fetch is inside the timing);
* unchained -- N independent calls ``f(x0)`` on the same numpy input (so every
               call also puts the input), then fetch the last result.

Each variant runs once as a warm-up (also triggers tracing/compilation), then
``--repeats`` timed times; the table shows the median. This is a benchmark
that prints figures, not a test.

    python benchmarks/opbyop.py [--calls 2000] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np


def _time_runs(run: Callable[[int], None], calls: int, repeats: int, warmup: int) -> list[float]:
    """Warm up once with ``warmup`` calls, then time ``repeats`` runs of ``calls``
    calls. Returns the elapsed seconds of each timed run."""
    run(warmup)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(calls)
        times.append(time.perf_counter() - t0)
    return times


def _summary(times: list[float], calls: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {"times_s": times, "median_s": med, "min_s": min(times), "max_s": max(times),
            "calls_per_s": calls / med, "us_per_call": med / calls * 1e6}


# ---- zpath ------------------------------------------------------------------
def bench_zpath(calls: int, repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    import jax

    import zpath as zp

    jax.config.update("jax_enable_x64", True)     # float64, as the baseline (zpath traces with the caller's setting)
    zp.init(islands=1, hosts_per_island=1, devices_per_host=1)
    try:
        devs = zp.make_virtual_device_set().add_slice(devices=1).devices
        f = zp.pmap(lambda x: x + 1., devices=devs)
        x0 = np.zeros(1)

        def chained(n: int) -> None:
            x = x0
            for _ in range(n):
                x = f(x)
            out = np.asarray(x)
            if not np.array_equal(out, np.full(1, float(n))):
                raise AssertionError(f"zpath chained: expected [{n}.], got {out!r}")

        def unchained(n: int) -> None:
            y = None
            for _ in range(n):
                y = f(x0)
            out = np.asarray(y)
            if not np.array_equal(out, np.ones(1)):
                raise AssertionError(f"zpath unchained: expected [1.], got {out!r}")

        return {"chained": _summary(_time_runs(chained, calls, repeats, warmup), calls),
                "unchained": _summary(_time_runs(unchained, calls, repeats, warmup), calls)}
    finally:
        zp.shutdown()


# ---- plain JAX ----------------------------------------------------------------
def bench_jax(calls: int, repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    import jax

    # float64, as the zpath side computes it (it enables x64 there).
    with jax.enable_x64(True):
        g = jax.jit(lambda x: x + 1.)
        x0 = np.zeros(1)

        def chained(n: int) -> None:
            x = x0
            for _ in range(n):
                x = g(x)
            out = np.asarray(jax.block_until_ready(x))
            if not np.array_equal(out, np.full(1, float(n))):
                raise AssertionError(f"JAX chained: expected [{n}.], got {out!r}")

        def unchained(n: int) -> None:
            y = None
            for _ in range(n):
                y = g(x0)
            out = np.asarray(jax.block_until_ready(y))
            if not np.array_equal(out, np.ones(1)):
                raise AssertionError(f"JAX unchained: expected [1.], got {out!r}")

        return {"chained": _summary(_time_runs(chained, calls, repeats, warmup), calls),
                "unchained": _summary(_time_runs(unchained, calls, repeats, warmup), calls)}


# ---- report -------------------------------------------------------------------
def _table(results: dict[str, Any]) -> str:
    head = (f"{'variant':<10} {'zpath calls/s':>14} {'zpath us/call':>14} "
            f"{'JAX calls/s':>12} {'JAX us/call':>12} {'zpath/JAX time':>15} {'zpath/JAX tput':>15}")
    lines = [head, "-" * len(head)]
    for v in ("chained", "unchained"):
        z, j = results["zpath"][v], results["jax"][v]
        lines.append(f"{v:<10} {z['calls_per_s']:>14,.0f} {z['us_per_call']:>14,.1f} "
                     f"{j['calls_per_s']:>12,.0f} {j['us_per_call']:>12,.1f} "
                     f"{z['us_per_call'] / j['us_per_call']:>14,.1f}x "
                     f"{z['calls_per_s'] / j['calls_per_s']:>15.4f}")
    return "\n".join(lines)


def _spread(results: dict[str, Any]) -> str:
    out = []
    for impl in ("zpath", "jax"):
        for v in ("chained", "unchained"):
            r = results[impl][v]
            out.append(f"  {impl:<5} {v:<9} runs (s): "
                       + " ".join(f"{t:.4f}" for t in r["times_s"]))
    return "\n".join(out)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)     # unwind through the finally that shuts zpath down


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Op-by-op throughput of x + 1 through zpath and plain JAX.")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed run (default 2000)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (default 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="calls in the untimed warm-up run (default: min(calls, 500))")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        p.error("--calls and --repeats must be at least 1")
    warmup = args.warmup if args.warmup is not None else min(args.calls, 500)

    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"op-by-op throughput of `x + 1.` on float64[1]: {args.calls} calls per run, "
          f"median of {args.repeats} runs (after a {warmup}-call warm-up)", flush=True)

    # zpath first: the local cluster is started with fork(), which must happen
    # before this process starts JAX's backend threads (fork with live threads
    # can deadlock the child).
    results: dict[str, Any] = {"zpath": bench_zpath(args.calls, args.repeats, warmup)}
    results["jax"] = bench_jax(args.calls, args.repeats, warmup)

    import jax

    results["config"] = {"calls": args.calls, "repeats": args.repeats, "warmup": warmup,
                         "python": platform.python_version(), "jax": jax.__version__,
                         "backend": jax.default_backend(), "cpus": os.cpu_count()}
    print(f"python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()}), "
          f"{os.cpu_count()} CPUs; zpath: 1 island x 1 host x 1 device (one worker process)")

    print()
    print(_table(results))
    print("(zpath/JAX time: how many times longer a zpath call takes; tput: throughput ratio)")
    print()
    print(_spread(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
