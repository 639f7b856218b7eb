"""A newcomer's wait: the first calls of a client that connects to an island
another client keeps busy alone.

Cluster: a local cluster of 1 island x 1 host x 2 devices. Client A (its own
process) runs a ``zp.pmap`` of six chained ``tanh(y @ y)`` per device (about
10 ms here), keeping ``--depth`` calls outstanding: while it is the only
client connected, the controller keeps its alone window of work queued at the
devices (``ZPATH_SCHEDULER_ALONE_WINDOW_MS``), while it is alone on the island
but others are connected its solo window (``ZPATH_SCHEDULER_SOLO_WINDOW_MS``).
After ``--lead`` seconds client B (another process) connects, puts a value and
calls the same computation ``--calls`` times, waiting for each result. Printed
per run: B's connect time, its first call's latency (call to result) and the
median of the others, for each alone window in ``--windows`` (run in rotating
order, ``--repeats`` times); the first window given is the controller's
setting before the alone window existed (equal to the solo window: 100 ms).
A benchmark that prints figures, not a test.

    python benchmarks/newcomer.py [--windows 100,500] [--repeats 3] [--depth 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# what both clients run first: connect (timed), their devices, the computation
_CLIENT = r"""
import sys, time, json
import jax, jax.numpy as jnp, numpy as np
import zpath as zp
address, key, n, size, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t = time.monotonic()
conn = zp.connect(address, key, name=name)
connect_s = time.monotonic() - t
dev = zp.make_virtual_device_set().add_slice(devices=len(conn.client.devices)).devices

def work(x):
    return jax.lax.fori_loop(0, 6, lambda i, y: jnp.tanh(y @ y), x)

f = zp.pmap(work, devices=dev)
"""

# A: n calls outstanding until B is done (or argv[6] seconds)
CLIENT_A = _CLIENT + r"""
x = f(np.full((len(dev), size, size), 0.01, np.float32))
x.result(timeout=120)
print("ready", flush=True)
sys.stdin.readline()
out, end = [], time.monotonic() + float(sys.argv[6])   # (stopped when B is done)
while time.monotonic() < end:
    out.append(f(x))
    if len(out) >= n:
        out.pop(0).result(timeout=120)
for o in out:
    o.result(timeout=120)
zp.shutdown()
"""

# B: n calls, one at a time
CLIENT_B = _CLIENT + r"""
x = np.full((len(dev), size, size), 0.01, np.float32)
lat = []
for _ in range(n):
    t = time.monotonic()
    x = f(x)
    x.result(timeout=120)
    lat.append(time.monotonic() - t)
print(json.dumps({"connect_s": connect_s, "latency_s": lat}), flush=True)
zp.shutdown()
"""


def one_run(window_ms: float, depth: int, size: int, lead: float, calls: int) -> dict[str, Any]:
    from zpath.cluster.launcher import LocalCluster, stop_processes

    env = {"ZPATH_SCHEDULER_ALONE_WINDOW_MS": f"{window_ms:g}"}
    with LocalCluster(1, 1, 2, env=env) as cluster:
        a = subprocess.Popen([sys.executable, "-c", CLIENT_A, cluster.address, cluster.key.hex(), str(depth),
                              str(size), "busy", str(lead + 120)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        b = None
        try:
            if a.stdout.readline().split() != ["ready"]:
                raise RuntimeError(f"client A failed to start (exit {a.poll()})")
            a.stdin.write("go\n")
            a.stdin.flush()
            time.sleep(lead)              # A alone: its window of work fills the devices
            b = subprocess.Popen([sys.executable, "-c", CLIENT_B, cluster.address, cluster.key.hex(),
                                  str(calls), str(size), "newcomer"], stdout=subprocess.PIPE, text=True)
            out, _ = b.communicate(timeout=300)
            if b.returncode != 0:
                raise RuntimeError(f"client B failed (exit {b.returncode})")
            got = json.loads(out.strip().splitlines()[-1])
        finally:
            stop_processes([p for p in (a, b) if p is not None], grace=10)
    lat = got["latency_s"]
    return {"window_ms": window_ms, "connect_ms": 1e3 * got["connect_s"], "first_ms": 1e3 * lat[0],
            "later_ms": 1e3 * statistics.median(lat[1:]) if len(lat) > 1 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="100,500",
                    help="alone windows to compare, ms (default 100,500: the solo window, and the default)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per window, in rotating order")
    ap.add_argument("--depth", type=int, default=128, help="calls client A keeps outstanding")
    ap.add_argument("--size", type=int, default=384, help="matrix side of the computation")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds A runs alone before B connects")
    ap.add_argument("--calls", type=int, default=10, help="calls B makes, one at a time")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    windows = [float(w) for w in args.windows.split(",")]
    if args.repeats < 1 or args.calls < 1 or not windows:
        ap.error("--repeats, --calls and --windows need at least one")
    print(f"# newcomer: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; 1 island x 1 host "
          f"x 2 devices; A keeps {args.depth} calls of {args.size}x{args.size} x6 tanh(y@y) outstanding; "
          f"B connects after {args.lead:g} s", flush=True)
    runs = []
    for r in range(args.repeats):
        for w in windows[r % len(windows):] + windows[:r % len(windows)]:
            res = one_run(w, args.depth, args.size, args.lead, args.calls)
            runs.append(res)
            print(f"  alone window {w:g} ms: B connected in {res['connect_ms']:.0f} ms, first call "
                  f"{res['first_ms']:.0f} ms, later calls {res['later_ms']:.1f} ms (median)", flush=True)
    print("alone window | B's connect | B's first call | B's later calls (medians of the runs)")
    table = []
    for w in windows:
        mine = [x for x in runs if x["window_ms"] == w]
        row = {k: statistics.median(x[k] for x in mine) for k in ("connect_ms", "first_ms", "later_ms")}
        row["window_ms"] = w
        table.append(row)
        print(f"{w:>9g} ms | {row['connect_ms']:8.0f} ms | {row['first_ms']:11.0f} ms | "
              f"{row['later_ms']:12.1f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": runs, "table": table, "args": vars(args)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
