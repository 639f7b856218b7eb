"""The single controller at scale: the real controller and N simulated hosts.

For each N (``--hosts N``, default 1 8 64 256 512) it starts a controller and N
simulated hosts of ``--devices`` devices each in one process
(``zpath worker --simulate``: no JAX, a computation occupies its devices for
the time its program declares, an accelerator that uses no host CPU), drives
them with a client that speaks the protocol itself (so the figures are the
controller's, not a tracing client's) and prints per N:

* ``spmd_nodes_per_s`` -- SPMD computations over every device of every host
  per second, sent op by op (one ``Call`` each, back to back) with a program
  that takes no device time: the dispatch throughput (-O); ``traced_nodes_per_s``
  the same nodes sent as one traced program (``Program``, parallel dispatch,
  -C); ``fused_computations_per_s`` -O's calls counted as the 128 computations
  a fused -F call holds; ``sequential_nodes_per_s`` the traced chain with
  sequential dispatch (a node goes once the one it reads has finished);
* ``ctl_cpu_us_per_spmd_node`` -- the controller's CPU time (user + system,
  from /proc) per op-by-op SPMD node, and ``ctl_cpu_us_per_host_msg`` the same
  divided by N: the cost of one host's part (its Execute out, its report in);
* ``max_stall_ms`` -- the longest round trip of a ``Ping`` that a second client
  sends every 5 ms while the controller plans and dispatches a traced program
  of ``--big-nodes`` (10,000) single-host nodes (node i on host i mod N), with
  ``big_program_s`` the time that program took end to end;
* ``ctl_rss_mib`` -- the controller's resident memory after all of it;
* ``min_busy_computation_ms`` -- the smallest computation time of the ladder
  (0.5 ms .. 200 ms) at which chained SPMD nodes over all hosts keep every
  device at least 95% busy (device time / wall time of a traced program), with
  ``busy`` the fraction at each rung tried and ``ctl_cpu_us_per_busy_node`` the
  controller's CPU per node at the last rung (devices busy: the workers hold
  their reports and send them together). The simulated hosts run on the same
  two cores as the controller here, so this counts their host-side work too.
  Each rung uses a program not run before, so its wall time includes the
  program's first run (its bytes sent to every host, its nodes' shapes
  planned): ``busy_fixed_ms`` is each rung's wall time beyond its device time,
  and ``busy_warm`` the same rung run again right after (program known, plans
  cached), with ``min_busy_warm_computation_ms`` the smallest rung tried at
  which that run kept the devices 95% busy;
  ``ctl_bound_min_computation_ms`` is the controller's CPU per node / 0.95, the
  bound the controller alone sets (as if it had a core to itself);
* ``pipeline_parallel_over_sequential`` -- a pipeline of min(N, 64) stages, one
  per host, each stage a 1 ms computation reading the previous stage's output
  from the previous host: runs per second with parallel dispatch over runs per
  second with sequential dispatch: the median over ``--repeats`` adjacent
  pairs (one run of each, after one unmeasured run of each) of the pair's
  ratio, ``pipeline_ratio_range`` the smallest and largest pair, and
  ``pipeline_ms`` every run's time.

``fused_*`` -- a template (``DefineProgram``) of ``--fused-nodes`` (32) SPMD
nodes over every device of every host, a chain that takes no device time (each
run timed until the first and the last host hold their shard of its result):
``fused_first_run_ms`` its first run (its plain calls; the controller fuses it
at its end), ``fused_define_run_ms`` its first fused run (each host gets the
fused program, ``DefineFused``, and the run, ``RunFused``), with
``fused_sim_cpu_ms_define`` the simulated hosts' CPU for that run (decoding and
keeping the definition: all hosts, one process); ``fused_max_stall_ms`` the
longest round trip of a second client's pings (every 5 ms) through these and
``--fused-runs`` (5) more; then, without the pings, ``fused_run_ms`` the median
of ``--fused-runs`` fused runs, ``fused_ctl_cpu_us_per_node`` the controller's
CPU per node over them (``fused_sim_cpu_ms_per_run``: the simulated hosts',
per run), and
``fused_timeline_names`` the names the controller's timeline gives the last
computations (the fused runs: the template's name, "fused").

``relayed_messages`` counts the ``Relay`` messages the controller sent
(``Status.relayed``): a message for at least ``--relay-min-hosts`` hosts goes
once per group of ``--relay-group`` hosts (the controller's
``ZPATH_RELAY_MIN_HOSTS``, ``ZPATH_RELAY_GROUP``; 0 turns relays off; by
default the controller's own settings, 32 and 32).

``--json`` prints one JSON object per N; ``--png PATH`` draws the paper's
Figures 5-7 shapes (throughput against hosts for -O, -C, -F; the smallest busy
computation against hosts; parallel against sequential dispatch against
stages) with matplotlib (benchmarks/plots.py, the ``bench`` extra). This is a benchmark
that prints figures, not a test.

    python benchmarks/scale.py [--hosts 1 8 64 256 512] [--devices 4] [--quick] [--json [PATH]] [--png docs/scale.png]
                               [--relay-min-hosts N] [--relay-group K] [--fused-nodes F] [--fused-runs R]
                               [--fused-only]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zpath.cluster.launcher import SimulatedCluster  # noqa: E402
from zpath.errors import ZpathError  # noqa: E402
from zpath.net import messages as m  # noqa: E402
from zpath.keys import client_keys  # noqa: E402
from zpath.net.codec import CLIENTS, PROTOCOL_VERSION  # noqa: E402
from zpath.net.transport import Endpoint, make_context, unbatched  # noqa: E402
from zpath.worker.simulate import sim_program  # noqa: E402

try:                         # benchmarks/plots.py: matplotlib, an optional extra
    import plots
except ImportError:          # the figures are still printed
    plots = None

HOSTS = (1, 8, 64, 256, 512)
LADDER_MS = (0.5, 1.0, 2.3, 5.0, 10.0, 20.0, 35.0, 50.0, 100.0, 200.0)
BUSY = 0.95
# host reports asked for per rung (--timeline): a rung's at 512 hosts (each
# names its node's devices as runs, a few bytes for all 2,048)
TIMELINE_RECORDS = 40_000
F_COMPUTATIONS = 128
HEARTBEAT_S = 2.0            # the driver's heartbeat while it waits (see Driver.wait_for)


class Driver:
    """A client that speaks the protocol itself: programs whose cost the
    simulated hosts read, SPMD calls over a 1-D mesh, fetches to wait."""

    def __init__(self, address: str, key: bytes, name: str = "scale") -> None:
        self.ctx = make_context()
        self.ep = Endpoint(key, f"client:{name}:{os.getpid()}", signer=CLIENTS)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        nonce = os.urandom(16)
        self.ep.send(self.sock, m.Hello(name, PROTOCOL_VERSION, 1.0, nonce))
        welcome = self._wait(lambda msg: isinstance(msg, m.Welcome), 30.0)
        self.client_id = welcome.client_id
        self.ep.sign_as(*client_keys(key, nonce, welcome.client_id, welcome.session_key))
        self.hosts = sorted(welcome.hosts, key=lambda h: h.rank)
        self.devices = [d.id for h in self.hosts for d in h.devices]
        self.address_of = {d.id: h.data_address for h in self.hosts for d in h.devices}
        self._n = itertools.count(1)
        self._calls = itertools.count(1)
        self._requests = itertools.count(1)
        self.data: dict[str, zmq.Socket] = {}
        self.programs: dict[float, str] = {}
        self.failed: list[str] = []

    def close(self) -> None:
        try:
            self.ep.send(self.sock, m.Goodbye("done"))
        except zmq.ZMQError:
            pass
        for s in [self.sock, *self.data.values()]:
            s.close(0)
        self.ctx.term()

    def _wait(self, want: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            _, header, msg, buffers = self.ep.recv(self.sock)
            for _, item, _ in unbatched(header, msg, buffers):
                if want(item):
                    return item
                self._note(item)
        raise ZpathError(f"no answer from the controller within {timeout:.0f}s")

    def _note(self, item: Any) -> None:
        if isinstance(item, (m.CallFailed, m.Error)):
            self.failed.append(str(item)[:300])

    def relayed(self) -> int:
        """Messages the controller has sent through relays (``Status.relayed``)."""
        self.ep.send(self.sock, m.StatusRequest(False))
        return self._wait(lambda msg: isinstance(msg, m.Status), 30.0).relayed

    def timeline(self, limit: int) -> m.Timeline:
        """The controller's last ``limit`` host reports and its recent events."""
        self.ep.send(self.sock, m.TimelineRequest(limit))
        return self._wait(lambda msg: isinstance(msg, m.Timeline), 60.0)

    def drain(self) -> None:
        while self.sock.poll(0):
            _, header, msg, buffers = self.ep.recv(self.sock)
            for _, item, _ in unbatched(header, msg, buffers):
                self._note(item)
        if self.failed:
            raise ZpathError(f"the controller refused work: {self.failed[0]}")

    def program(self, cost_ms: float) -> str:
        """A program taking ``cost_ms`` of device time per run (registered once)."""
        if cost_ms not in self.programs:
            blob = sim_program(cost_ms, f"cost{cost_ms}")
            digest = hashlib.sha256(blob).hexdigest()
            self.ep.send(self.sock, m.RegisterProgram(digest, f"sim_{cost_ms}ms"), buffers=[blob])
            self.programs[cost_ms] = digest
        return self.programs[cost_ms]

    def buffer(self) -> int:
        return self.client_id << 32 | next(self._n)

    def spmd(self, program: str, devices: list[int], x: int | None) -> tuple[m.Call, int]:
        """A call over ``devices`` (a 1-D mesh) reading ``x`` (or nothing) and
        making a new f32[len(devices)] sharded over it; returns (call, output)."""
        aval = m.Aval([len(devices)], "float32")
        out = self.buffer()
        inputs = [] if x is None else [m.CallInput(x, aval, ["x"], False)]
        return m.Call(next(self._calls), program, [len(devices)], ["x"], devices, inputs,
                      [m.CallOutput(out, aval, ["x"])]), out

    def send_calls(self, calls: list[m.Call]) -> None:
        for c in calls:
            self.ep.send(self.sock, c)

    def send_program(self, calls: list[m.Call], dispatch: str = "parallel", release: list[int] = ()) -> None:
        for part in m.program_parts(m.Program(next(self._calls), "scale", dispatch, calls, list(release))):
            self.ep.send(self.sock, part)

    def release(self, buffers: list[int]) -> None:
        if buffers:
            self.ep.send(self.sock, m.Release(buffers))

    def wait_for(self, buffer: int, device: int, length: int, timeout: float = 600.0) -> None:
        """Wait until shard ``device`` of buffer (f32[length] over the devices,
        device at position 0 of its mesh) exists, by fetching it."""
        addr = self.address_of[device]
        s = self.data.get(addr)
        if s is None:
            s = self.data[addr] = self.ctx.socket(zmq.DEALER)
            s.connect(addr)
        req = next(self._requests)
        self.ep.send(s, m.Fetch(req, buffer, device, [[0, 1]] if length > 1 else [[0, 1]], timeout))
        deadline = time.monotonic() + timeout
        beat = time.monotonic()
        while time.monotonic() < deadline:
            if time.monotonic() - beat > HEARTBEAT_S:
                # as a real client's heartbeat: a client silent for ZPATH_CLIENT_TIMEOUT
                # (15 s) is taken to be gone, and its work with it (a 10,000-node program at
                # 512 hosts on a loaded machine takes longer than that)
                self.ep.send(self.sock, m.Ping(0))
                beat = time.monotonic()
            if not s.poll(100):
                self.drain()
                continue
            _, _, msg, _ = self.ep.recv(s)
            if isinstance(msg, m.FetchReply) and msg.request == req:
                if msg.error is not None:
                    raise ZpathError(f"fetch failed: {msg.error.message}")
                return
            if isinstance(msg, m.Error):
                raise ZpathError(f"fetch refused: {msg.message}")
        raise ZpathError(f"buffer {buffer} did not come within {timeout:.0f}s")


