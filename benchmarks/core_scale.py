"""The controller core alone at scale: CPU per SPMD node, no sockets.

A ``ControllerCore`` (zpath/controller/core.py) with N registered hosts of
``--devices`` devices (one island, one runtime) plans a chain of SPMD calls
over every device, one at a time: the client's ``Call``, every host's
``ExecDone`` (through relays: each relay's ``ExecDoneBatch``), and the client's ``Release`` of the value before. It prints, per
N, the median time (this process's CPU, single-threaded) of each of the three
per node, and per host. Sockets, encoding and decoding are left out (see
benchmarks/scale.py for the whole controller), so this isolates what the
controller's decisions cost as hosts grow. The core's API is stable, so the
script runs against an older checkout too (``PYTHONPATH=OLD python
benchmarks/core_scale.py``) for side-by-side figures.

    python benchmarks/core_scale.py [--hosts 64 256 512] [--nodes 30] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import sys
import time

from zpath.config import ControllerConfig
from zpath.controller.core import ControllerCore, Send
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION

RELAY = getattr(m, "Relay", None)       # (protocol 4; an older checkout has none)


class Chain:
    """A core with ``hosts`` hosts and one client running a chain of SPMD calls."""

    def __init__(self, hosts: int, devices: int, relay_min_hosts: int | None = None) -> None:
        self.hosts = hosts
        extra = {} if relay_min_hosts is None else {"relay_min_hosts": relay_min_hosts}
        self.c = ControllerCore(ControllerConfig(policy="share", **extra))
        self.now = 1000.0
        for n in range(hosts):
            self.c.handle(self.now, f"w{n}".encode(), 1, m.RegisterWorker(
                f"h{n}", 0, f"tcp://x:{n}", 1, "cpu", devices, PROTOCOL_VERSION,
                [n * devices + i for i in range(devices)], "runtime", n, hosts, f"machine{n}", "", ""), [])
        self.c.handle(self.now, b"client", 1, m.Hello("bench", PROTOCOL_VERSION, 1.0), [])
        self.client = self.c.peers[b"client"].id
        blob = memoryview(b"program")
        self.digest = hashlib.sha256(blob).hexdigest()
        self.c.handle(self.now, b"client", 2, m.RegisterProgram(self.digest, "f"), [blob])
        self.devices = sorted(self.c.rm.devices)
        self.ids = itertools.count(1)
        self.x: int | None = None

    def node(self) -> tuple[float, float, float]:
        """One SPMD node: (seconds for its Call, for every host's ExecDone, for the Release)."""
        av = m.Aval([len(self.devices)], "float32")
        out = self.client << 32 | next(self.ids)
        call = m.Call(next(self.ids), self.digest, [len(self.devices)], ["x"], self.devices,
                      [] if self.x is None else [m.CallInput(self.x, av, ["x"], False)],
                      [m.CallOutput(out, av, ["x"])])
        t0 = time.process_time()
        effects = self.c.handle(self.now, b"client", 3, call, [])
        t1 = time.process_time()
        relays = [e for e in effects if isinstance(e, Send) and type(e.msg) is RELAY and e.msg.collect]
        if relays:        # through relays: each sends its group's reports as one batch
            for e in relays:
                k = len(e.msg.hosts)
                self.c.handle(self.now, e.ident, 4, m.ExecDoneBatch(
                    e.msg.collect * k, e.msg.hosts, [self.now] * k, [self.now + 0.001] * k, [0.0] * k, []), [])
        else:
            exec_id = next(e.msg.exec_id for e in effects if isinstance(e, Send) and isinstance(e.msg, m.Execute))
            for h in range(self.hosts):
                self.c.handle(self.now, f"w{h}".encode(), 4, m.ExecDone(exec_id, None, self.now, self.now + 0.001),
                              [])
        t2 = time.process_time()
        if self.x is not None:
            self.c.handle(self.now, b"client", 5, m.Release([self.x]), [])
        t3 = time.process_time()
        self.x = out
        self.now += 0.002
        return t1 - t0, t2 - t1, t3 - t2


def measure(hosts: int, devices: int, nodes: int, repeats: int, relay_min_hosts: int | None = None) -> dict:
    chain = Chain(hosts, devices, relay_min_hosts)
    for _ in range(5):                 # warm-up: the plan cache, the arrays
        chain.node()
    runs = []
    for _ in range(repeats):
        parts = [chain.node() for _ in range(nodes)]
        runs.append([sum(p[k] for p in parts) / nodes for k in range(3)])
    call, done, release = (statistics.median(r[k] for r in runs) * 1e6 for k in range(3))
    return {"hosts": hosts, "devices": hosts * devices, "call_us": call, "exec_done_us": done,
            "exec_done_us_per_host": done / hosts, "release_us": release,
            "total_us_per_node": call + done + release, "total_us_per_host": (call + done + release) / hosts,
            "runs_total_us": [sum(r) * 1e6 for r in runs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--devices", type=int, default=4, help="devices per host")
    p.add_argument("--nodes", type=int, default=30, help="nodes per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per size (the median is printed)")
    p.add_argument("--json", action="store_true", help="one JSON object per size")
    p.add_argument("--relay-min-hosts", type=int, help="the controller's relay_min_hosts (0: no relays; "
                   "default: the controller's; relayed reports come as one batch per relay)")
    args = p.parse_args(argv)
    for n in args.hosts:
        r = measure(n, args.devices, args.nodes, args.repeats, args.relay_min_hosts)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"hosts {n:4d}: per SPMD node {r['total_us_per_node']:8.0f} us CPU ({r['total_us_per_host']:5.1f} "
                  f"per host): Call {r['call_us']:7.0f}, {n} ExecDones {r['exec_done_us']:7.0f} "
                  f"({r['exec_done_us_per_host']:.1f} each), Release {r['release_us']:6.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
