"""Flood: a correct client's calls per second with and without garbage at the
cluster (issue #21: a client must keep at least half its throughput under
10,000 garbage messages per second).

A local cluster (1 island, 1 host, 1 device). The correct client runs ``x + 1``
on its device and fetches each result (one round trip per call: Call to the
controller, Execute to the worker, Put and Fetch at the worker's data port).
A flooder process, started by this script, sends ``--rate`` garbage messages
per second (three frames of random bytes: they fail the signature check), half
at the worker's data port and half at the controller, from a DEALER socket each,
and reads the replies it gets. Windows of ``--seconds`` alternate, without and
with the flood, ``--repeats`` times; the table gives the median calls per
second of each, their ratio, the garbage rate achieved, the Error replies the
flood got, and the bytes the controller's and the worker's logs grew by per
window.

    python benchmarks/flood.py [--rate 10000] [--seconds 5] [--repeats 3] [--json out.json]

This is a benchmark that prints figures, not a test.
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

import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zpath as zp  # noqa: E402


def flood(addresses: list[str], rate: float) -> None:
    """The flooder's process: garbage at ``rate`` messages/s in all, spread over
    ``addresses``, until its standard input closes; prints what it sent and got."""
    ctx = zmq.Context()
    socks = []
    for a in addresses:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.connect(a)
        socks.append(s)
    rng = np.random.default_rng(0)
    garbage = [[rng.bytes(32), rng.bytes(24), rng.bytes(40)] for _ in range(256)]
    os.set_blocking(0, False)
    sent = replies = dropped = 0
    t0 = time.monotonic()
    print("ready", flush=True)
    while True:
        try:
            if os.read(0, 64) == b"":
                break
        except BlockingIOError:
            pass
        due = int((time.monotonic() - t0) * rate) - sent - dropped
        for k in range(min(due, 2000)):
            s = socks[k % len(socks)]
            try:
                s.send_multipart(garbage[(sent + k) % len(garbage)], flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                dropped += 1
        for s in socks:
            while True:
                try:
                    s.recv_multipart(flags=zmq.NOBLOCK)
                    replies += 1
                except zmq.Again:
                    break
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    print(json.dumps({"sent": sent, "dropped": dropped, "replies": replies, "seconds": elapsed}), flush=True)


def log_bytes(cluster: Any) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(cluster.dir, f"{name}.log")) for name, _ in cluster.procs}


def window(inc: Any, seconds: float) -> float:
    """Calls per second of the correct client (each fetched) for ``seconds``."""
    x = np.zeros(1)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        y = inc(x).result(timeout=60)
        assert y[0] == x[0] + 1
        x = y
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=10_000.0, help="garbage messages per second in all")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--flood", nargs="+", help=argparse.SUPPRESS)       # the flooder's process
    args = p.parse_args()
    if args.flood:
        flood(args.flood, args.rate)
        return
    conn = zp.init(islands=1, hosts_per_island=1, devices_per_host=1)
    try:
        cluster = conn.local
        d = zp.make_virtual_device_set().add_slice(devices=1).devices
        inc = zp.pmap(lambda x: x + 1, devices=d)
        window(inc, 1.0)                                    # compile, warm up
        data = next(iter(conn.hosts.values())).data_address
        quiet, flooded, floods, logs = [], [], [], {"quiet": [], "flood": []}
        for _ in range(args.repeats):
            before = log_bytes(cluster)
            quiet.append(window(inc, args.seconds))
            logs["quiet"].append(sum(log_bytes(cluster).values()) - sum(before.values()))
            f = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rate", str(args.rate),
                                  "--flood", data, conn.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            try:
                assert f.stdout.readline().strip() == "ready"
                before = log_bytes(cluster)
                flooded.append(window(inc, args.seconds))
                logs["flood"].append(sum(log_bytes(cluster).values()) - sum(before.values()))
                f.stdin.close()
                floods.append(json.loads(f.stdout.readline()))
                f.wait(30)
            finally:
                if f.poll() is None:
                    f.kill()
                    f.wait()
        q, fl = statistics.median(quiet), statistics.median(flooded)
        rate = statistics.median(x["sent"] / x["seconds"] for x in floods)
        replies = statistics.median(x["replies"] / x["seconds"] for x in floods)
        print(f"correct client, calls/s (each fetched), median of {args.repeats} windows of {args.seconds:g} s:")
        print(f"  without flood  {q:8.1f}   {[round(x, 1) for x in quiet]}")
        print(f"  with flood     {fl:8.1f}   {[round(x, 1) for x in flooded]}")
        print(f"  ratio          {fl / q:8.2f}")
        print(f"flood: {rate:,.0f} garbage messages/s sent (asked {args.rate:,.0f}; half at the worker's data port, "
              f"half at the controller), {replies:,.1f} Error replies/s received")
        print(f"log bytes per window: without {statistics.median(logs['quiet']):,.0f}, "
              f"with flood {statistics.median(logs['flood']):,.0f}")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores")
        if args.json:
            with open(args.json, "w") as fjson:
                json.dump({"quiet": quiet, "flooded": flooded, "floods": floods, "logs": logs,
                           "ratio": fl / q}, fjson)
    finally:
        zp.shutdown()


if __name__ == "__main__":
    main()
