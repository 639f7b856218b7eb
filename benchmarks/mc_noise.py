"""How far a throughput ratio against JAX multi-controller moves on this machine
when both sides are multi-controller: the A/A version of ``chained.py``'s -C
ratio, for reading its target.

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
only one runs at a time, and which pair starts its processes first alternates
between invocations. An invocation that fails (a pair that does not start or
hangs past ``--timeout``) is recorded with its error and the next one goes on;
``--json`` is rewritten after every invocation. A script that prints figures,
not a test.

    .venv/bin/python benchmarks/mc_noise.py [--invocations 10] [--repeats 15] [--calls 512] [--json PATH]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402  (benchmarks/ab.py: the machine)
from island_dispatch import McBench, on_sigterm, ratio_ci  # noqa: E402


def invocation(calls: int, repeats: int, timeout: float, b_first: bool = False) -> dict:
    """One invocation: two fresh MC pairs, ``repeats`` alternated runs each
    (``b_first``: pair B's processes are started first)."""
    pairs: dict[str, McBench] = {}
    try:
        for name in ("BA" if b_first else "AB"):
            pairs[name] = McBench(calls, 1, min(calls, 200), 1, "end", timeout)
        a, b = pairs["A"], pairs["B"]
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
        _close(list(pairs.values()))
    ratio = statistics.median(ta) / statistics.median(tb)      # throughput B / A
    return {"ratio": ratio, "ratio_ci": ratio_ci(tb, ta), "a_s": ta, "b_s": tb,
            "a_us_per_comp": statistics.median(ta) / calls * 1e6,
            "b_us_per_comp": statistics.median(tb) / calls * 1e6, "b_started_first": b_first,
            "cpu_s": {"A": a.cpu["O"], "B": b.cpu["O"]}}


def _close(pairs: list[McBench]) -> None:
    """Close every pair, each even if closing one before it failed."""
    if pairs:
        try:
            pairs[0].close()
        finally:
            _close(pairs[1:])


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
    if args.timeout <= 0 or args.target <= 0:
        p.error("--timeout and --target must be positive")
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"multi-controller against multi-controller: {args.calls} chained calls of `psum(x) + 1.` per run, "
          f"{args.repeats} alternated runs per pair, {args.invocations} invocations; {ab.machine()}", flush=True)
    import jax

    config = dict(vars(args), mc_sync="end", python=platform.python_version(), jax=jax.__version__,
                  cpus=os.cpu_count(), machine=ab.machine())
    results: list[dict] = []
    for i in range(args.invocations):
        t0 = time.monotonic()
        try:
            res = invocation(args.calls, args.repeats, args.timeout, b_first=i % 2 == 1)
        except (TimeoutError, RuntimeError, AssertionError) as e:   # (McBench's: a pair hung or failed)
            results.append({"failed": f"{type(e).__name__}: {e}"[-2000:]})
            print(f"  invocation {i}: failed: {type(e).__name__}: {str(e)[-500:]}", flush=True)
        else:
            results.append(res)
            lo, hi = res["ratio_ci"]
            print(f"  invocation {i}: B / A {res['ratio']:.3f} ({lo:.3f}-{hi:.3f}); A {res['a_us_per_comp']:.1f}, "
                  f"B {res['b_us_per_comp']:.1f} us/comp median; {time.monotonic() - t0:.0f} s", flush=True)
        summary = _summary([r["ratio"] for r in results if "ratio" in r], args.target)
        if args.json:       # (after every invocation: a later failure loses nothing)
            with open(args.json, "w") as f:
                json.dump({"invocations": results, "summary": summary, "config": config}, f, indent=2)
    ratios = [r["ratio"] for r in results if "ratio" in r]
    failed = len(results) - len(ratios)
    if ratios:
        print(f"B / A over {len(ratios)} invocations: median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f}; >= {args.target} in {summary['met']} of {len(ratios)}"
              + (f" ({failed} failed)" if failed else ""))
    else:
        print(f"no invocation gave a ratio: all {failed} failed")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if ratios else 1


def _summary(ratios: list[float], target: float) -> dict:
    if not ratios:
        return {"invocations": 0, "met": 0}
    return {"invocations": len(ratios), "met": sum(r >= target for r in ratios),
            "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


if __name__ == "__main__":
    sys.exit(main())
