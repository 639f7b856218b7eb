"""The controller core alone at scale: CPU per SPMD node, no sockets.

A ``ControllerCore`` (zpath/controller/core.py) with N registered hosts of
``--devices`` devices (one island, one runtime) plans a chain of SPMD calls
over every device, one at a time: the client's ``Call``, every host's
``ExecDone`` (through relays: each relay's ``ExecDoneBatch``), and the client's ``Release`` of the value before. It prints, per
N, the median time (this process's CPU, single-threaded) of each of the three
per node, and per host. ``--in-flight K`` sends K calls before their
reports, which come as one batch per relay with the rows of all K
interleaved, host by host (as op by op back to back). Sockets, encoding and decoding are left out (see
benchmarks/scale.py for the whole controller), so this isolates what the
controller's decisions cost as hosts grow. The core's API is stable, so the
script runs against an older checkout too (``PYTHONPATH=OLD python
benchmarks/core_scale.py``) for side-by-side figures.

``--fused NODES`` also measures a template of NODES SPMD nodes: the largest
turn of its first run (which fuses it) and, for its first fused run, the
core's CPU, the encoding and signing of what it sends (each message many
peers get alike once), the bytes, the workers' decoding, and one worker's
handling of its ``DefineFused`` (decoded and kept, as a worker process first
meets it).

    python benchmarks/core_scale.py [--hosts 64 256 512] [--nodes 30] [--repeats 5] [--in-flight K]
        [--fused NODES] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import sys
import time
from typing import Any

from zpath.config import ControllerConfig
from zpath.controller.core import ControllerCore, Send
from zpath.net import codec
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION
from zpath.worker.state import LocalShards, WorkerState

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
        call, done, release = self.nodes(1)
        return call, done, release

    def nodes(self, k: int) -> tuple[float, float, float]:
        """``k`` SPMD nodes in flight together (each reads the one before), their
        reports coming as one batch per relay that holds the rows of all ``k``
        host by host (as a relay batches what its group reports when the calls
        come back to back); then the values before each released. Seconds per
        node for the Calls, the reports and the Releases."""
        av = m.Aval([len(self.devices)], "float32")
        call_s = done_s = release_s = 0.0
        sent: list[Any] = []          # the effects that sent computations (a call's, or a report's: parked nodes)
        made = []
        for _ in range(k):
            out = self.client << 32 | next(self.ids)
            call = m.Call(next(self.ids), self.digest, [len(self.devices)], ["x"], self.devices,
                          [] if self.x is None else [m.CallInput(self.x, av, ["x"], False)],
                          [m.CallOutput(out, av, ["x"])])
            t0 = time.process_time()
            sent += self.c.handle(self.now, b"client", 3, call, [])
            call_s += time.process_time() - t0
            made.append(self.x)
            self.x = out
        while sent:
            relays: dict[bytes, tuple[list[int], list[int]]] = {}     # relay -> (its hosts, exec ids)
            direct: list[int] = []
            for e in sent:
                if isinstance(e, Send) and type(e.msg) is RELAY and e.msg.collect:
                    relays.setdefault(e.ident, (e.msg.hosts, []))[1].extend(e.msg.collect)
                elif isinstance(e, Send) and isinstance(e.msg, m.Execute) and e.msg.exec_id not in direct:
                    direct.append(e.msg.exec_id)
            sent = []
            t0 = time.process_time()
            for ident, (hosts, execs) in relays.items():
                rows = [(x, h) for h in hosts for x in execs]
                n = len(rows)
                sent += self.c.handle(self.now, ident, 4, m.ExecDoneBatch(
                    [x for x, _ in rows], [h for _, h in rows], [self.now] * n, [self.now + 0.001] * n, [0.0] * n,
                    []), [])
            for exec_id in direct:
                for h in range(self.hosts):
                    sent += self.c.handle(self.now, f"w{h}".encode(), 4,
                                          m.ExecDone(exec_id, None, self.now, self.now + 0.001), [])
            done_s += time.process_time() - t0
        for x in made:
            if x is not None:
                t0 = time.process_time()
                self.c.handle(self.now, b"client", 5, m.Release([x]), [])
                release_s += time.process_time() - t0
        self.now += 0.002
        return call_s / k, done_s / k, release_s / k


def measure(hosts: int, devices: int, nodes: int, repeats: int, relay_min_hosts: int | None = None,
            in_flight: int = 1) -> dict:
    chain = Chain(hosts, devices, relay_min_hosts)
    for _ in range(5):                 # warm-up: the plan cache, the arrays
        chain.nodes(in_flight)
    runs = []
    for _ in range(repeats):
        parts = [chain.nodes(in_flight) for _ in range(max(1, nodes // in_flight))]
        runs.append([sum(p[k] for p in parts) / len(parts) for k in range(3)])
    call, done, release = (statistics.median(r[k] for r in runs) * 1e6 for k in range(3))
    return {"hosts": hosts, "devices": hosts * devices, "in_flight": in_flight, "call_us": call, "exec_done_us": done,
            "exec_done_us_per_host": done / hosts, "release_us": release,
            "total_us_per_node": call + done + release, "total_us_per_host": (call + done + release) / hosts,
            "runs_total_us": [sum(r) * 1e6 for r in runs]}


def measure_fused(hosts: int, devices: int, nodes: int, relay_min_hosts: int | None = None) -> dict:
    """A template of ``nodes`` SPMD nodes over every device (a chain, the first
    reading a value put): its first run (plain calls, fused at its end: the
    core's largest turn, in ms), then its first fused run, which sends each
    host the fused program (``DefineFused``) and the ``RunFused``: the core's
    CPU for it, the loop's encoding and signing of what it sends (a message
    many peers get alike once, a Relay's message once), the bytes sent, how
    many distinct ``DefineFused`` there are, the workers' decoding of what
    they get, summed over the hosts, and one worker's decoding and keeping of
    its ``DefineFused`` (its bytes; the median of 5, CPU)."""
    chain = Chain(hosts, devices, relay_min_hosts)
    c, now, devs = chain.c, chain.now, chain.devices
    av = m.Aval([len(devs)], "float32")
    key = b"k" * 32
    turns: list[float] = []

    def timed(ident: bytes, msg: Any) -> list[Any]:
        t0 = time.process_time()
        effects = c.handle(now, ident, 1, msg, [])
        while c.busy:
            effects += c.resume(now)
        turns.append(time.process_time() - t0)
        return effects

    def block(k: int) -> int:
        return chain.client << 32 | (k + 1) << 16

    first, x = block(0), block(1000)
    calls, prev, put = [], x, True
    for k in range(nodes):
        calls.append(m.Call(7, chain.digest, [len(devs)], ["x"], devs, [m.CallInput(prev, av, ["x"], put)],
                            [m.CallOutput(first + k, av, ["x"])]))
        prev, put = first + k, False
    timed(b"client", m.DefineProgram(1, [x], first, nodes, m.Program(
        1, "chain", "parallel", calls, [first + k for k in range(nodes - 1)] + [x])))
    while c.in_flight:
        exec_id = next(iter(c.in_flight))
        for h in list(c.in_flight[exec_id].hosts):
            timed(c.worker_ident[h], m.ExecDone(exec_id, None, now, now + 0.001))
    first_run_ms = max(turns) * 1e3
    template = c.templates[(chain.client, 1)]
    if template.fused is None:
        raise RuntimeError("the template was not fused")
    first, x = block(1), block(1001)
    turns.clear()
    effects = timed(b"client", m.RunProgram(2, 1, [x], first, [first + nodes - 1]))
    core_s = turns[0]
    t0 = time.process_time()
    bodies: dict[int, bytes] = {}
    inner: dict[int, list[Any]] = {}
    per_peer: dict[bytes, list[tuple[Any, bytes]]] = {}
    received: list[tuple[int, list[Any]]] = []       # (hosts that decode them, frames)
    sent_bytes = 0
    for e in effects:
        if not isinstance(e, Send):
            continue
        if type(e.msg) is RELAY:                # the message it carries: encoded once for all relays
            msg = e.buffers.msg
            frames = inner.get(id(msg))
            if frames is None:
                frames = inner[id(msg)] = codec.encode(key, msg, msg_id=1, sender="c", buffers=e.buffers.buffers)
            sent_bytes += sum(len(f) for f in codec.encode(key, e.msg, msg_id=2, sender="c", buffers=frames))
            received.append((len(e.msg.hosts), frames))
            continue
        body = bodies.get(id(e.msg))
        if body is None:
            body = bodies[id(e.msg)] = codec.pack_body(e.msg)
        per_peer.setdefault(e.ident, []).append((e.msg, body))
    signed: dict[tuple[int, ...], list[list[Any]]] = {}
    for ident, msgs in per_peer.items():        # peers that get the very same messages: signed once
        k = tuple(id(msg) for msg, _ in msgs)
        frames_list = signed.get(k)
        if frames_list is None:
            frames_list = signed[k] = [codec.encode(key, msg, msg_id=3, sender="c", body=b) for msg, b in msgs]
        sent_bytes += sum(len(f) for frames in frames_list for f in frames)
        if ident != b"client":
            received += [(1, frames) for frames in frames_list]
    encode_s = time.process_time() - t0
    t0 = time.process_time()
    for n, frames in received:
        for _ in range(n):
            codec.decode(key, frames)
    decode_s = time.process_time() - t0
    # one worker's handling of its DefineFused, as a worker process meets it the
    # first time: decoding it and keeping it, its shards named from its own devices
    define = next(frames for _, frames in received if codec.decode(key, frames)[1].TYPE == m.DefineFused.TYPE)
    runs_seen = getattr(codec, "_RUNS_SEEN", {})       # (what the codec keeps of lists sent as runs)
    worker_s = []
    for _ in range(5):
        runs_seen.clear()
        state = WorkerState(60.0, now)
        t0 = time.process_time()
        state.define_fused(codec.decode(key, define)[1], LocalShards(set(range(devices))))
        worker_s.append(time.process_time() - t0)
    return {"hosts": hosts, "devices": hosts * devices, "fused_nodes": nodes,
            "first_run_largest_turn_ms": first_run_ms,
            "distinct_define_fused": len({id(d) for d in template.fused.defines.values()}),
            "fused_run_core_ms": core_s * 1e3, "fused_run_encode_ms": encode_s * 1e3,
            "fused_run_turn_ms": (core_s + encode_s) * 1e3, "fused_run_sent_mb": sent_bytes / 1e6,
            "workers_decode_ms": decode_s * 1e3, "define_fused_bytes": sum(len(f) for f in define),
            "worker_define_ms": statistics.median(worker_s) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--devices", type=int, default=4, help="devices per host")
    p.add_argument("--nodes", type=int, default=30, help="nodes per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per size (the median is printed)")
    p.add_argument("--json", nargs="?", const="", metavar="PATH",
                   help="one JSON object per size (PATH: the last one into PATH too, as benchmarks/ab.py reads it)")
    p.add_argument("--relay-min-hosts", type=int, help="the controller's relay_min_hosts (0: no relays; "
                   "default: the controller's; relayed reports come as one batch per relay)")
    p.add_argument("--in-flight", type=int, default=1, help="nodes in flight together, their rows interleaved "
                   "in each relay's batch (as op by op, back to back)")
    p.add_argument("--fused", type=int, metavar="NODES",
                   help="also a template of NODES SPMD nodes: its first run and its first fused run")
    args = p.parse_args(argv)
    for n in args.hosts:
        if args.fused:
            r = measure_fused(n, args.devices, args.fused, args.relay_min_hosts)
            if args.json is not None:
                print(json.dumps(r), flush=True)
            else:
                print(f"hosts {n:4d}: a fused template of {args.fused} nodes: first run's largest turn "
                      f"{r['first_run_largest_turn_ms']:.0f} ms; first fused run: {r['distinct_define_fused']} "
                      f"distinct DefineFused, core {r['fused_run_core_ms']:.0f} ms + encoding "
                      f"{r['fused_run_encode_ms']:.0f} ms, {r['fused_run_sent_mb']:.2f} MB sent, workers' "
                      f"decoding {r['workers_decode_ms']:.0f} ms in all; one worker's DefineFused "
                      f"({r['define_fused_bytes'] / 1e3:.1f} kB) decoded and kept in "
                      f"{r['worker_define_ms']:.2f} ms", flush=True)
        r = measure(n, args.devices, args.nodes, args.repeats, args.relay_min_hosts, args.in_flight)
        if args.json is not None:
            print(json.dumps(r), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(r, f)
        else:
            print(f"hosts {n:4d}: per SPMD node {r['total_us_per_node']:8.0f} us CPU ({r['total_us_per_host']:5.1f} "
                  f"per host): Call {r['call_us']:7.0f}, {n} ExecDones {r['exec_done_us']:7.0f} "
                  f"({r['exec_done_us_per_host']:.1f} each), Release {r['release_us']:6.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
