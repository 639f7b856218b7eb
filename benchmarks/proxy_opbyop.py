"""Op-by-op throughput through the IFRT proxy against zp.pmap, in one run.

One local cluster (one island, one host, one device) serves both:

* **zpath**: ``f = zp.pmap(lambda x: x + 1., devices=devs)`` in this process;
* **proxy**: unmodified JAX in a client process (``JAX_PLATFORMS=proxy``),
  ``g = jax.jit(lambda x: x + 1.)`` on the cluster's device, through the IFRT
  proxy that ``zp.init(ifrt_proxy=...)`` started.

Each run chains ``--calls`` calls (``x = f(x)``) on a float32[1] and then reads the
value back. It reports the time for the calls to return (**dispatch**: how
asynchronous the path is: a call that returned at once did not wait for the
computation) and the time until the value is here (**total**). zpath and proxy
runs alternate; the table shows medians and the proxy/zpath ratio of each pair's
totals with a 95% bootstrap interval. A benchmark that prints figures, not a test.

    python benchmarks/proxy_opbyop.py [--calls 500] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

# the JAX client: runs `run N` commands from stdin, answers one JSON line each
CLIENT = r'''
import json, sys, time
import zpath.proxy
zpath.proxy.initialize()
import jax, numpy as np
g = jax.jit(lambda x: x + 1.)
dev = jax.devices()[0]
print(json.dumps({"device": str(dev)}), flush=True)
for line in sys.stdin:
    n = int(line.split()[1])
    x = jax.device_put(np.zeros(1, np.float32), dev)
    t0 = time.perf_counter()
    for _ in range(n):
        x = g(x)
    t1 = time.perf_counter()
    out = np.asarray(x)
    t2 = time.perf_counter()
    assert out[0] == n, (out, n)
    print(json.dumps({"dispatch_s": t1 - t0, "total_s": t2 - t0}), flush=True)
'''


def _bootstrap_ratio(pairs: list[tuple[float, float]], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        sample = [rng.choice(pairs) for _ in pairs]
        ratios.append(statistics.median(p / z for z, p in sample))
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)     # unwind through the finally blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=500, help="chained calls per run (default 500)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats must be at least 1")
    signal.signal(signal.SIGTERM, _on_sigterm)
    import zpath as zp

    cluster = zp.init(islands=1, hosts_per_island=1, devices_per_host=1, ifrt_proxy="127.0.0.1:0")
    client = None
    try:
        env = dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{cluster.ifrt_proxy}",
                   IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
        client = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        hello = json.loads(client.stdout.readline())
        devs = zp.make_virtual_device_set().add_slice(devices=1).devices
        f = zp.pmap(lambda x: x + 1., devices=devs)

        def run_zpath(n: int) -> dict[str, float]:
            x = np.zeros(1, np.float32)
            t0 = time.perf_counter()
            for _ in range(n):
                x = f(x)
            t1 = time.perf_counter()
            out = np.asarray(x)
            t2 = time.perf_counter()
            assert out[0] == n, (out, n)
            return {"dispatch_s": t1 - t0, "total_s": t2 - t0}

        def run_proxy(n: int) -> dict[str, float]:
            client.stdin.write(f"run {n}\n")
            client.stdin.flush()
            line = client.stdout.readline()
            if not line:
                raise RuntimeError("the JAX client process ended")
            return json.loads(line)

        print(f"op-by-op `x + 1.` on float32[1], {args.calls} chained calls per run, {args.repeats} runs "
              f"of each, alternating; proxy client on {hello['device']}", flush=True)
        run_zpath(min(args.calls, 100))            # warm-up: tracing, compilation
        run_proxy(min(args.calls, 100))
        runs: dict[str, list[dict[str, float]]] = {"zpath": [], "proxy": []}
        for _ in range(args.repeats):
            runs["zpath"].append(run_zpath(args.calls))
            runs["proxy"].append(run_proxy(args.calls))
    finally:
        if client is not None:
            client.stdin.close()
            try:
                client.wait(10)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(10)
        zp.shutdown()

    import jax
    print(f"python {platform.python_version()}, jax {jax.__version__}, {os.cpu_count()} CPUs; "
          "zpath: 1 island x 1 host x 1 device")
    head = f"{'path':<7} {'calls/s':>9} {'us/call':>9} {'dispatch us/call':>17} {'dispatch share':>15}"
    print(head)
    print("-" * len(head))
    summary: dict[str, Any] = {}
    for path, rs in runs.items():
        total = statistics.median(r["total_s"] for r in rs)
        dispatch = statistics.median(r["dispatch_s"] for r in rs)
        summary[path] = {"calls_per_s": args.calls / total, "us_per_call": total / args.calls * 1e6,
                         "dispatch_us_per_call": dispatch / args.calls * 1e6, "runs": rs}
        print(f"{path:<7} {args.calls / total:>9,.0f} {total / args.calls * 1e6:>9,.1f} "
              f"{dispatch / args.calls * 1e6:>17,.1f} {dispatch / total:>15.2f}")
    pairs = [(z["total_s"], p["total_s"]) for z, p in zip(runs["zpath"], runs["proxy"], strict=True)]
    ratio = statistics.median(p / z for z, p in pairs)
    lo, hi = _bootstrap_ratio(pairs)
    summary["proxy_over_zpath_time"] = {"median": ratio, "ci95": [lo, hi]}
    print(f"proxy / zpath time per call: {ratio:.2f} (95% interval {lo:.2f}..{hi:.2f})")
    print("(dispatch share: the part of a run spent before the last call returned; near 1 means "
          "the calls wait for the computations, well below 1 that they return at once)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"calls": args.calls, "repeats": args.repeats, **summary}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
