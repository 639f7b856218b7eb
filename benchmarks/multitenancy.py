"""Multi-tenancy: client processes sharing one island, under the proportional-share
and FIFO policies.

Cluster: ``zp.init``-style local cluster of 1 island x 1 host x 2 devices. Every
client is its own process (``zp.connect(address, weight=w)``) and runs the same
computation on both devices of the island: a ``zp.pmap`` of six chained
384x384 float32 ``tanh(y @ y)`` per device (about 10 ms here), keeping
``--depth`` calls outstanding, so every client always has work waiting and the
island is never idle.

1. **Shares.** 4 clients with weights 1:2:4:8, all backlogged for ``--seconds``;
   each client's device time (from the workers' start/end of every computation,
   the timeline the controller keeps) over the interval in which all of them
   were running, trimmed by 10% at each end, as a share of the total, against
   the target w/15, for the ``share`` policy and, for comparison, ``fifo``.
2. **Aggregate throughput** with 1, 2, 4 and 8 clients (weight 1), each
   backlogged for ``--tp-seconds``: computations per second over the interval
   in which all were running, and the devices' busy fraction.
3. **Pictures** (matplotlib, benchmarks/plots.py): ``--png`` (default
   ``multitenancy_timeline.png``), a ``--png-window``-second slice from the
   middle of the ``share`` run: one lane per device, one bar per computation,
   coloured by client; ``--shares-png`` (default ``multitenancy_shares.png``):
   each client's share against its target under both policies.

This is a benchmark that prints figures, not a test.

    python benchmarks/multitenancy.py [--seconds 20] [--tp-seconds 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plots  # noqa: E402  (benchmarks/plots.py)

CLIENT = r"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
import zpath as zp
address, key, weight, seconds, depth, size = sys.argv[1:7]
conn = zp.connect(address, key, name=f"w{float(weight):g}", weight=float(weight))
dev = zp.make_virtual_device_set().add_slice(devices=len(conn.client.devices)).devices

def work(x):
    return jax.lax.fori_loop(0, 6, lambda i, y: jnp.tanh(y @ y), x)

f = zp.pmap(work, devices=dev)
x = np.full((len(dev), int(size), int(size)), 0.01, np.float32)
x = f(x)                                   # compiled and warm; x stays on the devices
x.result(timeout=120)
print("id", conn.client.client_id, flush=True)
sys.stdin.readline()                       # every client starts together
out, n, end = [], 0, time.monotonic() + float(seconds)
while time.monotonic() < end:
    out.append(f(x))
    if len(out) >= int(depth):
        out.pop(0).result(timeout=120)
        n += 1
for o in out:
    o.result(timeout=120)
    n += 1
print("done", n, flush=True)
zp.shutdown()
"""


def run_clients(cluster: Any, weights: list[float], seconds: float, depth: int, size: int
                ) -> tuple[dict[int, float], list[Any], float]:
    """Start one client process per weight, let them all run ``seconds``;
    returns {client id: weight}, the controller's timeline records of them and
    the time they were told to start (after each compiled and ran once)."""
    from zpath.cluster.launcher import stop_processes
    from zpath.net import messages as m
    from zpath.cluster.testing import connected

    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, cluster.address, cluster.key.hex(), str(w),
                               str(seconds), str(depth), str(size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for w in weights]
    try:
        ids = {}
        for p, w in zip(procs, weights):
            line = p.stdout.readline().split()
            if not line or line[0] != "id":
                raise RuntimeError(f"a client process failed to start (exit {p.poll()})")
            ids[int(line[1])] = w
        go = time.time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            line = p.stdout.readline().split()
            if not line or line[0] != "done" or p.wait(120) != 0:
                raise RuntimeError(f"a client process failed (exit {p.poll()})")
    finally:
        stop_processes(procs, grace=10)
    with connected(cluster) as conn:
        recs = [r for r in conn.client.request(m.TimelineRequest(1_000_000)).records if r.client in ids]
    return ids, recs, go


def busy_interval(ids: dict[int, float], recs: list[Any], go: float, trim: float = 0.15
                  ) -> tuple[float, float]:
    """From the start signal to the first client's last end, less ``trim`` of it
    at each side: every client had work waiting throughout. (Each client's
    first computation ran before the signal and is charged to it; right after
    the signal the scheduler evens that out, which the trim leaves out.)"""
    first = go
    last = min(max(r.end for r in recs if r.client == c) for c in ids)
    if last <= first:
        raise RuntimeError("the clients never ran at the same time")
    cut = trim * (last - first)
    return first + cut, last - cut


def device_time(recs: list[Any], lo: float, hi: float) -> dict[int, float]:
    """Device-seconds per client inside [lo, hi] (each record is one host's part;
    on one host its devices are the whole mesh)."""
    used: dict[int, float] = {}
    for r in recs:
        used[r.client] = used.get(r.client, 0.0) + max(0.0, min(r.end, hi) - max(r.start, lo)) * len(r.devices)
    return used


