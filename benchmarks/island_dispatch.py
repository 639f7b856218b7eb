"""Island dispatch: zpath vs. JAX multi-controller, after the Pathways paper's
comparison (Barham et al., 2022, section 5.1), on a 2-host island of this machine.

Workload: a scalar all-reduce followed by a scalar add, ``psum(x) + 1.`` on a
float64 scalar per device, over 2 processes x 1 device each.

* zpath: ``zp.init(islands=1, hosts_per_island=2, devices_per_host=1)`` -- a
  controller and two worker processes that join one jax.distributed runtime
  (gloo CPU collectives) -- and this process as the client.
* JAX multi-controller: two Python processes started by this script, each with
  one CPU device, joined by ``jax.distributed.initialize`` (gloo), each running
  its own Python loop of the same jitted SPMD computation
  (``jax.jit(jax.shard_map(...))`` over a global mesh of the 2 devices). The
  time of a run is the slower of the two processes.

Variants (the paper's -O and -F):

* -O  one computation per call: ``x = f(x)`` chained ``--calls-o`` times, then
      the final value is fetched (inside the timing) and checked;
* -F  one call runs 128 such computations in a ``fori_loop`` (the psum's
      result is cast back to device-varying with ``jax.lax.pcast(..., to="varying")``,
      a no-op at run time, so the loop carry keeps its type); chained
      ``--calls-f`` times, then fetched and checked. Computations/s = 128 * calls / time.

Each variant is warmed up once, then timed ``--repeats`` times, zpath and
multi-controller runs alternating (both stay up; the idle side uses no CPU to
speak of), so both see the same machine load; the table shows
the median computations per second and the ratio zpath / multi-controller.
It also prints where a zpath -O call's time goes (CPU time per call of the
client, controller and workers, and the workers' execution times). This is a
benchmark that prints figures, not a test.

With ``--mc-load`` it then estimates how much of the gap comes from sharing
the machine's cores with zpath's control plane: it runs zpath, MC, and MC beside
a load process, in rotating order, ``--repeats`` times each. The load keeps a
core busy for the same share of the time as zpath's controller and workers' I/O
threads did in the timed zpath runs, in bursts of one zpath call's worth of
that CPU (at least 100 us). MC with that load over MC alone is what that much
CPU use, in bursts of that size, costs a multi-controller run; the cost depends
on the burst size as well as the share, so it is a model of the control plane,
not a replay of it. The table also shows the share the load really took.

    python benchmarks/island_dispatch.py [--calls-o 500] [--calls-f 20] [--repeats 5] [--mc-load] [--threads] [--json out.json]

``--threads`` also prints, for -F, each process's CPU and context switches per
thread and computation (read from Linux /proc before and after each timed run,
grouped by thread name): which threads of a worker spend what a
multi-controller process does not.

``--png PATH`` also draws computations per second of both per variant, with
zpath/MC and its interval (matplotlib, benchmarks/plots.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402  (benchmarks/ab.py: the machine)
import plots  # noqa: E402  (benchmarks/plots.py)

LOOP = 128           # computations per -F call, as in the paper


def expected(x0: float, steps: int) -> float:
    """The value after ``steps`` of ``x = psum(x) + 1`` over 2 devices that all
    start at ``x0``, in float64 exactly as the devices compute it."""
    x = np.float64(x0)
    with np.errstate(over="ignore"):
        for _ in range(steps):
            x = (x + x) + np.float64(1.0)
    return float(x)


def _check(what: str, got: Any, want: float) -> None:
    got = np.asarray(got, dtype=np.float64).ravel()
    if got.shape != (2,) or not np.all(got == want):
        raise AssertionError(f"{what}: expected [{want!r}, {want!r}], got {got!r}")


def ratio_ci(mine: list[float], theirs: list[float], draws: int = 4000,
             seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the throughput ratio median(theirs) / median(mine)
    (run times; a ratio above 1 means ``mine`` is faster). Runs ``k`` of the two
    lists were measured next to each other, so pairs are resampled together: the
    interval shows how far the ratio moves with which runs the machine's noise
    happened to hit. With a handful of runs it is rough."""
    n = min(len(mine), len(theirs))
    if n < 2:
        r = statistics.median(theirs) / statistics.median(mine)
        return r, r
    rng = np.random.default_rng(seed)
    a, b = np.asarray(mine[:n]), np.asarray(theirs[:n])
    idx = rng.integers(0, n, size=(draws, n))
    ratios = np.median(b[idx], axis=1) / np.median(a[idx], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def _summary(times: list[float], comps_per_run: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {"times_s": times, "median_s": med, "min_s": min(times), "max_s": max(times),
            "computations": comps_per_run, "comps_per_s": comps_per_run / med,
            "us_per_comp": med / comps_per_run * 1e6}


# The -O chain starts from 0: x_k = 2^k - 1 (rounded), exact and finite for k < 1024,
# so the final value checks the number of computations. A -F chain of 128*calls
# steps from 0 would overflow, so it starts from the fixed point -1 (psum(-1) + 1 = -1)
# and the number of iterations per call is checked separately after the warm-up:
# one call from 0 gives 2^128, two give 2^256.
X0_O, X0_F = 0.0, -1.0


# ---- zpath ------------------------------------------------------------------
def _cpu(procs: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        t = p.cpu_times()
        out[name] = t.user + t.system
    return out


def control_cpu(procs: dict[str, Any]) -> float:
    """CPU seconds of the controller and of the workers' I/O threads (what MC
    has no counterpart of), from the processes named as zpath's launcher names them."""
    total = 0.0
    for name, p in procs.items():
        if name == "controller":
            t = p.cpu_times()
            total += t.user + t.system
        elif name.startswith("worker"):
            for th in p.threads():
                if th.id == p.pid:       # the main thread runs the I/O loop
                    total += th.user_time + th.system_time
    return total


def thread_stats(pid: int) -> dict[int, tuple[str, float, int, int]]:
    """Every thread of process ``pid`` (Linux /proc): tid -> (name, CPU seconds
    (schedstat's time on a CPU, in ns), voluntary and involuntary context switches so far). The
    main thread is named "main"; empty where /proc is missing."""
    out: dict[int, tuple[str, float, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{t}/status") as f:
                status = f.read()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                on_cpu_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):          # the thread ended
            continue
        name = "main" if int(t) == pid else stat[stat.index("(") + 1:stat.rindex(")")]
        cpu = on_cpu_ns / 1e9
        sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                       if ln.endswith(tuple("0123456789")) and "ctxt_switches" in ln)}
        out[int(t)] = (name, cpu, sw.get("voluntary_ctxt_switches", 0),
                       sw.get("nonvoluntary_ctxt_switches", 0))
    return out


class ThreadMeter:
    """Per-thread CPU and wake-ups of some processes, summed over the intervals
    between ``start`` and ``stop``; reported grouped by thread name (threads of
    one name, e.g. a thread pool's, are added up), the busiest thread of a group
    of several shown on its own (marked "*": in these processes, gloo's network
    thread, which has no name of its own, is the busiest of the "python" ones)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.total: dict[str, dict[int, list[Any]]] = {k: {} for k in pids}   # tid -> [name, cpu, vol, inv]
        self._t0: dict[str, dict[int, tuple[str, float, int, int]]] = {}

    def start(self) -> None:
        # this process's threads read last at the start and first at the stop:
        # reading the others' /proc is not counted as its own work
        mine = os.getpid()
        self._t0 = {k: thread_stats(self.pids[k]) for k in sorted(self.pids, key=lambda k: self.pids[k] == mine)}

    def stop(self) -> None:
        mine = os.getpid()
        for k in sorted(self.pids, key=lambda k: self.pids[k] != mine):
            pid = self.pids[k]
            before = self._t0.get(k, {})
            for tid, (name, cpu, vol, inv) in thread_stats(pid).items():
                _, c0, v0, i0 = before.get(tid, (name, 0.0, 0, 0))
                acc = self.total[k].setdefault(tid, [name, 0.0, 0, 0])
                acc[1] += cpu - c0
                acc[2] += vol - v0
                acc[3] += inv - i0

    def per_comp(self, comps: int) -> dict[str, list[dict[str, Any]]]:
        """Per process, its thread groups by CPU: threads, CPU us, voluntary and
        involuntary context switches, each per computation."""
        out: dict[str, list[dict[str, Any]]] = {}
        for k, tids in self.total.items():
            groups: dict[str, list[list[Any]]] = {}
            for acc in tids.values():
                groups.setdefault(acc[0], []).append(acc)
            rows = []
            for name, accs in groups.items():
                accs.sort(key=lambda a: -a[1])
                parts = [(name + "*", accs[:1]), (name, accs[1:])] if len(accs) > 1 else [(name, accs)]
                for label, members in parts:
                    rows.append({"name": label, "threads": len(members),
                                 "cpu_us": sum(a[1] for a in members) / comps * 1e6,
                                 "voluntary": sum(a[2] for a in members) / comps,
                                 "involuntary": sum(a[3] for a in members) / comps})
            out[k] = sorted(rows, key=lambda r: -r["cpu_us"])
        return out


SLOW_X = 4      # a computation this many times its run's median is counted as held up


def _timeline_stats(cluster: Any, name: str, calls: int) -> dict[str, Any]:
    """Per worker, over the last run (input assembly + XLA run incl. the gloo
    all-reduce): the median and 90th percentile execution time, the median
    start-to-start interval and idle time between, and the computations that
    took over SLOW_X times the median: how many, and their share of the
    run's span (medians alone hide a few long ones)."""
    from zpath.net import messages as m

    recs = cluster.client.request(m.TimelineRequest(2 * calls)).records
    out: dict[str, Any] = {}
    for host in sorted({r.host for r in recs}):
        mine = sorted((r for r in recs if r.host == host and r.name == name), key=lambda r: r.start)
        if len(mine) < 3:
            continue
        exec_us = [(r.end - r.start) * 1e6 for r in mine]
        gap_us = [(b.start - a.start) * 1e6 for a, b in zip(mine, mine[1:])]
        idle_us = [(b.start - a.end) * 1e6 for a, b in zip(mine, mine[1:])]
        med = statistics.median(exec_us)
        slow = [e for e in exec_us if e > SLOW_X * med] if med > 0 else []
        span_us = (mine[-1].end - mine[0].start) * 1e6
        out[f"host{host}"] = {"records": len(mine), "exec_us_median": med,
                              # (inclusive: within the times measured, also for a few records)
                              "exec_us_p90": statistics.quantiles(exec_us, n=10, method="inclusive")[-1],
                              "start_to_start_us_median": statistics.median(gap_us),
                              "idle_between_us_median": statistics.median(idle_us),
                              "slow": len(slow), "slow_share": sum(slow) / span_us if span_us > 0 else 0.0}
    return out


class ZpathBench:
    """A local zpath cluster (1 island x 2 hosts x 1 device) and the two
    computations placed on its 2 devices, warmed up and checked."""

    def __init__(self, warm_o: int, warm_f: int) -> None:
        import jax
        import psutil

        import zpath as zp

        jax.config.update("jax_enable_x64", True)     # float64 values, as described (zpath traces with the caller's setting)
        self.zp = zp
        self.cluster = zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
        try:
            devs = zp.make_virtual_device_set().add_slice(devices=2).devices
            if len(devs) != 2 or {d.host for d in devs} != {0, 1}:
                raise AssertionError(f"expected one device on each of 2 hosts, got {devs}")

            def allreduce_add(x):
                return jax.lax.psum(x, "i") + 1.

            def allreduce_add_x128(x):
                def body(i, y):
                    return jax.lax.pcast(jax.lax.psum(y, "i") + 1., "i", to="varying")
                return jax.lax.fori_loop(0, LOOP, body, x)

            self.fns = {"O": zp.pmap(allreduce_add, axis_name="i", devices=devs),
                        "F": zp.pmap(allreduce_add_x128, axis_name="i", devices=devs)}
            self.procs = {"client": psutil.Process()}
            for name, p in self.cluster.local.procs:
                self.procs[name] = psutil.Process(p.pid)
            self.cpu = {v: dict.fromkeys(self.procs, 0.0) for v in ("O", "F")}
            # what MC has no counterpart of: the controller and the workers' I/O
            # threads (a worker's main thread); CPU seconds and wall seconds per variant
            self.control = {v: [0.0, 0.0] for v in ("O", "F")}
            self.run("O", warm_o, timed=False)
            self.run("F", warm_f, timed=False)
            for k in (1, 2):     # 128 iterations per call, checked from 0
                got = self._chain(self.fns["F"], 0.0, k)
                _check(f"zpath -F from 0 ({k} calls)", got, expected(0.0, LOOP * k))
        except BaseException:
            zp.shutdown()
            raise

    @staticmethod
    def _chain(fn: Callable, x0: float, n: int) -> np.ndarray:
        x = np.full(2, x0)
        for _ in range(n):
            x = fn(x)
        return x.result(timeout=600)

    def run(self, v: str, n: int, timed: bool = True) -> float:
        """One run of ``n`` chained calls of variant ``v``; its wall time."""
        x0, per = (X0_O, 1) if v == "O" else (X0_F, LOOP)
        c0, k0 = _cpu(self.procs), control_cpu(self.procs)
        t0 = time.perf_counter()
        got = self._chain(self.fns[v], x0, n)
        t = time.perf_counter() - t0
        c1, k1 = _cpu(self.procs), control_cpu(self.procs)
        _check(f"zpath -{v} ({n} calls)", got, expected(x0, per * n))
        if timed:
            for k in c0:
                self.cpu[v][k] += c1[k] - c0[k]
            self.control[v][0] += k1 - k0
            self.control[v][1] += t
        return t

    def timeline(self, v: str, calls: int) -> dict[str, Any]:
        return _timeline_stats(self.cluster, "allreduce_add" if v == "O" else "allreduce_add_x128", calls)

    def close(self) -> None:
        self.zp.shutdown()


# ---- JAX multi-controller ---------------------------------------------------------
MC_CHILD = r"""
import json, sys, time
idx, port = int(sys.argv[1]), int(sys.argv[2])
calls_o, calls_f, warm_o, warm_f = (int(a) for a in sys.argv[3:7])
sync_each, LOOP, X0_O, X0_F = sys.argv[7] == "each", int(sys.argv[8]), float(sys.argv[9]), float(sys.argv[10])
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=idx,
                           initialization_timeout=60)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

devs = jax.devices()
local = jax.local_devices()
assert len(devs) == 2 and len(local) == 1, (devs, local)
mesh = Mesh(np.array(devs), ("i",))
sh = NamedSharding(mesh, P("i"))

def allreduce_add(x):
    return jax.lax.psum(x, "i") + 1.

def allreduce_add_x128(x):
    def body(i, y):
        return jax.lax.pcast(jax.lax.psum(y, "i") + 1., "i", to="varying")
    return jax.lax.fori_loop(0, LOOP, body, x)

f_o = jax.jit(jax.shard_map(allreduce_add, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
f_f = jax.jit(jax.shard_map(allreduce_add_x128, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

def make(v):
    return jax.make_array_from_single_device_arrays((2,), sh, [jax.device_put(np.full((1,), v), local[0])])

def fetch(x):
    return float(np.asarray(x.addressable_shards[0].data)[0])

def expected(x0, steps):
    x = np.float64(x0)
    with np.errstate(over="ignore"):
        for _ in range(steps):
            x = (x + x) + np.float64(1.0)
    return float(x)

def chain(fn, x0, n):
    x = make(x0)
    for _ in range(n):
        x = fn(x)
        if sync_each:
            x.block_until_ready()
    return fetch(x)

def check(what, got, want):
    if got != want:
        raise AssertionError(f"process {idx} {what}: expected {want!r}, got {got!r}")

def barrier():          # one blocking collective: both processes leave it together
    fetch(f_o(make(0.)))

check("-O warm-up", chain(f_o, X0_O, warm_o), expected(X0_O, warm_o))
check("-F warm-up", chain(f_f, X0_F, warm_f), expected(X0_F, LOOP * warm_f))
for k in (1, 2):
    check(f"-F from 0 ({k} calls)", chain(f_f, 0.0, k), expected(0.0, LOOP * k))
print("READY", flush=True)
for line in sys.stdin:          # one timed run per command: "O" or "F"; "Q" quits
    v = line.strip()
    if v == "Q":
        break
    fn, x0, n, per = (f_o, X0_O, calls_o, 1) if v == "O" else (f_f, X0_F, calls_f, LOOP)
    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    got = chain(fn, x0, n)
    t1, c1 = time.perf_counter(), time.process_time()
    check(f"-{v} ({n} calls)", got, expected(x0, per * n))
    print("RESULT " + json.dumps({"t": t1 - t0, "cpu": c1 - c0}), flush=True)
jax.distributed.shutdown()
"""


def _stop(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    from zpath.cluster.launcher import stop_processes
    stop_processes(procs, grace)


class McBench:
    """Two JAX processes (one CPU device each) joined by jax.distributed; each
    runs its own Python loop. They wait on stdin between timed runs, so runs
    can alternate with zpath's."""

    def __init__(self, calls_o: int, calls_f: int, warm_o: int, warm_f: int, sync: str,
                 timeout: float) -> None:
        import queue
        import threading

        from zpath.cluster.launcher import free_port

        self.sync, self.timeout = sync, timeout
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
        port = free_port("127.0.0.1")
        self.logs = [tempfile.TemporaryFile() for _ in range(2)]
        self.procs: list[subprocess.Popen] = []
        self.lines: list[Any] = []
        try:
            for i in range(2):
                p = subprocess.Popen(
                    [sys.executable, "-c", MC_CHILD, str(i), str(port), str(calls_o), str(calls_f),
                     str(warm_o), str(warm_f), sync, str(LOOP), repr(X0_O), repr(X0_F)],
                    stdout=subprocess.PIPE, stderr=self.logs[i], stdin=subprocess.PIPE, env=env,
                    text=True, bufsize=1)
                self.procs.append(p)
                q: Any = queue.Queue()
                threading.Thread(target=self._reader, args=(p, q), daemon=True).start()
                self.lines.append(q)
            self._expect("READY")
        except BaseException:
            self.close()
            raise
        self.cpu = {"O": [0.0, 0.0], "F": [0.0, 0.0]}

    @staticmethod
    def _reader(p: subprocess.Popen, q: Any) -> None:
        for line in p.stdout:
            q.put(line)
        q.put(None)

    def _expect(self, prefix: str) -> list[str]:
        import queue

        deadline = time.monotonic() + self.timeout
        out = []
        for i, q in enumerate(self.lines):
            while True:
                try:
                    line = q.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"multi-controller process {i} gave no {prefix} within "
                                       f"{self.timeout:.0f}s (sync={self.sync})") from None
                if line is None:
                    self.procs[i].wait(10)
                    self.logs[i].seek(0)
                    err = self.logs[i].read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"multi-controller process {i} exited "
                                       f"(rc={self.procs[i].returncode}):\n{err}")
                if line.startswith(prefix):
                    out.append(line[len(prefix):].strip())
                    break
        return out

    def run(self, v: str) -> float:
        """One timed run of variant ``v`` in both processes; the slower one's time."""
        for p in self.procs:
            p.stdin.write(v + "\n")
            p.stdin.flush()
        reports = [json.loads(r) for r in self._expect("RESULT ")]
        for i, r in enumerate(reports):
            self.cpu[v][i] += r["cpu"]
        return max(r["t"] for r in reports)

    def close(self) -> None:
        for p in self.procs:
            try:
                if p.poll() is None:
                    p.stdin.write("Q\n")
                    p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _stop(self.procs)
        for f in self.logs:
            f.close()
        self.procs = []


BURNER = r"""
import os, select, sys, time
burst, period = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6
print("READY", flush=True)
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < burst:
        pass
    # sleep until the next burst; stdin closing (the benchmark stopped or died) ends it
    if select.select([sys.stdin], [], [], max(0.0, period - (time.perf_counter() - t0)))[0]:
        if not os.read(sys.stdin.fileno(), 1):
            break
"""
MIN_BURST_US = 100.0      # smaller bursts would cost more in wake-ups than they burn


class Burner:
    """A process that keeps one core busy ``burst_us`` out of every
    ``period_us``: a stand-in for a control plane's CPU use. It exits when its
    stdin closes, so it cannot outlive the benchmark."""

    def __init__(self, burst_us: float, period_us: float) -> None:
        import psutil

        self.proc = subprocess.Popen([sys.executable, "-c", BURNER, f"{burst_us:.1f}", f"{period_us:.1f}"],
                                     stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        try:
            if self.proc.stdout.readline().strip() != "READY":
                raise RuntimeError("the load process did not start")
            self.ps = psutil.Process(self.proc.pid)
        except BaseException:
            self.close()
            raise

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        _stop([self.proc])


def mc_with_load(mc: McBench, v: str, control: tuple[float, float], calls: int, repeats: int,
                 comps: int, zpath_run: Callable[[], float]) -> dict[str, Any]:
    """zpath, MC and MC beside a load process, ``repeats`` times each, in
    rotating order (so all three see the same machine). The load uses as much
    CPU as zpath's control plane did: ``control`` is its (CPU seconds, wall
    seconds) over earlier timed zpath runs, which made ``calls`` calls in all;
    it comes in bursts of one call's worth. Also returns the share of a core
    the load really took (it spins on the clock, so contention can leave it
    less)."""
    cpu_s, wall_s = control
    share = cpu_s / wall_s                                    # of one core
    burst_us = max(MIN_BURST_US, cpu_s / calls * 1e6)
    period_us = burst_us / share if share > 0 else float("inf")
    times: dict[str, list[float]] = {"zpath": [], "plain": [], "loaded": []}
    burned = loaded_wall = 0.0
    order = ["zpath", "plain", "loaded"]
    for r in range(repeats):
        for arm in order[r % 3:] + order[:r % 3]:
            if arm == "zpath":
                times[arm].append(zpath_run())
            elif arm == "plain":
                times[arm].append(mc.run(v))
            else:
                b = Burner(burst_us, period_us)
                try:
                    c0 = b.cpu()
                    t = mc.run(v)
                    burned += b.cpu() - c0
                    loaded_wall += t
                    times[arm].append(t)
                finally:
                    b.close()
    out: dict[str, Any] = {"core_share": share, "burst_us": burst_us, "period_us": period_us,
                           "achieved_share": burned / loaded_wall if loaded_wall else 0.0}
    for arm, ts in times.items():
        out[arm] = _summary(ts, comps)
    return out


def measure_load(z: ZpathBench, mc: McBench, calls: dict[str, int], repeats: int) -> dict[str, Any]:
    """``mc_with_load`` for -O and -F, with the control plane's CPU use in the
    timed zpath runs."""
    return {v: mc_with_load(mc, v, tuple(z.control[v]), calls[v] * repeats, repeats,
                            calls[v] * (LOOP if v == "F" else 1),
                            lambda v=v: z.run(v, calls[v], timed=False))
            for v in ("O", "F")}


def load_line(label: str, r: dict[str, Any]) -> str:
    z, a, b = r["zpath"]["comps_per_s"], r["plain"]["comps_per_s"], r["loaded"]["comps_per_s"]
    what = f"{r['core_share'] * 100:.1f}% ({r['achieved_share'] * 100:.1f}%)"
    return (f"{label:<8} {what:>16} {r['burst_us']:>9,.0f} {a:>10,.0f} {b:>10,.0f} {b / a:>11.3f} "
            f"{z / a:>9.3f}")


LOAD_HEAD = (f"{'variant':<8} {'load (achieved)':>16} {'burst us':>9} {'MC comp/s':>10} {'MC+load':>10} "
             f"{'MC+load/MC':>11} {'zpath/MC':>9}")
LOAD_TITLE = ("zpath, MC, and MC beside a load process as busy as zpath's control plane (controller "
              "+ workers' I/O threads;\nshare of one core, and the share the load really took), runs "
              "in rotating order; both ratios against this plain MC.\nThe load comes in bursts of "
              "one zpath call's worth of that CPU; how much it costs MC depends on the burst size too:")


def _load_table(load: dict[str, Any]) -> str:
    lines = [LOAD_HEAD, "-" * len(LOAD_HEAD)]
    for v in ("O", "F"):
        lines.append(load_line("-" + v, load[v]))
    return "\n".join(lines)


def _metered(meter: ThreadMeter | None, run: Callable[[], float]) -> float:
    if meter is None:
        return run()
    meter.start()
    try:
        return run()
    finally:
        meter.stop()


def measure(z: ZpathBench, mc: McBench, calls: dict[str, int], repeats: int,
            threads: bool = False) -> tuple[dict, dict]:
    """Alternate zpath and multi-controller runs (which goes first alternates
    too), so both see the same machine; return their summaries. With
    ``threads``, also each process's CPU and context switches per thread (name)
    and computation in the runs of each variant."""
    zres: dict[str, Any] = {}
    mres: dict[str, Any] = {"sync": mc.sync}
    for v in ("O", "F"):
        zt, mt = [], []
        zm = mm = None
        if threads:
            zm = ThreadMeter({k: p.pid for k, p in z.procs.items()})
            mm = ThreadMeter({f"process{i}": p.pid for i, p in enumerate(mc.procs)})
        for r in range(repeats):
            if r % 2 == 0:
                zt.append(_metered(zm, lambda: z.run(v, calls[v])))
                mt.append(_metered(mm, lambda: mc.run(v)))
            else:
                mt.append(_metered(mm, lambda: mc.run(v)))
                zt.append(_metered(zm, lambda: z.run(v, calls[v])))
        comps = calls[v] * (LOOP if v == "F" else 1)       # per run
        if zm is not None and mm is not None:
            zres[v + "_threads"] = zm.per_comp(comps * repeats)
            mres[v + "_threads"] = mm.per_comp(comps * repeats)
        zres[v] = _summary(zt, comps)
        zres[v]["cpu_us_per_comp"] = {k: t / (comps * repeats) * 1e6 for k, t in z.cpu[v].items()}
        zres[v]["timeline"] = z.timeline(v, calls[v])
        zres[v]["ratio_ci"] = ratio_ci(zt, mt)
        mres[v] = _summary(mt, comps)
        mres[v]["cpu_us_per_comp"] = {f"process{i}": t / (comps * repeats) * 1e6
                                      for i, t in enumerate(mc.cpu[v])}
    return zres, mres


# ---- report -------------------------------------------------------------------
def _table(z: dict[str, Any], mc: dict[str, Any]) -> str:
    head = (f"{'variant':<8} {'zpath comp/s':>13} {'zpath us/comp':>14} "
            f"{'MC comp/s':>11} {'MC us/comp':>11} {'zpath/MC':>9} {'95% interval':>13}")
    lines = [head, "-" * len(head)]
    for v in ("O", "F"):
        a, b = z[v], mc[v]
        lo, hi = z[v]["ratio_ci"]
        lines.append(f"{'-' + v:<8} {a['comps_per_s']:>13,.0f} {a['us_per_comp']:>14,.1f} "
                     f"{b['comps_per_s']:>11,.0f} {b['us_per_comp']:>11,.1f} "
                     f"{a['comps_per_s'] / b['comps_per_s']:>9.3f} {lo:>6.3f}-{hi:.3f}")
    return "\n".join(lines)


def cpu_line(label: str, result: dict[str, Any]) -> str:
    """One line of the CPU breakdown: per-process CPU per computation, and wall."""
    cpu = result["cpu_us_per_comp"]
    return (f"  {label} CPU us/comp: " + ", ".join(f"{k} {t:,.1f}" for k, t in cpu.items())
            + f"; total {sum(cpu.values()):,.1f} (wall {result['us_per_comp']:,.1f})")


def timeline_line(label: str, host: str, t: dict[str, Any], unit: str, of: str = "") -> str:
    """One line of a worker's timeline figures (``_timeline_stats``; ``unit``:
    what one record is)."""
    return (f"  {label} worker {host}: execute {t['exec_us_median']:,.1f} us/{unit} "
            f"(90th percentile {t['exec_us_p90']:,.1f}), "
            f"start-to-start {t['start_to_start_us_median']:,.1f} us/{unit}, idle between "
            f"{t['idle_between_us_median']:,.1f} us (median over {t['records']} {unit}s{of}); "
            f"{t['slow']} over {SLOW_X}x the median, {t['slow_share']:.0%} of the run's span")


def _breakdown(z: dict[str, Any], mc: dict[str, Any]) -> str:
    out = []
    for v in ("O", "F"):
        out.append(cpu_line(f"-{v} zpath", z[v]))
        out.append(cpu_line(f"-{v} MC   ", mc[v]))
        for host, t in z[v]["timeline"].items():
            out.append(timeline_line(f"-{v} zpath", host, t, "call",
                                     f" of {LOOP} computations" if v == "F" else ""))
    return "\n".join(out)


def threads_table(z: dict[str, Any], mc: dict[str, Any], min_us: float = 0.5, v: str = "F") -> str:
    """The per-thread table of variant ``v``: per process, each thread name's CPU (us) and
    context switches (voluntary = the thread slept and was woken; involuntary =
    preempted) per computation; groups under ``min_us`` and without a switch are
    summed into "rest". The MC figures include the one-computation barrier
    before each run."""
    out = [f"  {'process':<12} {'thread':<22} {'n':>3} {'CPU us/comp':>12} {'vol/comp':>9} {'invol/comp':>11}"]
    for side in (z.get(v + "_threads", {}), mc.get(v + "_threads", {})):
        for proc, rows in side.items():
            rest = [0, 0.0, 0.0, 0.0]
            for r in rows:
                if r["cpu_us"] < min_us and r["voluntary"] < 0.05:
                    rest = [rest[0] + r["threads"], rest[1] + r["cpu_us"], rest[2] + r["voluntary"],
                            rest[3] + r["involuntary"]]
                    continue
                out.append(f"  {proc:<12} {r['name']:<22} {r['threads']:>3} {r['cpu_us']:>12,.1f} "
                           f"{r['voluntary']:>9.3f} {r['involuntary']:>11.3f}")
            total = sum(r["cpu_us"] for r in rows)
            out.append(f"  {proc:<12} {'rest':<22} {rest[0]:>3} {rest[1]:>12,.1f} {rest[2]:>9.3f} "
                       f"{rest[3]:>11.3f}   (process total {total:,.1f})")
    return "\n".join(out)


def _spread(z: dict[str, Any], mc: dict[str, Any]) -> str:
    out = []
    for name, r in (("zpath", z), ("MC", mc)):
        for v in ("O", "F"):
            out.append(f"  {name:<5} -{v} runs (s): " + " ".join(f"{t:.4f}" for t in r[v]["times_s"]))
    return "\n".join(out)


def on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)     # unwind through the finally blocks that stop everything


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Pathways-style island dispatch: zpath vs. JAX multi-controller.")
    p.add_argument("--calls-o", type=int, default=500, help="calls per timed -O run (default 500)")
    p.add_argument("--calls-f", type=int, default=20,
                   help=f"calls per timed -F run, {LOOP} computations each (default 20)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (default 5)")
    p.add_argument("--mc-sync", choices=("end", "each", "auto"), default="auto",
                   help="multi-controller: block only at the end of a run ('end'), after every "
                        "call ('each'), or 'end' and fall back to 'each' on a hang (default auto)")
    p.add_argument("--mc-timeout", type=float, default=120.0,
                   help="seconds the multi-controller processes may take to start or for one run "
                        "(default 120); then they are stopped")
    p.add_argument("--mc-load", action="store_true",
                   help="then run MC again with and without a load process that uses as much CPU "
                        "as zpath's controller and workers' I/O threads did: how much of the gap "
                        "sharing the cores with a control plane explains")
    p.add_argument("--threads", action="store_true",
                   help="also print, for -O and -F, each process's CPU and context switches per "
                        "thread and computation (Linux /proc)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--png", metavar="PATH", help="also draw the figures here (matplotlib)")
    args = p.parse_args(argv)
    if args.calls_o < 1 or args.calls_f < 1 or args.repeats < 1:
        p.error("--calls-o, --calls-f and --repeats must be at least 1")
    if args.calls_o >= 1024:
        p.error("--calls-o must be below 1024 (the -O check value 2^n - 1 overflows float64)")
    warm_o, warm_f = min(args.calls_o, 200), min(args.calls_f, 5)

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"island dispatch of `psum(x) + 1.` (float64 scalar per device), 1 island x 2 hosts x "
          f"1 device: -O {args.calls_o} calls/run, -F {args.calls_f} calls x {LOOP}/run, "
          f"median of {args.repeats} runs after a warm-up", flush=True)

    # zpath first: its launcher starts processes before this process starts any
    # JAX backend threads (the multi-controller processes are separate anyway).
    calls = {"O": args.calls_o, "F": args.calls_f}
    notes: list[str] = []
    zb = ZpathBench(warm_o, warm_f)
    try:
        syncs = ["end", "each"] if args.mc_sync == "auto" else [args.mc_sync]
        for sync in syncs:
            mb = McBench(args.calls_o, args.calls_f, warm_o, warm_f, sync, args.mc_timeout)
            try:
                z, mc = measure(zb, mb, calls, args.repeats, args.threads)
                load = measure_load(zb, mb, calls, args.repeats) if args.mc_load else None
                break
            except TimeoutError as e:
                notes.append(str(e))
                print(f"note: {e}; stopped them", flush=True)
                if sync == syncs[-1]:
                    raise
                print("note: retrying with a block after every multi-controller call", flush=True)
                zb.cpu = {v: dict.fromkeys(zb.procs, 0.0) for v in ("O", "F")}
                zb.control = {v: [0.0, 0.0] for v in ("O", "F")}
            finally:
                mb.close()
    finally:
        zb.close()

    import jax

    machine = ab.machine()
    config = {"calls_o": args.calls_o, "calls_f": args.calls_f, "loop": LOOP, "repeats": args.repeats,
              "warmup_o": warm_o, "warmup_f": warm_f, "mc_sync": mc["sync"], "notes": notes,
              "python": platform.python_version(), "jax": jax.__version__, "cpus": os.cpu_count(),
              "machine": machine}
    print(f"python {platform.python_version()}, jax {jax.__version__}, {machine}; "
          f"zpath: client + controller + 2 workers; multi-controller (MC): 2 processes, "
          f"blocking {'after every call' if mc['sync'] == 'each' else 'at the end of a run'}")
    print()
    print(_table(z, mc))
    print("(comp/s: computations per second, median run; MC time = slower of the 2 processes; "
          "zpath/MC: throughput ratio,\n with a 95% bootstrap interval over the side-by-side pairs "
          "of runs: how far the ratio moves with the machine's noise)")
    print()
    print("where the time goes (CPU time per computation over all timed runs):")
    print(_breakdown(z, mc))
    print()
    print(_spread(z, mc))
    if args.threads:
        for v in ("O", "F"):
            print()
            print(f"-{v} per thread (CPU and context switches per computation, all timed -{v} runs):")
            print(threads_table(z, mc, v=v))
    if load is not None:
        print()
        print(LOAD_TITLE)
        print(_load_table(load))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"zpath": z, "multi_controller": mc, "mc_load": load, "config": config}, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.png:
        plots.dispatch(args.png, ["-O", "-F"], [z[v]["comps_per_s"] for v in ("O", "F")],
                       [mc[v]["comps_per_s"] for v in ("O", "F")], [z[v]["ratio_ci"] for v in ("O", "F")],
                       title="psum(x) + 1 on a 2-host island")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