class Prober:
    """A second client, in a process of its own (so that this one's work does
    not delay it), that pings the controller every ``period`` seconds and
    reports every round trip when stopped: the longest is the controller's
    longest stall, or more."""

    def __init__(self, address: str, key: bytes, period: float = 0.005) -> None:
        self.rtts: list[float] = []
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe", address, str(period)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, ZPATH_KEY=key.hex()))
        if self.proc.stdout.readline().strip() != "ready":
            raise ZpathError("the ping prober did not start")

    def stop(self) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        self.rtts = json.loads(out)


def probe(address: str, period: float) -> None:
    """The prober's process: ping until stdin says stop, then print the round trips."""
    ctx = make_context()
    key = bytes.fromhex(os.environ["ZPATH_KEY"])
    ep = Endpoint(key, f"client:probe:{os.getpid()}", signer=CLIENTS)
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    nonce = os.urandom(16)
    ep.send(s, m.Hello("probe", PROTOCOL_VERSION, 1.0, nonce))
    s.poll(30_000)
    _, _, welcome, _ = ep.recv(s)
    ep.sign_as(*client_keys(key, nonce, welcome.client_id, welcome.session_key))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    rtts, seq = [], 0
    while not stop.is_set():
        seq += 1
        t0 = time.perf_counter()
        ep.send(s, m.Ping(seq))
        while s.poll(60_000):
            _, header, msg, buffers = ep.recv(s)
            if any(isinstance(x, m.Pong) and x.seq == seq for _, x, _ in unbatched(header, msg, buffers)):
                break
        rtts.append(time.perf_counter() - t0)
        stop.wait(period)
    ep.send(s, m.Goodbye("done"))
    s.close(0)
    ctx.term()
    print(json.dumps(rtts), flush=True)