def shares(cluster: Any, weights: list[float], seconds: float, depth: int, size: int) -> dict[str, Any]:
    # one client first compiles the program on the worker (clients share its
    # compiled form), so no measured client is charged the compilation
    run_clients(cluster, [1.0], 0, depth, size)
    ids, recs, go = run_clients(cluster, weights, seconds, depth, size)
    lo, hi = busy_interval(ids, recs, go)
    used = device_time(recs, lo, hi)
    total = sum(used.values())
    wsum = sum(weights)
    rows = []
    for cid, w in sorted(ids.items(), key=lambda kv: kv[1]):
        share = used.get(cid, 0.0) / total
        rows.append({"client": cid, "weight": w, "share": share, "target": w / wsum,
                     "rel_error": share / (w / wsum) - 1,
                     "computations": sum(1 for r in recs if r.client == cid and lo <= r.start < hi)})
    ndev = len(recs[0].devices)
    return {"interval_s": hi - lo, "busy": total / (ndev * (hi - lo)), "clients": rows,
            "ids": ids, "records": recs, "lo": lo, "hi": hi}


def throughput(cluster: Any, n: int, seconds: float, depth: int, size: int) -> dict[str, Any]:
    ids, recs, go = run_clients(cluster, [1.0] * n, seconds, depth, size)
    lo, hi = busy_interval(ids, recs, go)
    done = sum(1 for r in recs if lo <= r.end < hi)
    ndev = len(recs[0].devices)
    busy = sum(device_time(recs, lo, hi).values()) / (ndev * (hi - lo))
    return {"clients": n, "interval_s": hi - lo, "comps_per_s": done / (hi - lo), "busy": busy}


def picture(path: str, res: dict[str, Any], window: float) -> None:
    ids, recs = res["ids"], res["records"]
    mid = (res["lo"] + res["hi"]) / 2
    t0, t1 = mid - window / 2, mid + window / 2
    devices = sorted({d for r in recs for d in r.devices})
    order = {cid: k for k, (cid, _) in enumerate(sorted(ids.items(), key=lambda kv: kv[1]))}
    spans = [(devices.index(d), r.start, r.end, order[r.client])
             for r in recs if r.end > t0 and r.start < t1 for d in r.devices]
    by_id = {row["client"]: row for row in res["clients"]}
    legend = [f"client {cid} weight {w:g}: {100 * by_id[cid]['share']:.1f}% (target {100 * by_id[cid]['target']:.1f}%)"
              for cid, w in sorted(ids.items(), key=lambda kv: kv[1])]
    plots.timeline(path, [f"device {d}" for d in devices], spans, legend,
                   title=f"zpath proportional share, weights 1:2:4:8, {window:g} s of the run",
                   t0=t0, t1=t1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each share run")
    ap.add_argument("--tp-seconds", type=float, default=8.0, help="length of each throughput run")
    ap.add_argument("--tp-clients", default="1,2,4,8")
    ap.add_argument("--depth", type=int, default=32, help="calls each client keeps outstanding")
    ap.add_argument("--size", type=int, default=384, help="matrix side of the computation")
    ap.add_argument("--png", default="multitenancy_timeline.png")
    ap.add_argument("--shares-png", default="multitenancy_shares.png")
    ap.add_argument("--png-window", type=float, default=1.0, help="seconds of the share run drawn")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    from zpath.cluster.launcher import LocalCluster

    print(f"# multitenancy: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"1 island x 1 host x 2 devices; computation {args.size}x{args.size} x6 tanh(y@y) per device",
          flush=True)
    out: dict[str, Any] = {"shares": {}, "throughput": []}
    weights = [1.0, 2.0, 4.0, 8.0]
    for policy in ("share", "fifo"):
        with LocalCluster(1, 1, 2, policy=policy) as cluster:
            t = time.monotonic()
            res = shares(cluster, weights, args.seconds, args.depth, args.size)
            print(f"\n## {policy}: 4 clients, weights 1:2:4:8, {res['interval_s']:.1f} s all busy "
                  f"(devices {100 * res['busy']:.0f}% busy; run took {time.monotonic() - t:.0f} s)")
            print("| client | weight | device-time share | target | relative error | computations |")
            print("|---|---|---|---|---|---|")
            for row in res["clients"]:
                print(f"| {row['client']} | {row['weight']:g} | {100 * row['share']:.2f}% | "
                      f"{100 * row['target']:.2f}% | {100 * row['rel_error']:+.1f}% | {row['computations']} |")
            worst = max(abs(r["rel_error"]) for r in res["clients"])
            print(f"worst relative error: {100 * worst:.1f}%", flush=True)
            if policy == "share":
                picture(args.png, res, args.png_window)
                print(f"timeline picture: {args.png}")
            out["shares"][policy] = {k: v for k, v in res.items() if k not in ("records", "ids")}
    plots.shares(args.shares_png, {p: out["shares"][p]["clients"] for p in ("share", "fifo")},
                 title="device-time share of 4 clients, weights 1:2:4:8")
    print(f"shares picture: {args.shares_png}")
    print("\n## aggregate throughput (share policy, weight 1 each)")
    print("| clients | computations/s | devices busy | interval |")
    print("|---|---|---|---|")
    with LocalCluster(1, 1, 2, policy="share") as cluster:
        for n in [int(v) for v in args.tp_clients.split(",")]:
            tp = throughput(cluster, n, args.tp_seconds, args.depth, args.size)
            out["throughput"].append(tp)
            print(f"| {n} | {tp['comps_per_s']:.1f} | {100 * tp['busy']:.0f}% | {tp['interval_s']:.1f} s |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
