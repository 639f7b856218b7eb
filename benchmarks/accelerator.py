"""Workers on an accelerator: the same zpath code on whatever devices the
workers' JAX finds (GPU, TPU or CPU), checked against plain JAX on the same kind
of device in this process, and timed side by side.

A local cluster of two islands of one host and one device each (on a machine
with one GPU both workers share it: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` is
set for every process unless given). Then:

* ``matmul``   -- ``tanh(x @ w)`` (float32, ``--size`` square) on island 0 against
                  ``jax.jit`` of the same function here: largest difference;
* ``program``  -- a ``@zp.program`` with one stage per island (the intermediate
                  crosses the DCN channel) against the same two functions here;
* ``big``      -- ``--calls`` chained calls of the matmul, zpath against JAX:
                  time per call (the runtime's cost hides behind the device's);
* ``small``    -- ``--small-calls`` chained calls of ``x + 1`` on a float32[1]:
                  time per call (the runtime's cost in the open);
* ``roundtrip`` -- ``x * 2`` of the ``--size`` square float32 from this process and
                  its result fetched, one call a run (a put and a fetch of the value).

The workers' platform is what they registered with (``Cluster.hosts``); with
``--client-platform cpu`` this process exports for the workers' platform
without an accelerator of its own. A benchmark that prints figures, not a test.

    python benchmarks/accelerator.py [--size 2048] [--calls 50] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _times(run: Callable[[], None], repeats: int) -> list[float]:
    run()                                  # warm-up (traces, compiles)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def _device_times(path: str) -> dict[str, Any]:
    """The matmuls' spans on their device in a zp.trace timeline: how many, the
    median time each ran, and the median time from one's start to the next's."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["dur"]) for e in events if e.get("ph") == "X" and e.get("name") == "layer")
    gaps = [b[0] - a[0] for a, b in zip(spans, spans[1:])]
    return {"computations": len(spans), "median_run_us": statistics.median(d for _, d in spans) if spans else None,
            "median_start_to_start_us": statistics.median(gaps) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help="matmul size (default 2048)")
    p.add_argument("--calls", type=int, default=50, help="chained matmul calls per timed run (default 50)")
    p.add_argument("--small-calls", type=int, default=300, help="chained x + 1 calls per timed run (default 300)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each (default 5)")
    p.add_argument("--client-platform", default=None,
                   help="JAX platform of this process (e.g. cpu); default: JAX's choice")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--trace", metavar="PATH", help="also record one run of the chained matmuls as a "
                   "timeline (zp.trace) and print how long each ran on its device")
    args = p.parse_args(argv)

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # two workers on one GPU
    import jax
    import jax.numpy as jnp

    if args.client_platform:
        jax.config.update("jax_platforms", args.client_platform)
    import zpath as zp

    here = jax.devices()[0]
    print(f"this process: jax {jax.__version__}, {here.platform} ({here.device_kind})", flush=True)
    n = args.size
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)
    w = rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)

    def layer(x: Any, w: Any) -> Any:
        return jnp.tanh(x @ w)

    def plus(x: Any) -> Any:
        return x + jnp.float32(1)

    def twice(x: Any) -> Any:
        return x * jnp.float32(2)

    out: dict[str, Any] = {"client_platform": here.platform, "jax": jax.__version__, "size": n}
    cluster = zp.init(islands=2, hosts_per_island=1, devices_per_host=1)
    try:
        # what each worker registered with (its JAX platform), from the controller's log
        registered = [line.split("registered: ", 1)[1] for line in
                      (cluster.local.log_tail("controller", 200) if cluster.local else "").splitlines()
                      if "registered: " in line]
        out["workers"] = registered
        print("workers:", "; ".join(registered) or f"{len(cluster.hosts)} (remote cluster)", flush=True)
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        f0 = zp.pmap(layer, devices=d0, axis_name="i")
        f1 = zp.pmap(layer, devices=d1, axis_name="i")
        inc = zp.pmap(plus, devices=d0, axis_name="i")
        g = jax.jit(layer)

        # correctness: zpath's result against plain JAX's (both on the device kind they have)
        got = np.asarray(f0(x0[None], w[None]))[0]
        ref = np.asarray(g(x0, w))
        out["matmul_max_abs_diff"] = float(np.max(np.abs(got - ref)))

        @zp.program
        def two_stages(x: Any, w: Any) -> Any:
            return f1(f0(x, w), w)

        got = np.asarray(two_stages(x0[None], w[None]))[0]
        ref = np.asarray(g(g(x0, w), w))
        out["program_max_abs_diff"] = float(np.max(np.abs(got - ref)))
        print(f"matmul {n}x{n}: largest difference from plain JAX {out['matmul_max_abs_diff']:.2e}; "
              f"two islands program: {out['program_max_abs_diff']:.2e}", flush=True)

        def chain(fn: Callable, x: Any, w: Any, calls: int) -> Callable[[], None]:
            def run() -> None:
                y = x
                for _ in range(calls):
                    y = fn(y, w)
                np.asarray(y)
            return run

        def chain1(fn: Callable, x: Any, calls: int) -> Callable[[], None]:
            def run() -> None:
                y = x
                for _ in range(calls):
                    y = fn(y)
                np.asarray(y)
            return run

        # the operands put on the devices once, outside the timing, on both sides
        wz, wj = zp.device_put(w[None], d0), jax.device_put(w)
        xz = zp.device_put(x0[None], d0)
        gi = jax.jit(plus)
        dbl = zp.pmap(twice, devices=d0, axis_name="i")
        gd = jax.jit(twice)
        rows = {
            "big": (_times(chain(f0, xz, wz, args.calls), args.repeats),
                    _times(chain(g, jax.device_put(x0), wj, args.calls), args.repeats), args.calls),
            "small": (_times(chain1(inc, np.zeros((1, 1), np.float32), args.small_calls), args.repeats),
                      _times(chain1(gi, jax.device_put(np.zeros(1, np.float32)), args.small_calls),
                             args.repeats), args.small_calls),
            # a value through the device and back: put x, x * 2, fetch (one call a run)
            "roundtrip": (_times(lambda: np.asarray(dbl(x0[None])), args.repeats),
                          _times(lambda: np.asarray(gd(x0)), args.repeats), 1),
        }
        print(f"{'chained calls':<16} {'zpath us/call':>14} {'JAX us/call':>12} {'JAX/zpath':>10}  runs zpath / JAX (s)")
        for name, (tz, tj, calls) in rows.items():
            mz, mj = statistics.median(tz), statistics.median(tj)
            out[name] = {"calls": calls, "zpath_us_per_call": mz / calls * 1e6, "jax_us_per_call": mj / calls * 1e6,
                         "jax_over_zpath": mj / mz, "zpath_runs_s": tz, "jax_runs_s": tj}
            label = {"big": f"big ({n}x{n})", "small": "small (x + 1)",
                     "roundtrip": f"put+fetch {n * n * 4 >> 20} MiB"}[name]
            print(f"{label:<16} {mz / calls * 1e6:>14,.1f} {mj / calls * 1e6:>12,.1f} {mj / mz:>10.3f}  "
                  + " ".join(f"{t:.3f}" for t in tz) + " / " + " ".join(f"{t:.3f}" for t in tj), flush=True)
        if args.trace:
            with zp.trace(args.trace):
                chain(f0, xz, wz, args.calls)()
            out["trace"] = _device_times(args.trace)
            print(f"timeline ({args.trace}): {out['trace']}", flush=True)
    finally:
        zp.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