_CPU_CLOCKS: dict[int, int | None] = {}


def _cpu_clock(pid: int) -> int | None:
    """The clock that counts process ``pid``'s CPU time (``clock_getcpuclockid``),
    or None where there is none."""
    if pid not in _CPU_CLOCKS:
        clock = None
        try:
            import ctypes
            import ctypes.util
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            cid = ctypes.c_int()
            if libc.clock_getcpuclockid(pid, ctypes.byref(cid)) == 0:
                clock = cid.value
        except (OSError, AttributeError):
            pass
        _CPU_CLOCKS[pid] = clock
    return _CPU_CLOCKS[pid]


def cpu_s(proc: psutil.Process) -> float:
    """The process's CPU time (user + system), seconds: from its CPU clock, in
    nanoseconds, where the system gives one; else psutil's, from /proc's steps of
    10 ms (a short run could read 0)."""
    clock = _cpu_clock(proc.pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:        # (gone: psutil says so)
            pass
    t = proc.cpu_times()
    return t.user + t.system


def chain(d: Driver, program: str, devices: list[int], n: int, x: int | None = None) -> tuple[list[m.Call], list[int]]:
    calls, outs = [], []
    for _ in range(n):
        c, x = d.spmd(program, devices, x)
        calls.append(c)
        outs.append(x)
    return calls, outs


def timed(d: Driver, send: Any, last: int, device: int, length: int) -> float:
    t0 = time.perf_counter()
    send()
    d.wait_for(last, device, length)
    return time.perf_counter() - t0


def measure(hosts: int, devices: int, quick: bool, big_nodes: int, repeats: int,
            relay_min_hosts: int | None = None, relay_group: int | None = None,
            fused_nodes: int = 32, fused_runs: int = 5, fused_only: bool = False,
            timelines: list[dict] | None = None) -> dict:
    started = time.perf_counter()
    # (a simulated host's Pong may wait behind thousands of queued messages on
    # this 2-core machine: a longer silence than by default before it counts as lost)
    env = {"ZPATH_HOST_TIMEOUT": "120", "ZPATH_CONTROLLER_TIMEOUT": "120"}
    if relay_min_hosts is not None:
        env["ZPATH_RELAY_MIN_HOSTS"] = str(relay_min_hosts)
    if relay_group is not None:
        env["ZPATH_RELAY_GROUP"] = str(relay_group)
    with SimulatedCluster(hosts, devices, start_timeout=300, env=env) as cluster:
        ctl = psutil.Process(cluster.procs[0][1].pid)
        sim = psutil.Process(cluster.procs[1][1].pid)
        d = Driver(cluster.address, cluster.key)
        try:
            if fused_only:
                # (as the full run: the program known to every host, its plan cached)
                calls, outs = chain(d, d.program(0.0), d.devices, 4)
                timed(d, lambda: d.send_calls(calls), outs[-1], d.devices[0], len(d.devices))
                d.release(outs)
                out = {"hosts": hosts, "devices": len(d.devices),
                       **fused(cluster, d, ctl, sim, fused_nodes, fused_runs)}
                return {**out, "ctl_rss_mib": ctl.memory_info().rss / 2**20,
                        "seconds": time.perf_counter() - started}
            return _measure(cluster, d, ctl, sim, hosts, devices, quick, big_nodes, repeats, started,
                            fused_nodes, fused_runs, timelines)
        finally:
            d.close()


def _measure(cluster: SimulatedCluster, d: Driver, ctl: psutil.Process, sim: psutil.Process,
             hosts: int, devices: int, quick: bool, big_nodes: int, repeats: int, started: float,
             fused_nodes: int = 32, fused_runs: int = 5, timelines: list[dict] | None = None) -> dict:
    devs = d.devices
    total = len(devs)
    zero = d.program(0.0)
    # (at least 128 nodes but with --quick: CPU time read from /proc, where the
    # system has no CPU clock for a process, comes in steps of 10 ms)
    k = max(8 if quick else 128, (400 if quick else 3000) // hosts)
    # warm-up (plans and templates the controller caches)
    calls, outs = chain(d, zero, devs, 4)
    timed(d, lambda: d.send_calls(calls), outs[-1], devs[0], total)
    d.release(outs)
    out: dict[str, Any] = {"hosts": hosts, "devices": total}

    # -O: op by op, back to back
    calls, outs = chain(d, zero, devs, k)
    c0, s0 = cpu_s(ctl), cpu_s(sim)
    wall = timed(d, lambda: d.send_calls(calls), outs[-1], devs[0], total)
    c1, s1 = cpu_s(ctl), cpu_s(sim)
    d.release(outs)
    out["spmd_nodes_per_s"] = k / wall
    out["ctl_cpu_us_per_spmd_node"] = (c1 - c0) / k * 1e6
    out["ctl_cpu_us_per_host_msg"] = (c1 - c0) / (k * hosts) * 1e6
    out["sim_cpu_us_per_host_msg"] = (s1 - s0) / (k * hosts) * 1e6
    out["fused_computations_per_s"] = out["spmd_nodes_per_s"] * F_COMPUTATIONS

    # -C: the same chain traced, parallel dispatch; then sequential
    for dispatch, field in (("parallel", "traced_nodes_per_s"), ("sequential", "sequential_nodes_per_s")):
        calls, outs = chain(d, zero, devs, k)
        c0 = cpu_s(ctl)
        wall = timed(d, lambda: d.send_program(calls, dispatch), outs[-1], devs[0], total)
        out[field] = k / wall
        if dispatch == "parallel":
            out["ctl_cpu_us_per_traced_node"] = (cpu_s(ctl) - c0) / k * 1e6
        d.release(outs)

    # the longest stall while a big program of single-host nodes is planned
    prober = Prober(cluster.address, cluster.key)
    n_big = big_nodes if not quick else min(big_nodes, 1000)
    per_host: dict[int, int | None] = {}
    calls, lasts = [], {}
    for i in range(n_big):
        h = d.hosts[i % hosts]
        dev = [h.devices[0].id]
        c, x = d.spmd(zero, dev, per_host.get(h.rank))
        per_host[h.rank] = x
        lasts[h.rank] = (x, dev[0])
        calls.append(c)
    inter = [o.buffer for c in calls for o in c.outputs if o.buffer not in {x for x, _ in lasts.values()}]
    t0 = time.perf_counter()
    d.send_program(calls, "parallel", release=inter)
    for x, dev in lasts.values():
        d.wait_for(x, dev, 1)
    out["big_program_nodes"] = n_big
    out["big_program_s"] = time.perf_counter() - t0
    prober.stop()
    out["max_stall_ms"] = max(prober.rtts) * 1e3 if prober.rtts else None
    out["median_ping_ms"] = statistics.median(prober.rtts) * 1e3 if prober.rtts else None
    d.release([x for x, _ in lasts.values()])

    # the smallest computation that keeps every device busy (this client's own
    # history, the big program's calls among it, kept out of its collector's
    # full passes, which took 80-300 ms: a long-running client's gc.freeze(),
    # docs/design.md)
    gc.collect()
    gc.freeze()
    busy: dict[str, float] = {}
    warm: dict[str, float] = {}
    fixed: dict[str, float] = {}
    out["min_busy_computation_ms"] = None
    out["min_busy_warm_computation_ms"] = None
    for cost in LADDER_MS:
        prog = d.program(cost)
        # (at most ~20,000 host messages queued at once)
        n = int(min(200, max(6, 20_000 // hosts), max(6, (0.3 if quick else 1.0) / (cost / 1000))))
        calls, outs = chain(d, prog, devs, n)
        c0 = cpu_s(ctl)
        sent_at = time.time()
        wall = timed(d, lambda: d.send_program(calls), outs[-1], devs[0], total)
        out["ctl_cpu_us_per_busy_node"] = (cpu_s(ctl) - c0) / n * 1e6
        if timelines is not None:
            timelines.append(rung_timeline(d, cost, n, hosts, sent_at, wall))
        d.release(outs)
        busy[str(cost)] = round(n * cost / 1000 / wall, 4)
        fixed[str(cost)] = round((wall - n * cost / 1000) * 1e3, 1)
        # the same run again, its program now known to every host and its
        # plans cached: what a program's first run costs (sending the program
        # to each host, planning its nodes' shapes) is left out
        calls, outs = chain(d, prog, devs, n)
        wall = timed(d, lambda: d.send_program(calls), outs[-1], devs[0], total)
        d.release(outs)
        warm[str(cost)] = round(n * cost / 1000 / wall, 4)
        if warm[str(cost)] >= BUSY and out["min_busy_warm_computation_ms"] is None:
            out["min_busy_warm_computation_ms"] = cost
        if busy[str(cost)] >= BUSY:
            out["min_busy_computation_ms"] = cost
            break
    out["busy"] = busy
    out["busy_warm"] = warm
    out["busy_fixed_ms"] = fixed
    # On this machine the simulated hosts share the cores with the controller;
    # the controller alone (its CPU per node, as if it had its own core) would
    # keep devices 95% busy from this computation time on:
    out["ctl_bound_min_computation_ms"] = out["ctl_cpu_us_per_spmd_node"] / 1000 / BUSY

    # a pipeline of one 1 ms stage per host, parallel against sequential dispatch
    out.update(pipeline(d, min(hosts, 64), repeats))
    if fused_nodes:
        out.update(fused(cluster, d, ctl, sim, fused_nodes, fused_runs))
    d.drain()
    out["relayed_messages"] = d.relayed()
    out["ctl_rss_mib"] = ctl.memory_info().rss / 2**20
    out["sim_rss_mib"] = sim.memory_info().rss / 2**20
    out["seconds"] = time.perf_counter() - started
    return out


def rung_timeline(d: Driver, cost: float, nodes: int, hosts: int, sent_at: float, wall: float) -> dict:
    """A busy rung's first run as the controller saw it (``--timeline``): every
    host's report of its ``nodes`` nodes and the controller's planning slices,
    in ms from when the program was sent, with where the wall time beyond the
    device time went: ``start_ms`` (until the first node began on its last
    host), ``gaps_ms`` (per node after the first: the longest a host's devices
    waited between it and the node before), ``tail_ms`` (from the last node's
    end on its last host until the client had its value). A report names every
    device of its node, so at most TIMELINE_RECORDS reports fit in one answer:
    with more, only the last nodes' are there (``nodes`` says how many; a
    report still on its way when asked is missing too)."""
    tl = d.timeline(min(nodes * hosts, TIMELINE_RECORDS))
    # (this run's: reports of earlier work may still be coming in, and this
    # run's last ones may not have come yet)
    recs = sorted((r for r in tl.records if r.start >= sent_at), key=lambda r: r.exec_id)
    per: dict[int, dict[int, tuple[float, float]]] = {}
    for r in recs:
        per.setdefault(r.exec_id, {})[r.host] = ((r.start - sent_at) * 1e3, (r.end - sent_at) * 1e3)
    execs = sorted(per)
    gaps = [max(per[x][h][0] - per[p][h][1] for h in per[x] if h in per[p])
            for p, x in zip(execs, execs[1:]) if set(per[x]) & set(per[p])]
    first = per[execs[0]] if len(execs) == nodes else {}
    last_end = max(e for _, e in per[execs[-1]].values()) if execs else 0.0
    plans = [(round((e.start - sent_at) * 1e3, 2), round((e.end - e.start) * 1e3, 2)) for e in tl.events
             if e.kind == "plan" and e.end >= sent_at]
    return {"cost_ms": cost, "sent_at": sent_at, "nodes": len(execs), "wall_ms": round(wall * 1e3, 1),
            "fixed_ms": round(wall * 1e3 - nodes * cost, 1),
            "start_ms": round(max(s for s, _ in first.values()), 1) if first else None,
            "first_start_ms": round(min(s for s, _ in first.values()), 1) if first else None,
            "gaps_ms": [round(g, 1) for g in gaps], "tail_ms": round(wall * 1e3 - last_end, 1),
            "plans": plans}


def pipeline(d: Driver, stages: int, repeats: int) -> dict:
    """A pipeline of ``stages`` 1 ms stages, one per host, each reading the
    previous stage's output from the previous host: parallel against
    sequential dispatch. Sequential dispatch pays a controller round trip per
    stage, so its time moves with the machine's load (other processes on the
    two cores delay every round trip); the two modes therefore run in adjacent
    pairs (which mode goes first alternates), after one unmeasured run of
    each, and the figure is the median of the pairs' ratios, with their
    spread."""
    one = d.program(1.0)

    def run(dispatch: str) -> float:
        calls, x = [], None
        for s in range(stages):
            c, x = d.spmd(one, [d.hosts[s].devices[0].id], x)
            calls.append(c)
        first = [o.buffer for c in calls[:-1] for o in c.outputs]
        wall = timed(d, lambda: d.send_program(calls, dispatch, release=first), x,
                     d.hosts[stages - 1].devices[0].id, 1)
        d.release([x])
        return wall

    run("parallel")              # warm-up: plans, templates, the program on every host
    run("sequential")
    walls: dict[str, list[float]] = {"parallel": [], "sequential": []}
    ratios = []
    for i in range(repeats):
        pair = ("parallel", "sequential") if i % 2 == 0 else ("sequential", "parallel")
        got = {mode: run(mode) for mode in pair}
        for mode, wall in got.items():
            walls[mode].append(wall)
        ratios.append(got["sequential"] / got["parallel"])
    par, seq = (statistics.median(walls[mode]) for mode in ("parallel", "sequential"))
    return {"pipeline_stages": stages,
            "pipeline_runs_per_s": {"parallel": 1 / par, "sequential": 1 / seq},
            "pipeline_ideal_runs_per_s": 1 / (stages * 1e-3),
            "pipeline_parallel_over_sequential": statistics.median(ratios),
            "pipeline_ratio_range": [min(ratios), max(ratios)],
            "pipeline_ms": {mode: [round(w * 1e3, 2) for w in ws] for mode, ws in walls.items()}}


def fused(cluster: SimulatedCluster, d: Driver, ctl: psutil.Process, sim: psutil.Process,
          nodes: int, runs: int) -> dict:
    """A template of ``nodes`` SPMD nodes over every device (a chain, the first
    reading nothing): its first run (plain calls, fused at its end), its first
    fused run (the definition to every host), then ``runs`` fused runs; a
    second client pings the controller all along (see the module's docstring)."""
    devs, zero = d.devices, d.program(0.0)
    total = len(devs)
    template = next(d._calls)

    def block() -> int:           # the first of ``nodes`` new buffer ids in a row
        first = d.buffer()
        for _ in range(nodes - 1):
            d.buffer()
        return first

    def timed_all(send: Any, last: int) -> float:
        # (until the first and the last host hold their shard of the result: the
        # simulated hosts run in one process, the last one after the others)
        t0 = time.perf_counter()
        send()
        d.wait_for(last, devs[0], total)
        d.wait_for(last, devs[-1], total)
        return time.perf_counter() - t0

    first = block()
    aval = m.Aval([total], "float32")
    calls = [m.Call(next(d._calls), zero, [total], ["x"], devs,
                    [] if k == 0 else [m.CallInput(first + k - 1, aval, ["x"], False)],
                    [m.CallOutput(first + k, aval, ["x"])]) for k in range(nodes)]
    program = m.Program(next(d._calls), "scale_fused", "parallel", calls, [first + k for k in range(nodes - 1)])
    def run() -> tuple[float, float, float]:
        """One fused run: (wall, controller CPU, simulated hosts' CPU) seconds."""
        first = block()
        c0, s0 = cpu_s(ctl), cpu_s(sim)
        wall = timed_all(lambda: d.ep.send(d.sock, m.RunProgram(
            next(d._calls), template, [], first, [first + nodes - 1])), first + nodes - 1)
        c1, s1 = cpu_s(ctl), cpu_s(sim)
        d.release([first + nodes - 1])
        return wall, c1 - c0, s1 - s0

    # with a second client's pings (for the stall): the first run, the one that
    # defines it, and ``runs`` more; then ``runs`` without them (CPU and times)
    prober = Prober(cluster.address, cluster.key)
    try:
        first_run = timed_all(lambda: d.ep.send(d.sock, m.DefineProgram(template, [], first, nodes, program)),
                              first + nodes - 1)
        d.release([first + nodes - 1])
        define = run()
        for _ in range(runs):
            run()
    finally:
        prober.stop()
    quiet = [run() for _ in range(runs)]
    # the runs as the controller's timeline has them: one fused computation each
    d.ep.send(d.sock, m.TimelineRequest(runs + 1))
    timeline = d._wait(lambda msg: isinstance(msg, m.Timeline), 30.0)
    d.ep.send(d.sock, m.DropTemplates([template]))
    d.drain()
    return {"fused_nodes": nodes, "fused_timeline_names": sorted({r.name for r in timeline.records}),
            "fused_first_run_ms": first_run * 1e3, "fused_define_run_ms": define[0] * 1e3,
            "fused_sim_cpu_ms_define": define[2] * 1e3,
            "fused_run_ms": statistics.median(w for w, _, _ in quiet) * 1e3 if runs else None,
            "fused_runs_ms": [round(w * 1e3, 2) for w, _, _ in quiet],
            "fused_ctl_cpu_us_per_node": sum(c for _, c, _ in quiet) / (runs * nodes) * 1e6 if runs else None,
            "fused_sim_cpu_ms_per_run": sum(s for _, _, s in quiet) / runs * 1e3 if runs else None,
            "fused_max_stall_ms": max(prober.rtts) * 1e3 if prober.rtts else None}


def plot(results: list[dict], path: str) -> None:
    if plots is None:
        print("matplotlib is not installed (pip install 'zpath[bench]'): no figure drawn", file=sys.stderr)
        return
    plots.scale(path, results, F_COMPUTATIONS, BUSY)
    print(f"wrote {path}", file=sys.stderr)


def print_json(r: dict, path: str) -> None:
    """``--json [PATH]``: print ``r`` as one line of JSON (and write it to PATH, if one)."""
    print(json.dumps(r), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(r, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=list(HOSTS), help="sizes to measure")
    p.add_argument("--devices", type=int, default=4, help="devices per simulated host")
    p.add_argument("--big-nodes", type=int, default=10_000, help="nodes of the big program")
    p.add_argument("--repeats", type=int, default=7, help="pipeline pairs (one run of each dispatch mode)")
    p.add_argument("--quick", action="store_true", help="fewer nodes per measurement")
    p.add_argument("--json", nargs="?", const="", metavar="PATH",
                   help="one JSON object per size; with PATH, the last one also into PATH (benchmarks/ab.py)")
    p.add_argument("--png", metavar="PATH", help="draw the figures into PATH (needs matplotlib)")
    p.add_argument("--relay-min-hosts", type=int, help="ZPATH_RELAY_MIN_HOSTS of the controller "
                   "(messages for this many hosts go through relays; 0: none; default: the controller's)")
    p.add_argument("--relay-group", type=int, help="ZPATH_RELAY_GROUP: hosts per relay (default: the controller's)")
    p.add_argument("--fused-nodes", type=int, default=32, help="nodes of the fused template (0: none)")
    p.add_argument("--fused-runs", type=int, default=5, help="fused runs measured after the one that defines it")
    p.add_argument("--fused-only", action="store_true", help="measure the fused template alone")
    p.add_argument("--timeline", metavar="PATH", help="write each busy rung's first run as the controller "
                   "saw it (host reports, planning slices; where its time beyond device time went) to PATH, "
                   "as JSON")
    p.add_argument("--probe", nargs=2, metavar=("ADDRESS", "PERIOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        probe(args.probe[0], float(args.probe[1]))
        return 0
    results = []
    for n in args.hosts:
        timelines: list[dict] | None = [] if args.timeline else None
        r = measure(n, args.devices, args.quick, args.big_nodes, args.repeats, args.relay_min_hosts,
                    args.relay_group, args.fused_nodes, args.fused_runs, args.fused_only, timelines)
        results.append(r)
        if args.timeline:
            with open(args.timeline, "w") as f:
                json.dump({"hosts": n, "rungs": timelines}, f)
        if args.json is not None:
            print_json(r, args.json)
        elif not args.fused_only:
            print(f"hosts {n:4d}: {r['spmd_nodes_per_s']:8.1f} SPMD nodes/s op by op, "
                  f"{r['traced_nodes_per_s']:8.1f} traced, {r['sequential_nodes_per_s']:8.1f} sequential; "
                  f"controller {r['ctl_cpu_us_per_spmd_node']:9.1f} us CPU per node, "
                  f"{r['ctl_cpu_us_per_host_msg']:6.1f} per host message; "
                  f"stall max {r['max_stall_ms']:7.1f} ms ({r['big_program_nodes']} nodes in "
                  f"{r['big_program_s']:.2f} s); RSS {r['ctl_rss_mib']:.0f} MiB; "
                  f"busy at >= {r['min_busy_computation_ms']} ms (run again: "
                  f"{r['min_busy_warm_computation_ms']} ms); pipeline of {r['pipeline_stages']} "
                  f"parallel/sequential {r['pipeline_parallel_over_sequential']:.2f} "
                  f"({r['pipeline_ratio_range'][0]:.2f}-{r['pipeline_ratio_range'][1]:.2f})", flush=True)
        if args.json is None and args.fused_nodes and args.fused_runs:
            print(f"hosts {n:4d}: a fused template of {r['fused_nodes']} nodes: first run "
                  f"{r['fused_first_run_ms']:.0f} ms, first fused run {r['fused_define_run_ms']:.0f} ms "
                  f"(hosts' CPU {r['fused_sim_cpu_ms_define']:.0f} ms), fused runs {r['fused_run_ms']:.1f} ms; "
                  f"controller {r['fused_ctl_cpu_us_per_node']:.0f} us CPU per node; stall max "
                  f"{r['fused_max_stall_ms']:.1f} ms", flush=True)
    if args.png and not args.fused_only:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
