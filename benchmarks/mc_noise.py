"""How far a throughput ratio against JAX multi-controller moves on this machine
when both sides are multi-controller: the A/A version of ``chained.py``'s -C
ratio (and of ``island_dispatch.py``'s -O), for reading its targets.

Each invocation starts two fresh pairs of multi-controller processes, A and B
(the processes of ``island_dispatch.py``: two JAX processes with one CPU device
each, joined by jax.distributed and gloo), warms both up, then times
``--repeats`` runs of each, alternating as ``chained.py`` alternates zpath and
MC (which pair goes first alternates too). A run is ``--calls`` chained calls of
``psum(x) + 1.`` (512 by default: ``chained.py --programs 4``'s 4 x 128), blocked
on at the end. The ratio B / A of the median throughputs is what a runtime
exactly as fast as multi-controller would score in that invocation; the script
prints it per invocation, with its 95% bootstrap interval, and in how many
invocations it reached ``--target``. Both pairs exist for the whole invocation;
only one runs at a time. A script that prints figures, not a test.

    .venv/bin/python benchmarks/mc_noise.py [--invocations 10] [--repeats 15] [--calls 512] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402  (benchmarks/ab.py: the machine)
from island_dispatch import McBench, on_sigterm, ratio_ci  # noqa: E402


def invocation(calls: int, repeats: int, timeout: float) -> dict:
    """One invocation: two fresh MC pairs, ``repeats`` alternated runs each."""
    pairs: list[McBench] = []
    try:
        for _ in range(2):
            pairs.append(McBench(calls, 1, min(calls, 200), 1, "end", timeout))
        a, b = pairs
        ta: list[float] = []
        tb: list[float] = []
        for r in range(repeats):
            if r % 2 == 0:
                ta.append(a.run("O"))
                tb.append(b.run("O"))
            else:
                tb.append(b.run("O"))
                ta.append(a.run("O"))
    finally:
        for p in pairs:
            p.close()
    ratio = statistics.median(ta) / statistics.median(tb)      # throughput B / A
    return {"ratio": ratio, "ratio_ci": ratio_ci(tb, ta), "a_s": ta, "b_s": tb,
            "a_us_per_comp": statistics.median(ta) / calls * 1e6,
            "b_us_per_comp": statistics.median(tb) / calls * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The A/A spread of a throughput ratio against JAX "
                                            "multi-controller: two multi-controller pairs timed "
                                            "alternately, in fresh processes per invocation.")
    p.add_argument("--invocations", type=int, default=10, help="invocations (default 10)")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per pair and invocation (default 15)")
    p.add_argument("--calls", type=int, default=512,
                   help="chained calls per run (default 512, as chained.py --programs 4)")
    p.add_argument("--target", type=float, default=0.95, help="the ratio counted as met (default 0.95)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds the processes may take to start or for one run (default 120)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.invocations < 1 or args.repeats < 1 or args.calls < 1:
        p.error("--invocations, --repeats and --calls must be at least 1")
    if args.calls >= 1024:
        p.error("--calls must be below 1024 (the checked value 2^n - 1 overflows float64)")
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"multi-controller against multi-controller: {args.calls} chained calls of `psum(x) + 1.` per run, "
          f"{args.repeats} alternated runs per pair, {args.invocations} invocations; {ab.machine()}", flush=True)
    results = []
    for i in range(args.invocations):
        t0 = time.monotonic()
        res = invocation(args.calls, args.repeats, args.timeout)
        results.append(res)
        lo, hi = res["ratio_ci"]
        print(f"  invocation {i}: B / A {res['ratio']:.3f} ({lo:.3f}-{hi:.3f}); A {res['a_us_per_comp']:.1f}, "
              f"B {res['b_us_per_comp']:.1f} us/comp median; {time.monotonic() - t0:.0f} s", flush=True)
    ratios = [r["ratio"] for r in results]
    met = sum(r >= args.target for r in ratios)
    print(f"B / A over {len(ratios)} invocations: median {statistics.median(ratios):.3f}, "
          f"{min(ratios):.3f}-{max(ratios):.3f}; >= {args.target} in {met} of {len(ratios)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"invocations": results, "config": vars(args), "machine": ab.machine()}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
