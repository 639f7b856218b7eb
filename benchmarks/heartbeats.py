"""The controller's CPU while its simulated hosts are busy: N simulated hosts
(``zpath worker --simulate``) run a chain of ``--nodes`` SPMD nodes over all
their devices, each taking ``--cost-ms`` of device time, sent op by op. Every
host reports once per node (through its relay), so the controller's own work
is small and the heartbeats (one ``Ping`` out and one ``Pong`` in per host
each ``ZPATH_PING_INTERVAL``, unless the host reported since the last tick:
docs/design.md, "Scale") are most of it. Prints the controller's CPU (all its
threads, from /proc) per second of the chain and per node.

    python benchmarks/heartbeats.py [--hosts 512] [--cost-ms 250] [--nodes 32] [--json [PATH]]

A benchmark that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scale  # noqa: E402
from zpath.cluster.launcher import SimulatedCluster  # noqa: E402


def measure(hosts: int, cost_ms: float, nodes: int) -> dict:
    env = {"ZPATH_HOST_TIMEOUT": "120", "ZPATH_CONTROLLER_TIMEOUT": "120"}
    with SimulatedCluster(hosts, 4, start_timeout=300, env=env) as cluster:
        ctl = psutil.Process(cluster.procs[0][1].pid)
        d = scale.Driver(cluster.address, cluster.key)
        try:
            devs = d.devices
            prog = d.program(cost_ms)
            calls, outs = scale.chain(d, prog, devs, 2)          # warm-up: plans cached
            scale.timed(d, lambda: d.send_calls(calls), outs[-1], devs[0], len(devs))
            d.release(outs)
            calls, outs = scale.chain(d, prog, devs, nodes)
            c0 = scale.cpu_s(ctl)
            wall = scale.timed(d, lambda: d.send_calls(calls), outs[-1], devs[0], len(devs))
            c1 = scale.cpu_s(ctl)
            d.release(outs)
        finally:
            d.close()
    return {"hosts": hosts, "cost_ms": cost_ms, "nodes": nodes, "wall_s": wall,
            "ctl_cpu_ms_per_s": (c1 - c0) / wall * 1e3, "ctl_cpu_ms_per_node": (c1 - c0) / nodes * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=512)
    p.add_argument("--cost-ms", type=float, default=250.0, help="device time of each node")
    p.add_argument("--nodes", type=int, default=32, help="nodes of the chain")
    p.add_argument("--json", nargs="?", const="", metavar="PATH", help="print (or write to PATH) JSON")
    args = p.parse_args()
    r = measure(args.hosts, args.cost_ms, args.nodes)
    if args.json is not None:
        scale.print_json(r, args.json)
    else:
        print(f"hosts {r['hosts']}: controller CPU {r['ctl_cpu_ms_per_s']:.1f} ms a second, "
              f"{r['ctl_cpu_ms_per_node']:.2f} ms per {r['cost_ms']:g} ms node ({r['nodes']} nodes in "
              f"{r['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
