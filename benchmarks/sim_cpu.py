"""The simulated hosts' own CPU per host per node, in one process, no sockets.

One ``SimProcess`` of ``--hosts`` hosts (4 devices each) is given chains of
``--nodes`` SPMD computations of 0 ms over every device, each forwarded to the
process as a relay forwards it (``Forwarded``, groups of ``--group`` hosts, as
the controller's relays), with a ``Free`` of the chain's buffers after it; its
timers run and its relays' batches are built until nothing is left. Printed:
CPU seconds (``time.process_time``) per host per node of each of ``--repeats``
chains, with groups of hosts (``SimGroup``, docs/design.md "Simulated hosts")
and, with ``--per-host``, without. What the controller and the sockets cost is
not in it (``benchmarks/scale.py`` measures the whole), so the machine's load
moves it less. A script that prints figures, not a test.

    python benchmarks/sim_cpu.py [--hosts 512] [--nodes 20] [--repeats 5] [--per-host]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zpath.net import codec  # noqa: E402
from zpath.net import messages as m  # noqa: E402
from zpath.worker.simulate import SimProcess  # noqa: E402

KEY = b"k" * 32
DEVICES = 4


def make_process(hosts: int, groups: bool) -> SimProcess:
    """A SimProcess whose hosts are registered as ranks 0..hosts-1 (no controller)."""
    proc = SimProcess(KEY, "tcp://127.0.0.1:9", hosts, DEVICES, cost_ms=0.0, groups=groups)
    for i, h in enumerate(proc.hosts):
        h.registered(m.Registered(i, [m.DeviceInfo(DEVICES * i + j, i, 0, j, DEVICES * i + j, "sim")
                                      for j in range(DEVICES)]))
        proc.by_rank[i] = h
        for d in h.device_ids:
            proc.by_device[d] = h
    return proc


def forward(proc: SimProcess, msg: m.Record, msg_id: int, group: int, collect: list[int]) -> None:
    """``msg`` forwarded to every host, one ``Forwarded`` per group (its first host the relay)."""
    frames = [bytes(f) for f in codec.encode(KEY, msg, msg_id=msg_id, sender="controller")]
    n = len(proc.hosts)
    for first in range(0, n, group):
        hosts = list(range(first, min(n, first + group)))
        if collect:
            proc.by_rank[first].relay.collect(collect, hosts)
        proc.forwarded(m.Forwarded(first, proc.data_address, hosts, [0] * len(hosts), collect), frames)


def chain(proc: SimProcess, nodes: int, first_exec: int, first_buffer: int, group: int) -> float:
    """CPU seconds to run a chain of ``nodes`` 0 ms SPMD nodes and free its buffers."""
    devices = list(range(DEVICES * len(proc.hosts)))
    aval = m.Aval([len(devices)], "float32")
    x = None
    t0 = time.process_time()
    for k in range(nodes):
        out = first_buffer + k
        inputs = [] if x is None else [m.ExecInput(x, aval, ["x"], [])]
        ex = m.Execute(first_exec + k, 0, "program", "f", [len(devices)], ["x"], devices, devices, inputs,
                       [m.ExecOutput(out, aval, ["x"])], True)
        forward(proc, ex, first_exec + k, group, [ex.exec_id])
        x = out
    while True:
        proc.now = time.monotonic()
        proc.timers.run_due(proc.now)
        proc._flush()
        if proc.relaying:
            proc._relay_due()
            proc._flush()
        if proc.timers.next_in(proc.now) is None and not proc.relaying:
            break
    forward(proc, m.Free([first_buffer + k for k in range(nodes)]), first_exec + nodes, group, [])
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=512)
    p.add_argument("--nodes", type=int, default=20, help="nodes per chain")
    p.add_argument("--repeats", type=int, default=5, help="chains measured (after one unmeasured)")
    p.add_argument("--group", type=int, default=32, help="hosts per relay")
    p.add_argument("--per-host", action="store_true", help="also without groups of hosts")
    p.add_argument("--json", action="store_true", help="one JSON object")
    args = p.parse_args(argv)
    out: dict[str, object] = {"hosts": args.hosts, "nodes": args.nodes}
    for groups in ((True, False) if args.per_host else (True,)):
        proc = make_process(args.hosts, groups)
        try:
            chain(proc, 4, 1, 1 << 32 | 1, args.group)
            us = [chain(proc, args.nodes, 1000 * (r + 1), 1 << 32 | 100_000 * (r + 1), args.group)
                  / args.nodes / args.hosts * 1e6 for r in range(args.repeats)]
        finally:
            proc.close()
        name = "groups" if groups else "per_host"
        out[f"{name}_us_per_host_per_node"] = [round(u, 2) for u in us]
        out[f"{name}_median"] = round(statistics.median(us), 2)
        if not args.json:
            print(f"{name}: {statistics.median(us):.2f} us per host per node (median of {args.repeats}: "
                  f"{', '.join(f'{u:.2f}' for u in us)})", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
